from __future__ import annotations

import gguf
import torch

from engine import Engine, Request, SamplingParams


def reference_greedy(model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """No cache, full recompute: re-run the whole sequence for every new token."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        tok = int(model.dense_forward(torch.tensor(ids))[-1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok == eos:
            break
    return out


def run_staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                  every: int = 1) -> tuple[list[Request], bool]:
    """Submit one prompt every ``every`` ticks; returns the requests and whether any request
    ever waited in the queue for KV capacity (held no reservation)."""
    reqs: list[Request] = []
    waited_for_kv = False
    pending = list(enumerate(prompts))
    tick = 0
    while pending or engine.has_unfinished():
        if pending and tick % every == 0:
            i, p = pending.pop(0)
            reqs.append(engine.add_request(f"r{i}", p, params))
        waited_for_kv |= any(not engine.kv.has_reservation(r.request_id)
                             for r in engine.scheduler.waiting)
        engine.step()
        tick += 1
    return reqs, waited_for_kv


def gguf_writer(path, arch: str, *, layers: int, context: int, hidden: int, ffn: int,
                heads: int, kv_heads: int, rope_theta: float, eps: float, vocab: int,
                head_dim: int | None = None) -> gguf.GGUFWriter:
    """A GGUF writer with a Llama-family model's hyperparameters set (llama.cpp's keys);
    ``head_dim`` as ``attention.key_length``/``value_length`` when given."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(vocab)
    return w
