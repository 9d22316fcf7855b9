"""Typed messages between the gateway and an engine replica process (msgspec over ZeroMQ).

Replicas see token ids only. Times a replica reports are durations (its own monotonic clock);
the receiver places them on its own timeline and never subtracts readings across processes.
"""

from __future__ import annotations

import msgspec

from engine.observer import RequestStats, StepStats
from engine.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline_s: float | None = None  # the whole request
    queue_timeout_s: float | None = None  # waiting before a tick picks it
    cache_salt: str = ""  # prefix-cache namespace (the tenant's, or a shared one)
    branch_of: str | None = None  # n > 1: fork from this sample of the same request


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str
    error: str | None = None  # why, when it is not the client's own cancellation


class StopRequest(msgspec.Struct, tag="stop"):
    """The text side matched a stop string: finish normally, generate nothing more."""

    request_id: str
    stop_reason: str | int | None = None


class PauseRequest(msgspec.Struct, tag="pause"):
    """The gateway's output buffer for this request is full: stop decoding it for now."""

    request_id: str


class ResumeRequest(msgspec.Struct, tag="resume"):
    request_id: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Hello(msgspec.Struct, tag="hello"):
    """A gateway's offer of a link session, on a signed link (``engine.link``): the replica
    answers with a ``Health`` addressed to it."""


class TokenDelta(msgspec.Struct):
    request_id: str
    token_ids: list[int]
    state: str  # RequestState name
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    stats: RequestStats | None = None  # the state timeline, at the end only
    # per token, when requested: (logprob, [(token id, logprob), ...top])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # with the first token, when requested: per prompt token, the same shape (the first None)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    step: int = 0  # the engine step that produced token_ids (StepStats.step; 0: none)
    # when this delta left the engine, in ms since the request's engine arrival (0: unknown).
    # The gateway places the engine's timeline with it: the engine arrived no later than
    # (receipt - sent_ms) of any delta, so the wait for the replica to read its inbox (the step
    # in progress) is not hidden by anchoring the engine's offsets at the send
    sent_ms: float = 0.0


class StepReport(msgspec.Struct, tag="step"):
    replica: str
    deltas: list[TokenDelta]
    stats: StepStats | None = None  # the tick's stats, None for control-only output
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # the KV pool's books since start: blocks allocated, released, revived from the prefix
    # cache, evictions, prefix-cache queries/hits (tokens), reserved and cached blocks now
    kv_books: dict[str, int] | None = None


class Health(msgspec.Struct, tag="health"):
    """Sent when the replica is ready, then every ``HEALTH_EVERY_S`` (a gateway that started
    after a remote replica learns of it from the next one)."""

    replica: str
    ready: bool
    model: str
    model_revision: str
    kv_blocks_total: int
    max_model_len: int = 0
    detail: str = ""
    # this run of the replica process (pid and start time): a new value from a replica the
    # gateway holds as ready means it restarted, and what it held is gone
    incarnation: str = ""
    rejected: int = 0  # messages it dropped because their signature did not verify
    engine_config: str = ""  # its EngineConfig, JSON (a remote replica must run the gateway's)
    threads: int = 0  # its torch intra-op threads (0: not said, an older replica)
    # its compiled decode step: off, compiling (serving on the eager step meanwhile),
    # compiled, or "failed: why" (still serving, eagerly); "" from an older replica
    compile: str = ""


class Heartbeat(msgspec.Struct, tag="beat"):
    """Sent from the step loop when nothing else was sent for a while: the replica's loop is
    alive (a stopped or wedged process stops sending; the gateway then drains and restarts it)."""

    replica: str
    steps: int = 0


ToReplica = (AddRequest | AbortRequest | StopRequest | PauseRequest | ResumeRequest | Shutdown
             | Hello)
FromReplica = StepReport | Health | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_to_replica = msgspec.msgpack.Decoder(ToReplica)
_from_replica = msgspec.msgpack.Decoder(FromReplica)


def encode(msg: ToReplica | FromReplica) -> bytes:
    return _encoder.encode(msg)


# The largest frame either end takes (ZeroMQ's MAXMSGSIZE: a bigger one is refused while its
# header is read, before anything is allocated, and its connection dropped). The largest
# legitimate messages are a step report carrying prompt logprobs (~320 bytes a prompt token at
# 20 top logprobs: 2.6 MB for an 8k prompt) and an AddRequest (~5 bytes a prompt token plus a
# 1 MiB body's worth of options); a replica splits a report that would pass it.
MAX_MESSAGE_BYTES = 64 << 20


def decode_to_replica(data: bytes) -> ToReplica:
    return _to_replica.decode(data)


def decode_from_replica(data: bytes) -> FromReplica:
    return _from_replica.decode(data)
