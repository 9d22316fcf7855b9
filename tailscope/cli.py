"""``tailscope`` command line. Thin: parses arguments and calls into the packages."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from tailscope import __version__
from tailscope.settings import Settings


def _engine_config(s: Settings):
    from engine import EngineConfig

    return EngineConfig(block_size=s.block_size, kv_cache_bytes=s.kv_cache_mb * 1024 * 1024,
                        max_num_seqs=s.max_num_seqs, max_batched_tokens=s.max_batched_tokens,
                        dtype=s.dtype)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, SamplingParams, load_model
    from engine.loader.paths import TINY, resolve_model_path
    from engine.text import load_tokenizer

    s = Settings.from_env()
    s = replace(s, model=args.model or s.model, dtype=args.dtype or s.dtype)
    if s.threads:
        torch.set_num_threads(s.threads)
    path = resolve_model_path(s.model)
    if path == TINY:
        print("error: the tiny test model has no tokenizer; pass a GGUF or HF model",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = load_model(path, s.dtype)
    tokenizer = load_tokenizer(path)
    engine = Engine(model, _engine_config(s))
    load_s = time.perf_counter() - t0
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    ids = tokenizer.encode(text)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    t1 = time.perf_counter()
    (req,) = engine.generate([ids], params)
    total_s = time.perf_counter() - t1
    if req.error:
        print(f"error: {req.error}", file=sys.stderr)
        return 1
    out = req.output_token_ids
    if out and out[-1] == tokenizer.eos_token_id:
        out = out[:-1]
    print(tokenizer.decode(out, skip_special_tokens=True))
    n = len(req.output_token_ids)
    ttft_ms = (req.token_times_ns[0] - req.arrival_ns) / 1e6
    decode_s = (req.token_times_ns[-1] - req.token_times_ns[0]) / 1e9
    tps = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    print(f"[load {load_s:.2f} s | prompt {len(ids)} tok | TTFT {ttft_ms:.1f} ms | "
          f"{n} tok in {total_s:.2f} s | decode {tps:.1f} tok/s | finish {req.finish_reason}]",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tailscope", description=__doc__)
    p.add_argument("--version", action="version", version=f"tailscope {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt with the engine")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--model", help="'bundled' (default), a .gguf file or an HF directory")
    g.add_argument("--dtype", help="float32 (default) | bfloat16 | float16")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
