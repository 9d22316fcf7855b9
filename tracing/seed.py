"""Synthetic but realistic request records for tests, benchmarks and screenshots.

``synthetic_records`` draws per-stage times (lognormal, so tails exist) for requests arriving
uniformly over a window on a few replicas, builds each record's timeline and takes every stage
and client timing from ``tracing.timing`` as the gateway does (so ``e2e = sum of stages +
streaming = ttft + sum(itl) + tail``), and can inject a regression: extra engine queue time on
one replica for a fraction of its requests. The engine steps of the same window
can be drawn too. Nothing here is used on the request path.
"""

from __future__ import annotations

import itertools
import random

from tracing import timing
from tracing.record import RecordEvent, RequestRecord
from tracing.schema import EngineStepRow


def synthetic_records(n: int, start_us: int, end_us: int, *, replicas=("r0", "r1"),
                      seed: int = 0, slow_replica: str | None = None,
                      slow_fraction: float = 0.0, slow_queue_ms: float = 0.0,
                      tenants=("acme", "globex"), config_id: str = "cfg-a",
                      token_ids: bool = False) -> list[RequestRecord]:
    rng = random.Random(seed)  # the same seed draws the same requests in any window ...
    ids = random.Random(seed * 1_000_003 + start_us)  # ... under ids unique to the window
    out = []
    for i in range(n):
        arrival = start_us + int((end_us - start_us) * i / max(n, 1))
        replica = replicas[i % len(replicas)]
        ingress = rng.lognormvariate(-0.7, 0.3)
        tokenize = rng.lognormvariate(-1.6, 0.3)
        route = rng.lognormvariate(-2.3, 0.3)
        queue = rng.lognormvariate(2.0, 0.6)
        slow = rng.random() < slow_fraction and replica == slow_replica  # always one draw
        if slow:
            queue += slow_queue_ms
        prompt = int(rng.lognormvariate(5.0, 0.8)) + 1
        out_tokens = rng.randint(8, 64)
        prefill = 0.08 * prompt + rng.lognormvariate(1.5, 0.3)
        gaps = [rng.lognormvariate(2.5, 0.25) for _ in range(out_tokens - 1)]
        decode = sum(gaps)
        first_flush_lag = rng.lognormvariate(-1.0, 0.3)
        tail = rng.lognormvariate(-1.5, 0.3)
        state = "FINISHED" if rng.random() > 0.03 else rng.choice(["CANCELLED", "REJECTED"])
        trace_id = f"{ids.getrandbits(128):032x}"
        # the timeline (µs), then every stage and client timing from it, as the gateway does
        marks = list(itertools.accumulate(
            (ingress, tokenize, route, queue, prefill, decode), initial=0.0))
        at = [arrival + int(m * 1000) for m in marks]
        first_flush = at[5] + int(first_flush_lag * 1000)
        flushes = list(itertools.accumulate((int(g * 1000) for g in gaps), initial=first_flush))
        end = flushes[-1] + int(tail * 1000)
        events = [RecordEvent(t, st) for t, st in zip(at, (
            "RECEIVED", "ADMITTED", "TOKENIZED", "ROUTED", "RUNNABLE", "DECODING", state),
            strict=True)]
        events[4:4] = [RecordEvent(at[3], "QUEUED")]
        # why it queued, as the scheduler notes it: the step in progress for a millisecond,
        # then the token budget; the injected slow part waited for KV blocks
        if queue > 1.0:
            events.append(RecordEvent(at[3] + 1000, "WAIT", "budget: seeded"))
        if slow:
            events.append(RecordEvent(at[4] - int(slow_queue_ms * 1000), "WAIT", "kv: seeded"))
        events += [RecordEvent(first_flush, "FIRST_FLUSH"), RecordEvent(end, "END", state)]
        events.sort(key=lambda e: e.ts_us)
        c = timing.client_timings(arrival * 1000, [f * 1000 for f in flushes], end * 1000)
        rec = RequestRecord(
            trace_id=trace_id, span_id=f"{ids.getrandbits(64):016x}", request_id=f"req-{i}",
            response_id=f"chatcmpl-{trace_id}",
            tenant=tenants[i % len(tenants)], endpoint="/v1/chat/completions",
            arrival_ts_us=arrival, final_state=state,
            finish_reason={"FINISHED": "length", "CANCELLED": "cancelled",
                           "REJECTED": "rejected"}[state],
            http_status=429 if state == "REJECTED" else 200, model="SmolLM2-135M-Instruct",
            model_revision="rev-1", engine_version="0.1.0", tokenizer_revision="tok-1",
            gateway_version="0.1.0", config_id=config_id, replica=replica,
            timing_source="engine",
            # every fourth request shared its steps with the other tenant's prefill
            neighbour_tenant=tenants[(i + 1) % len(tenants)] if i % 4 == 0 else "",
            neighbour_prefill_tokens=64 * (1 + i % 3) if i % 4 == 0 else 0,
            prompt_tokens=prompt, cached_tokens=(prompt // 2) if i % 3 == 0 else 0,
            generated_tokens=out_tokens, emitted_tokens=out_tokens,
            input_token_ids=[rng.randrange(49152) for _ in range(prompt)] if token_ids else [],
            output_token_ids=[rng.randrange(49152) for _ in range(out_tokens)]
            if token_ids else [],
            temperature=0.7, top_p=0.95, max_tokens=64, stream=True,
            ttft_ms=c.ttft_ms, tpot_ms=c.tpot_ms, itl_ms=c.itl_ms, tail_ms=c.tail_ms,
            e2e_ms=c.e2e_ms, events=events)
        out.append(timing.apply(rec))
    return out


def synthetic_steps(start_us: int, end_us: int, *, replicas=("r0", "r1"), every_ms: float = 20,
                    seed: int = 0) -> list[EngineStepRow]:
    rng = random.Random(seed)
    rows = []
    for replica in replicas:
        t, step = start_us, 0
        while t < end_us:
            step += 1
            seqs = rng.randint(1, 16)
            rows.append(EngineStepRow(
                replica=replica, incarnation=0, step=step, ts_us=t, duration_ms=every_ms * 0.9,
                num_seqs=seqs, prefill_tokens=rng.choice([0, 0, 64, 128]), decode_tokens=seqs,
                kv_blocks_used=rng.randint(10, 400), kv_blocks_total=512,
                forward_ms=every_ms * 0.7, sample_ms=every_ms * 0.1, host_ms=every_ms * 0.1,
                running=seqs, waiting=rng.randint(0, 8)))
            t += int(every_ms * 1000)
    return rows
