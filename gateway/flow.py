"""Flow control between a backend and the HTTP responses reading its deltas, and the gateway's
per-request deadline.

Each request's deltas wait in a queue until its HTTP response takes them. When a queue holds
``max_buffered_deltas`` the backend is told to pause the request (``PauseRequest``: the engine
keeps its KV and gives it no tokens, BACKPRESSURED); when the reader has drained it to half, to
resume it. A request paused longer than ``slow_client_timeout_s``, or whose buffer reaches four
times the limit (deltas already on the wire when it was paused), is aborted with a "client did not
read its stream" error, and its owner is told once the engine has ended it. At a request's
``deadline`` (monotonic seconds) its queue gets a ``DeadlineExceeded`` and the engine request is
aborted, whatever state the backend is in.

``FlowControl`` only decides: it sends its messages through the ``send(request_id, message)``
it was given, so any backend that can deliver ``engine.protocol`` control messages to its engine
(replica processes, the in-process engine) gets the same behaviour.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.protocol import AbortRequest, PauseRequest, ResumeRequest
from gateway.backend import DeadlineExceeded

log = logging.getLogger("tailscope.replicas")


@dataclass(slots=True)
class Flow:
    queue: asyncio.Queue
    paused_since: float | None = None  # monotonic seconds, while BACKPRESSURED
    slow_cancelled: bool = False  # aborted because its client stopped reading
    deadline: float | None = None  # monotonic seconds: the gateway gives up on it then


class FlowControl:
    def __init__(self, send: Callable[[str, object], None], max_buffered_deltas: int = 256,
                 slow_client_timeout_s: float = 30.0) -> None:
        self.send = send
        self.max_buffered_deltas = max_buffered_deltas
        self.slow_client_timeout_s = slow_client_timeout_s
        self.flows: dict[str, Flow] = {}
        self.slow_client_cancels = 0

    def track(self, request_id: str, queue: asyncio.Queue, deadline: float | None = None
              ) -> None:
        self.flows[request_id] = Flow(queue, deadline=deadline)

    def forget(self, request_id: str) -> None:
        self.flows.pop(request_id, None)

    def paused(self, request_id: str) -> bool:
        f = self.flows.get(request_id)
        return f is not None and f.paused_since is not None

    def deliver(self, delta) -> bool:
        """Put a delta (``engine.protocol.TokenDelta``) in its request's queue, if the request
        is tracked, and judge the buffer (``delivered``); True as ``delivered`` says."""
        f = self.flows.get(delta.request_id)
        if f is None:
            return False
        f.queue.put_nowait(delta)
        return self.delivered(delta.request_id, delta.finish_reason is not None)

    def delivered(self, request_id: str, final: bool) -> bool:
        """A delta was put in the request's queue. Returns True when it was the last one of a
        request aborted for its slow client: nobody will read it, the owner should free it."""
        f = self.flows.get(request_id)
        if f is None:
            return False
        if final:
            return f.slow_cancelled
        size = f.queue.qsize()
        if size >= 4 * self.max_buffered_deltas:
            self._cancel_slow(request_id, f, f"its output buffer reached {size} deltas")
        elif size >= self.max_buffered_deltas and f.paused_since is None:
            f.paused_since = time.monotonic()
            self.send(request_id, PauseRequest(request_id))
        return False

    def taken(self, request_id: str) -> None:
        """The reader took a delta: resume a paused request once its buffer has drained."""
        f = self.flows.get(request_id)
        if (f is not None and f.paused_since is not None and not f.slow_cancelled
                and f.queue.qsize() <= self.max_buffered_deltas // 2):
            f.paused_since = None
            self.send(request_id, ResumeRequest(request_id))

    def tick(self, now: float | None = None) -> None:
        """Cancel requests paused too long; expire those past their deadline."""
        now = time.monotonic() if now is None else now
        for rid, f in list(self.flows.items()):
            if (f.paused_since is not None and not f.slow_cancelled
                    and now - f.paused_since > self.slow_client_timeout_s):
                self._cancel_slow(rid, f, f"paused for over {self.slow_client_timeout_s:g} s")
            if f.deadline is not None and now >= f.deadline:
                f.deadline = None  # once
                f.queue.put_nowait(DeadlineExceeded("the request passed the gateway's "
                                                    "deadline (TAILSCOPE_REQUEST_TIMEOUT_S)"))
                self.send(rid, AbortRequest(rid))

    def _cancel_slow(self, request_id: str, f: Flow, why: str) -> None:
        if f.slow_cancelled:
            return
        f.slow_cancelled = True
        self.slow_client_cancels += 1
        log.warning("cancelling %s: the client is not reading its stream (%s)", request_id, why)
        self.send(request_id, AbortRequest(
            request_id, error=f"cancelled: the client did not read its stream ({why})"))
