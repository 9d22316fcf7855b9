"""Request state machine: an ordered enum, a transition table, and the request dataclass.

States follow docs/concepts/request-path.md. Terminal states compare greater than every live
state, so ``state >= RequestState.REJECTED`` is the terminal test (REJECTED is placed with the
terminals, not first among the admission states, so that the ordering rule holds).
Every transition is an event stamped with ``time.monotonic_ns()``; stage timings are derived
from these events in one place (``engine.observer``), never in the scheduler.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class RequestState(enum.IntEnum):
    QUEUED = 1
    DEGRADED = 2
    RUNNABLE = 3
    PREFILLING = 4
    DECODING = 5
    BACKPRESSURED = 6
    PREEMPTED = 7
    SWAPPED = 8
    RESUMED = 9
    # Terminal states: all compare greater than every live state.
    REJECTED = 10
    FINISHED = 11
    CANCELLED = 12
    TIMED_OUT = 13
    FAILED = 14

    @property
    def is_terminal(self) -> bool:
        return self >= RequestState.REJECTED


S = RequestState
_ENDINGS = {S.CANCELLED, S.TIMED_OUT, S.FAILED}

# None is the state of a request that has not been through admission yet.
TRANSITIONS: dict[RequestState | None, frozenset[RequestState]] = {
    None: frozenset({S.QUEUED, S.REJECTED}),
    S.QUEUED: frozenset({S.RUNNABLE, S.DEGRADED, S.REJECTED} | _ENDINGS),
    S.DEGRADED: frozenset({S.RUNNABLE} | _ENDINGS),
    S.RUNNABLE: frozenset({S.PREFILLING, S.PREEMPTED} | _ENDINGS),
    S.PREFILLING: frozenset({S.DECODING, S.PREEMPTED, S.SWAPPED} | _ENDINGS),
    S.DECODING: frozenset({S.FINISHED, S.BACKPRESSURED, S.PREEMPTED, S.SWAPPED} | _ENDINGS),
    S.BACKPRESSURED: frozenset({S.DECODING, S.PREEMPTED, S.SWAPPED} | _ENDINGS),
    # a forked branch that waits for KV already sampled its first token, which can end it
    S.PREEMPTED: frozenset({S.RESUMED, S.FINISHED} | _ENDINGS),
    S.SWAPPED: frozenset({S.RESUMED} | _ENDINGS),
    S.RESUMED: frozenset({S.PREFILLING, S.DECODING, S.PREEMPTED, S.SWAPPED} | _ENDINGS),
    S.REJECTED: frozenset(),
    S.FINISHED: frozenset(),
    S.CANCELLED: frozenset(),
    S.TIMED_OUT: frozenset(),
    S.FAILED: frozenset(),
}


# Why a waiting request (queued, preempted, swapped out) did not run at a scheduler tick: the
# binding constraint, recorded as a WaitNote when it changes (engine.scheduler).
WAIT_CAUSES = ("step", "budget", "kv", "seqs", "hol", "share")


@dataclass(frozen=True, slots=True)
class WaitNote:
    ts_ns: int
    cause: str  # one of WAIT_CAUSES
    detail: str = ""
    holders: tuple[str, ...] = ()  # the requests holding the budget or the blocks, or ahead


class IllegalTransition(RuntimeError):
    """Raised when a request is moved along an edge the transition table does not have."""


@dataclass(frozen=True, slots=True)
class StateEvent:
    state: RequestState
    ts_ns: int  # time.monotonic_ns() of this process
    detail: str = ""


@dataclass(eq=False)
class Request:
    """One sequence inside the engine: token ids in, token ids out.

    ``num_computed_tokens`` catches up with ``len(all_token_ids)`` (vLLM v1 style), which covers
    chunked prefill and decode in one rule: a request whose computed count reaches its token count
    samples its next token.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    deadline_ns: int | None = None  # monotonic deadline; past it the request ends TIMED_OUT
    # still QUEUED (never picked by a tick) past this monotonic time: ends TIMED_OUT
    queue_deadline_ns: int | None = None
    state: RequestState | None = None
    events: list[StateEvent] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    token_times_ns: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "timeout" | ...
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    error: str | None = None
    reclaim_count: int = 0  # how many times reclaim ran (must end at exactly 1)
    output_logprobs: list[Any] = field(default_factory=list)  # TokenLogprobs | None per token
    # params.prompt_logprobs: one TokenLogprobs per prompt token (None for the first), filled
    # as its prefill chunks run
    prompt_logprobs: list[Any] = field(default_factory=list)
    constraint: Any = None  # engine.constrained.TokenConstraint for structured output
    cache_salt: str = ""  # prefix-cache namespace (the tenant's): hits only within it
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    swapped_kv: Any = None  # its KV in host memory while SWAPPED (kv_manager.SwappedKV)
    swapped_blocks: int = 0
    seq: int = 0  # the scheduler's admission order (ties of arrival_ns break on it)
    branch_parent: str | None = None  # n > 1: forked from this request once it has prefilled
    pending_branches: list[Request] = field(default_factory=list)
    waits: list[WaitNote] = field(default_factory=list)  # why it waited, at each change
    wait_cause: str | None = None  # the cause now (None: not waiting since its last note)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is not None and self.state.is_terminal

    @property
    def pending_queue_deadline_ns(self) -> int | None:
        """Its queue timeout's deadline while it still waits to be admitted (QUEUED or
        DEGRADED); None once admitted, or without a queue timeout."""
        if self.state in (RequestState.QUEUED, RequestState.DEGRADED):
            return self.queue_deadline_ns
        return None

    def transition(self, new: RequestState, detail: str = "", ts_ns: int | None = None) -> None:
        if new not in TRANSITIONS[self.state]:
            old = "NEW" if self.state is None else self.state.name
            raise IllegalTransition(
                f"request {self.request_id}: {old} -> {new.name} is not allowed"
            )
        self.state = new
        self.events.append(StateEvent(new, time.monotonic_ns() if ts_ns is None else ts_ns, detail))
