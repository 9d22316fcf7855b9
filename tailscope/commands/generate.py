"""``tailscope generate``: one prompt through the engine in this process."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from tailscope.commands.common import (
    add_engine_flags,
    engine_config,
)
from tailscope.settings import Settings


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, SamplingParams, load_configured
    from engine.constrained import GrammarCompiler
    from engine.loader.paths import TINY, resolve_model_path
    from engine.sampling_params import StructuredOutput
    from engine.text import generate_text, load_tokenizer

    s = Settings.from_env()
    s = replace(s, model=args.model or s.model)
    config = engine_config(args)
    if s.threads:
        torch.set_num_threads(s.threads)
    path = resolve_model_path(s.model)
    if isinstance(path, str) and path.startswith(TINY):
        print("error: the tiny test model has no tokenizer; pass a GGUF or HF model",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = load_configured(path, config)
    tokenizer = load_tokenizer(path)
    structured = None
    if args.json_schema is not None:
        schema = json.loads(args.json_schema) if args.json_schema else None
        structured = StructuredOutput.from_response_format(
            {"type": "json_schema", "json_schema": {"schema": schema}} if schema
            else {"type": "json_object"})
    grammar = GrammarCompiler.from_tokenizer(tokenizer, model.config.vocab_size) \
        if structured else None
    # a one-shot command takes the compiled step only where a replica already built it: a
    # build takes minutes, longer than the generation it would speed up
    engine = Engine(model, config, grammar=grammar, defer_compile=True)
    engine.runner.start_compile(build=False)
    load_s = time.perf_counter() - t0
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    ids = tokenizer.encode(text)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, structured=structured)
    t1 = time.perf_counter()
    result = generate_text(engine, tokenizer, "cli-0", ids, params, stop=args.stop or (),
                           on_text=lambda t: print(t, end="", flush=True))
    total_s = time.perf_counter() - t1
    print(flush=True)
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    req = engine.get_request("cli-0")
    n = result.generated_tokens
    ttft_ms = (req.token_times_ns[0] - req.arrival_ns) / 1e6 if n else float("nan")
    decode_s = (req.token_times_ns[-1] - req.token_times_ns[0]) / 1e9 if n else 0.0
    tps = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    stop = f" ({result.stop_reason!r})" if result.stop_reason is not None else ""
    print(f"[load {load_s:.2f} s | prompt {len(ids)} tok | TTFT {ttft_ms:.1f} ms | "
          f"{n} tok in {total_s:.2f} s | decode {tps:.1f} tok/s | "
          f"finish {result.finish_reason}{stop} | compile {engine.runner.compile_state}]",
          file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt with the engine")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--model", help="'bundled' (default), a .gguf file or an HF directory")
    add_engine_flags(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="-1: all tokens")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this share of the top one's probability")
    g.add_argument("--seed", type=int, help="sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json-schema", nargs="?", const="", metavar="SCHEMA",
                   help="constrain output to JSON (optionally to this JSON schema)")
    g.set_defaults(func=cmd_generate)
