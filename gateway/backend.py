"""The serving code's view of "something that generates": the ``Backend`` interface.

``gateway.serving`` talks only to this: submit a request (token ids and sampling parameters),
read its typed deltas (``engine.protocol.TokenDelta``: new token ids, and at the end its state,
finish reason and timeline), stop or abort it, release it, and ask whether anything is ready.
Flow control (pausing a request whose client stops reading), routing and supervision are the
backend's business. Implementations:

- ``gateway.replicas.ReplicaPool``: engine replica processes over ZeroMQ (the default);
- ``gateway.inprocess.InProcessBackend``: one engine stepped on the event loop's thread pool,
  for tests of the serving code without subprocesses;
- ``NoReplicas``: none at all, for a gateway that serves external backends only.

External OpenAI-compatible servers are served beside them by ``gateway.upstream`` (the records
name the backend in ``replica``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.protocol import TokenDelta
from engine.sampling_params import SamplingParams
from gateway.router import Overloaded

__all__ = ["Backend", "DeadlineExceeded", "DeltaQueue", "NoReplicas", "Overloaded",
           "ReplicaFailed", "Route", "Unencodable"]


class ReplicaFailed(RuntimeError):
    """The replica serving the request failed (or none is ready): the request cannot go on
    there. Put in a request's delta queue, or raised by ``submit``."""


class DeadlineExceeded(RuntimeError):
    """The gateway's deadline for the request passed (its engine request is aborted)."""


class Unencodable(ValueError):
    """The request cannot be carried to a replica (a value out of the wire's range)."""


DeltaQueue = asyncio.Queue  # of TokenDelta | ReplicaFailed | DeadlineExceeded


@dataclass(frozen=True, slots=True)
class Route:
    """Where ``submit`` sent a request, and why."""

    replica: str  # the replica's id (records name it)
    prefix_hit_tokens: int
    reason: str
    model_revision: str = ""
    sent_ns: int = 0  # monotonic time just before the request went out


class Backend(Protocol):
    # called with (replica id, StepReport) for every engine tick (the store's engine_steps)
    on_step: Callable | None
    # called with a request id when a request cancelled for a slow client has ended in its
    # replica (the owner frees its own slot for it)
    on_abandoned: Callable[[str], None] | None

    @property
    def ready(self) -> bool:
        """At least one replica can take requests."""

    @property
    def max_model_len(self) -> int:
        """The context length of the served model (0 until a replica has said)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     queue_timeout_s: float | None = None,
                     exclude: frozenset[str] = frozenset(), cache_salt: str = "",
                     branch_of: str | None = None, deadline: float | None = None,
                     ) -> tuple[Route, DeltaQueue]:
        """Send a request; raises ``ReplicaFailed``, ``Overloaded`` or ``Unencodable``."""

    async def next_delta(self, request_id: str, queue: DeltaQueue
                         ) -> TokenDelta | ReplicaFailed | DeadlineExceeded: ...

    async def stop(self, request_id: str, stop_reason: str | int | None) -> None:
        """The text side matched a stop string: finish normally."""

    async def abort(self, request_id: str) -> None: ...

    def release(self, request_id: str) -> None:
        """The serving code is done with the request (its slot and queue go)."""

    def states(self) -> dict[str, str]:
        """Each replica's state (starting, ready, restarting, crash_loop)."""

    def describe(self) -> dict[str, dict]:
        """Each replica's load and books (``/debug/replicas``, the metrics' gauges)."""


class NoReplicas:
    """The bundled side of a gateway whose every model is an external backend's
    (``tailscope serve --replicas 0 --backend …``): no replica process is started and no model
    is loaded. Nothing is ever routed here: the gateway serves no bundled model name, so a
    request for one is a 404 before it would be submitted."""

    on_step: Callable | None = None
    on_abandoned: Callable[[str], None] | None = None
    ready = False
    max_model_len = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     **_) -> tuple[Route, DeltaQueue]:
        raise ReplicaFailed("this gateway runs no replicas")

    async def next_delta(self, request_id: str, queue: DeltaQueue
                         ) -> TokenDelta | ReplicaFailed | DeadlineExceeded:
        return ReplicaFailed("this gateway runs no replicas")

    async def stop(self, request_id: str, stop_reason: str | int | None) -> None:
        pass

    async def abort(self, request_id: str) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def states(self) -> dict[str, str]:
        return {}

    def describe(self) -> dict[str, dict]:
        return {}
