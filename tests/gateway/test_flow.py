"""Flow control (``gateway.flow``) decided on plain queues, and applied by the in-process backend
to a real engine: a reader that stops pauses its request (BACKPRESSURED, KV kept), one that
reads again resumes it, one that never does is cancelled and its blocks freed."""

from __future__ import annotations

import asyncio

from engine import Engine, EngineConfig, SamplingParams
from engine.protocol import AbortRequest, PauseRequest, ResumeRequest
from engine.request import RequestState
from gateway.backend import DeadlineExceeded
from gateway.flow import FlowControl


def control(max_buffered=4, timeout_s=30.0):
    sent: list[tuple[str, object]] = []
    return FlowControl(lambda rid, msg: sent.append((rid, msg)), max_buffered, timeout_s), sent


def fill(flow, rid, queue, n):
    for _ in range(n):
        queue.put_nowait("delta")
        flow.delivered(rid, final=False)


def test_pause_at_the_limit_resume_at_half_once_each():
    flow, sent = control(max_buffered=4)
    q = asyncio.Queue()
    flow.track("a", q)
    fill(flow, "a", q, 3)
    assert sent == [] and not flow.paused("a")
    fill(flow, "a", q, 3)  # 4th pauses, 5th and 6th do not pause again
    assert [type(m) for _, m in sent] == [PauseRequest] and flow.paused("a")
    for _ in range(3):
        q.get_nowait()
        flow.taken("a")  # 5 then 4 then 3 left: not yet at half (2)
    assert len(sent) == 1
    q.get_nowait()
    flow.taken("a")
    assert [type(m) for _, m in sent] == [PauseRequest, ResumeRequest] and not flow.paused("a")


def test_a_reader_that_never_reads_is_cancelled_by_size_or_time():
    flow, sent = control(max_buffered=4, timeout_s=5.0)
    q1, q2 = asyncio.Queue(), asyncio.Queue()
    flow.track("big", q1)
    flow.track("slow", q2)
    fill(flow, "big", q1, 16)  # four times the limit
    aborts = [m for rid, m in sent if isinstance(m, AbortRequest)]
    assert [a.request_id for a in aborts] == ["big"] and "16 deltas" in aborts[0].error
    fill(flow, "slow", q2, 4)
    flow.tick(now=flow.flows["slow"].paused_since + 4.0)
    assert not any(isinstance(m, AbortRequest) and rid == "slow" for rid, m in sent)
    flow.tick(now=flow.flows["slow"].paused_since + 6.0)
    flow.tick(now=flow.flows["slow"].paused_since + 7.0)  # once only
    slow = [m for rid, m in sent if isinstance(m, AbortRequest) and rid == "slow"]
    assert len(slow) == 1 and "paused for over 5 s" in slow[0].error
    assert flow.slow_client_cancels == 2
    # the engine's last delta of a cancelled request tells the owner to free it
    assert flow.delivered("slow", final=True) is True
    q3 = asyncio.Queue()
    flow.track("fine", q3)
    assert flow.delivered("fine", final=True) is False


def test_deadline_puts_one_error_in_the_queue_and_aborts_once():
    flow, sent = control()
    q = asyncio.Queue()
    flow.track("d", q, deadline=100.0)
    flow.tick(now=99.0)
    assert q.empty() and sent == []
    flow.tick(now=100.0)
    flow.tick(now=101.0)
    assert isinstance(q.get_nowait(), DeadlineExceeded) and q.empty()
    assert [(rid, type(m)) for rid, m in sent] == [("d", AbortRequest)]
    flow.forget("d")
    assert "d" not in flow.flows


def test_the_in_process_backend_pauses_resumes_and_cancels_a_real_engine_request(tiny49k):
    from gateway.inprocess import InProcessBackend

    cfg = EngineConfig(num_kv_blocks=64, block_size=16)

    async def scenario():
        backend = InProcessBackend(Engine(tiny49k, cfg), max_buffered_deltas=8,
                                   slow_client_timeout_s=1.0)
        abandoned: list[str] = []
        backend.on_abandoned = abandoned.append
        await backend.start()
        try:
            params = SamplingParams(max_tokens=60, ignore_eos=True)
            _, q = await backend.submit("r", [1, 2, 3, 4], params)
            for _ in range(200):  # the reader does not read: the request is paused
                await asyncio.sleep(0.02)
                req = backend.engine.get_request("r")
                if req is not None and req.state == RequestState.BACKPRESSURED:
                    break
            req = backend.engine.get_request("r")
            assert req.state == RequestState.BACKPRESSURED and len(req.output_token_ids) < 60
            assert backend.describe()["local"]["paused"] == 1
            tokens = []
            while True:  # reading again resumes it, to the end
                delta = await backend.next_delta("r", q)
                tokens += delta.token_ids
                if delta.finish_reason is not None:
                    break
            assert len(tokens) == 60 and delta.state == "FINISHED"
            backend.release("r")
            _, q2 = await backend.submit("s", [5, 6, 7], params)  # never read: cancelled
            for _ in range(300):
                await asyncio.sleep(0.02)
                if abandoned:
                    break
            assert abandoned == ["s"] and "s" not in backend.queues
            assert backend.engine.kv.usage().blocks_used == 0
            last = [q2.get_nowait() for _ in range(q2.qsize())][-1]
            assert last.state == "CANCELLED" and "did not read" in (last.error or "")
        finally:
            await backend.close()

    asyncio.run(scenario())
