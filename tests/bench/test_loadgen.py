"""The load generator: schedules, statistics, and coordinated omission against a stalling
server (a real HTTP server on loopback; the stall is the injected fault)."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import pytest

from bench import loadgen as L


class StallingServer:
    """Answers /v1/completions at once, except that a request arriving between ``stall_from``
    and ``stall_to`` (monotonic seconds) is held for 2 s: the fault under test."""

    def __init__(self) -> None:
        self.stall_from = self.stall_to = 0.0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(
                asyncio.start_server(self.handle, "127.0.0.1", 0))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def handle(self, reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                               if h.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                if self.stall_from <= time.monotonic() < self.stall_to:
                    await asyncio.sleep(2.0)
                chunks = [{"choices": [{"index": 0, "text": w}]} for w in ("a", "b", "c")]
                chunks.append({"choices": [], "usage": {"prompt_tokens": 4,
                                                        "completion_tokens": 3}})
                body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + \
                    "data: [DONE]\n\n"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body.encode()))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture(scope="module")
def stalling():
    server = StallingServer()
    yield server
    server.loop.call_soon_threadsafe(server.loop.stop)


def items(n: int) -> list[L.Item]:
    return L.workload(n, L.Dist.parse("fixed:8"), L.Dist.parse("fixed:3"), seed=1)


def test_open_loop_sees_the_stall_a_closed_loop_hides(stalling):
    target = L.Target(stalling.url, model="m")
    now = time.monotonic()
    stalling.stall_from, stalling.stall_to = now + 1.0, now + 1.5
    open_rep = L.run(target, "rate", items(150), rate=50.0, seed=3)
    # every request scheduled inside the half-second stall waited >= 2 s
    assert open_rep["requests"] == 150 and open_rep["succeeded"] == 150
    assert open_rep["e2e_ms"]["p99"] >= 2000
    # the generator kept its schedule: a sender that waited on the stalled replies would lag
    # by the whole 2 s stall; a busy machine adds scheduling noise, never seconds
    assert open_rep["send_lag_ms"]["p99"] < 1000
    now = time.monotonic()
    stalling.stall_from, stalling.stall_to = now + 0.1, now + 0.6
    closed = L.run(target, "closed", items(1500), concurrency=1)  # runs past the window
    # one request waited 2 s; the ones that would have been sent meanwhile never were
    assert closed["e2e_ms"]["max"] >= 2000 and closed["e2e_ms"]["p99"] < 1000


def test_poisson_schedule_has_the_right_mean_and_variance_and_is_seeded():
    t = L.arrival_times(20000, rate=50.0, seed=7)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.03)
    assert statistics.pvariance(gaps) == pytest.approx((1 / 50) ** 2, rel=0.06)
    assert L.arrival_times(100, 50.0, seed=7) == t[:100]
    assert L.arrival_times(100, 50.0, seed=8) != t[:100]
    bursty = L.arrival_times(20000, rate=50.0, burstiness=0.5, seed=7)
    g2 = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.fmean(g2) == pytest.approx(1 / 50, rel=0.04)
    assert statistics.pvariance(g2) == pytest.approx(2 * (1 / 50) ** 2, rel=0.1)


def test_percentiles_slo_and_goodput_by_hand():
    xs = [float(i) for i in range(1, 101)]
    assert L.percentile(xs, 50) == 50 and L.percentile(xs, 99) == 99
    assert L.percentile(xs, 100) == 100 and L.percentile([5.0], 99) == 5.0
    lo, hi = L.bootstrap_ci(xs, 99)
    assert 90 <= lo <= 99 <= hi <= 100
    samples = [L.Sample(0, 0, 200, ttft_ms=t, e2e_ms=t + 10, itl_ms=[g, g])
               for t, g in ((100, 10), (200, 30), (600, 10), (300, 60))]
    samples.append(L.Sample(0, 0, 503, e2e_ms=1.0))  # a failure is a miss
    slo = L.slo_stats(samples, duration_s=2.0, ttft_ms=500, tpot_ms=50)
    assert slo["attainment"] == pytest.approx(2 / 5) and slo["goodput_rps"] == 1.0
    rep = L.report(samples, 2.0, {"ttft_ms": 500, "tpot_ms": 50})
    assert rep["succeeded"] == 4 and rep["errors"] == {"503": 1}
    assert rep["error_examples"] == {"503": "HTTP 503"}
    broken = L.Sample(0, 0, None, error="ReadError: [Errno 104] Connection reset by peer")
    assert L.report([broken], 1.0)["error_examples"] == {"ReadError": broken.error}
    assert rep["ttft_ms"]["p50"] == 200 and rep["tpot_ms"]["max"] == 60


def test_length_distributions_and_trace_files(tmp_path):
    import random

    rng = random.Random(0)
    assert L.Dist.parse("fixed:7").draw(rng) == 7
    assert all(3 <= L.Dist.parse("uniform:3:9").draw(rng) <= 9 for _ in range(100))
    med = statistics.median(L.Dist.parse("lognormal:100:0.5").draw(rng) for _ in range(2000))
    assert 90 <= med <= 110
    with pytest.raises(ValueError):
        L.Dist.parse("normal:3")
    shared = L.workload(200, L.Dist.parse("fixed:100"), L.Dist.parse("fixed:4"),
                        shared_prefix=0.5, prefix_len=32, seed=2)
    from collections import Counter

    _, n_shared = Counter(tuple(it.prompt[:32]) for it in shared).most_common(1)[0]
    assert 70 <= n_shared <= 130
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 10.0, "prompt": "hi", "max_tokens": 4}\n'
                     '{"timestamp": 10.5, "prompt": [1, 2], "max_tokens": 2}\n')
    got = L.load_trace(trace)
    assert [it.at for it in got] == [0.0, 0.5] and got[1].prompt == [1, 2]
