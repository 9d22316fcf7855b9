from __future__ import annotations

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
