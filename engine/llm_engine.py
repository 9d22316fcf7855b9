"""The engine: admission, the step loop (schedule -> run -> postprocess), and one reclaim path.

Token ids in, token ids out. No HTTP, no text, no store: those live in the gateway process.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.constrained import GrammarCompiler
from engine.kv_manager import KVCacheManager
from engine.model import LlamaModel
from engine.model_runner import ModelRunner, RunnerResult
from engine.observer import OutputObserver, RequestStats, StepMember, StepStats
from engine.request import Request, RequestState
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput, prefill_context

log = logging.getLogger(__name__)
S = RequestState


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens and, at the end, how it ended."""

    request_id: str
    new_token_ids: list[int]
    token_times_ns: list[int]
    state: RequestState
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats | None = None
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # with the request's first token: its prompt tokens' logprobs (the first one None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    step: int = 0  # the engine step that produced new_token_ids (StepStats.step)

    @property
    def finished(self) -> bool:
        return self.state.is_terminal


class Engine:
    def __init__(self, model: LlamaModel, config: EngineConfig | None = None,
                 observer: OutputObserver | None = None,
                 grammar: GrammarCompiler | None = None, runner=None,
                 clock: Callable[[], int] = time.monotonic_ns,
                 defer_compile: bool = False) -> None:
        """``grammar`` compiles ``response_format`` constraints; without it such requests
        are rejected. ``runner`` replaces the model runner (``engine.whatif.CostRunner``: the
        same engine on a virtual clock, no weights), and ``clock`` (ns) is what request
        deadlines and queue timeouts are set and judged by (that virtual clock, there).
        ``defer_compile``: the AOT step is loaded or built by ``runner.start_compile()``
        (a replica process serves on the eager step while it builds)."""
        self.grammar = grammar
        self.clock = clock
        self.config = config or EngineConfig(dtype=_dtype_name(model),
                                             batch_invariant=model.batch_invariant)
        if self.config.batch_invariant != model.batch_invariant:
            raise ValueError(f"the engine config says batch_invariant="
                             f"{self.config.batch_invariant} but the model was loaded with "
                             f"batch_invariant={model.batch_invariant}")
        self.model = model
        self._eos_ids = model.config.eos_token_ids  # once: _stop_reason runs per token
        mc = model.config
        self.max_model_len = min(self.config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        num_blocks = self.config.num_blocks_for(mc)
        # the prefix cache's salt: everything that changes KV besides the tokens (the tenant's
        # namespace is added per request)
        self.kv = KVCacheManager(num_blocks, self.config.block_size,
                                 prefix_caching=self.config.prefix_caching,
                                 salt=f"{mc.name}|{mc.revision}|{self.config.dtype}")
        self.runner = runner or ModelRunner(model, num_blocks, self.config.block_size,
                                            compile=self.config.compile,
                                            compile_mode=self.config.compile_mode,
                                            max_batch=self.config.max_num_seqs,
                                            defer_compile=defer_compile)
        self.scheduler = Scheduler(self.config, self.kv)
        self.preemptions = 0  # total, by any mode (the scheduler's decisions)
        self.swaps = 0
        self._last_counts = (0, 0, 0, 0)  # prefix queries, hits, evictions, preemptions
        self.observer = observer or OutputObserver()
        self.requests: dict[str, Request] = {}  # live requests only
        # Finished requests stay findable for a while (late aborts, lookups) without growing
        # without bound in a long-running replica.
        self.recent: OrderedDict[str, Request] = OrderedDict()
        self.recent_limit = 4096
        self.step_count = 0
        self._ended: list[RequestOutput] = []
        # Test hook: called once per reclaim (the accounting tests count calls through it).
        self.on_reclaim: Callable[[Request], None] | None = None

    # ---- admission ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, deadline_s: float | None = None,
                    arrival_ns: int | None = None, queue_timeout_s: float | None = None,
                    cache_salt: str = "", branch_of: str | None = None) -> Request:
        """Admit a request (QUEUED, KV reserved when it fits now) or reject it with a reason
        (REJECTED, ``request.error`` says why). Raises ValueError only for a duplicate id.
        ``deadline_s`` bounds the whole request; ``queue_timeout_s`` only its wait before a
        tick picks it (both end it TIMED_OUT). ``cache_salt`` is its prefix-cache namespace.
        ``branch_of`` names a live request with the same prompt that has not finished its
        prefill (``n`` > 1): this one is forked from it, sharing its prompt blocks, and
        samples its first token from the same logits; otherwise it runs on its own."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already live")
        now = self.clock()
        req = Request(request_id, list(prompt_token_ids), params or SamplingParams(),
                      arrival_ns=arrival_ns or time.monotonic_ns(),  # the timeline's clock
                      deadline_ns=None if deadline_s is None else now + int(deadline_s * 1e9),
                      queue_deadline_ns=None if queue_timeout_s is None
                      else now + int(queue_timeout_s * 1e9), cache_salt=cache_salt)
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token has nothing before it
        self.requests[request_id] = req
        reason = self._rejection(req)
        if reason is not None:
            self._end(req, S.REJECTED, "rejected", error=reason)
            return req
        req.transition(S.QUEUED)
        if req.params.degraded:
            req.transition(S.DEGRADED, req.params.degraded)
        parent = self.requests.get(branch_of) if branch_of else None
        if parent is not None and parent.branch_parent is None and not parent.output_token_ids \
                and parent.prompt_token_ids == req.prompt_token_ids \
                and parent.cache_salt == req.cache_salt \
                and parent.state in (S.QUEUED, S.DEGRADED, S.RUNNABLE, S.PREFILLING,
                                     S.PREEMPTED):
            req.branch_parent = parent.request_id
            parent.pending_branches.append(req)
            return req
        self.scheduler.add(req)
        return req

    # ---- branches ----------------------------------------------------------------------
    def _fork_branches(self, parent: Request, t_ns: int) -> None:
        """The parent's prompt is computed: its pending branches share its blocks now (a
        branch that does not fit waits as a preempted request and recomputes later)."""
        n = len(parent.prompt_token_ids)
        for b in parent.pending_branches:
            b.branch_parent = None
            b.transition(S.RUNNABLE, ts_ns=t_ns)
            reserve = b.max_total_tokens if self.config.preemption == "off" else n
            if self.kv.fork(parent.request_id, b.request_id, n, reserve):
                b.num_computed_tokens = n
                b.num_cached_tokens = n
                b.prompt_logprobs = list(parent.prompt_logprobs)
                b.transition(S.PREFILLING, f"forked from {parent.request_id}", ts_ns=t_ns)
                self.scheduler.add_running(b)
            else:
                b.transition(S.PREEMPTED, "no KV for the branch yet", ts_ns=t_ns)
                self.scheduler.add_waiting(b)
        parent.pending_branches = []

    def _rejection(self, req: Request) -> str | None:
        n, p = len(req.prompt_token_ids), req.params
        vocab = self.model.config.vocab_size
        if n == 0:
            return "prompt is empty"
        if any(not 0 <= t < vocab for t in req.prompt_token_ids):
            return f"prompt has token ids outside the vocabulary [0, {vocab})"
        if n + p.max_tokens > self.max_model_len:
            return (f"prompt ({n} tokens) + max_tokens ({p.max_tokens}) = {n + p.max_tokens} "
                    f"exceeds the context length {self.max_model_len}")
        if not self.kv.can_ever_fit(n + p.max_tokens):
            return (f"prompt + max_tokens needs {self.kv.blocks_needed(n + p.max_tokens)} KV "
                    f"blocks but the pool has {self.kv.pool.num_blocks}")
        try:
            p.check_vocab(vocab)
        except ValueError as exc:
            return str(exc)
        if p.structured is not None:
            if self.grammar is None:
                return "structured output (response_format) needs an engine built with a tokenizer"
            try:
                req.constraint = self.grammar.compile(p.structured)
            except ValueError as exc:
                return f"invalid response_format: {exc}"
        return None

    # ---- termination: every terminal path goes through _end -> _reclaim ---------------
    def get_request(self, request_id: str) -> Request | None:
        """A live request, or a recently finished one."""
        return self.requests.get(request_id) or self.recent.get(request_id)

    def abort(self, request_id: str, reason: str = "cancelled", error: str | None = None) -> bool:
        """Cancel a request. Idempotent: False if it is unknown or already ended."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._end(req, S.CANCELLED, reason, error=error)
        return True

    def stop(self, request_id: str, stop_reason: str | int | None = None) -> bool:
        """Finish a request normally (``finish_reason == "stop"``) because the text side matched
        a stop string. Idempotent like ``abort``; tokens sampled after the match stay counted
        as generated but are never emitted."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        req.stop_reason = stop_reason
        self._end(req, S.FINISHED, "stop")
        return True

    def pause(self, request_id: str) -> bool:
        """The consumer cannot keep up (its output buffer is full): DECODING -> BACKPRESSURED.
        The request keeps its KV but is not scheduled until ``resume``. False if it is not
        decoding (a prefilling request is paused once it starts decoding: the caller retries)."""
        req = self.requests.get(request_id)
        if req is None or req.state != S.DECODING:
            return False
        req.transition(S.BACKPRESSURED, "output buffer full")
        return True

    def resume(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.state != S.BACKPRESSURED:
            return False
        req.transition(S.DECODING, "output buffer drained")
        return True

    def _end(self, req: Request, state: RequestState, reason: str, error: str | None = None,
             last_token: int | None = None) -> None:
        """The one way a request ends: transition, reclaim, stats, and its terminal output
        (carrying ``last_token`` when the ending token was just sampled)."""
        if req.reclaim_count:  # already reclaimed: cancel/timeout races end here
            return
        req.transition(state, reason)
        req.finish_reason = reason
        req.error = error
        self._reclaim(req)
        stats = self.observer.on_request_end(req)
        tokens = [] if last_token is None else [last_token]
        times = [req.token_times_ns[-1]] if tokens else []
        lps = [req.output_logprobs[-1]] if tokens else []
        # a last token is sampled in the step being run (recorded right after _postprocess)
        self._ended.append(RequestOutput(req.request_id, tokens, times, state, reason, error,
                                         stats, lps, self._prompt_logprobs(req),
                                         self.step_count + 1 if tokens else 0))

    @staticmethod
    def _prompt_logprobs(req: Request) -> list[TokenLogprobs | None] | None:
        """The prompt logprobs, once: with the request's first token."""
        if req.params.prompt_logprobs is None or len(req.output_token_ids) != 1:
            return None
        return req.prompt_logprobs

    def _reclaim(self, req: Request) -> None:
        """Release everything the request holds: batch slot, KV blocks (shared ones return to
        the pool only when their last holder frees them), reservation, RNG state."""
        req.reclaim_count += 1
        self.requests.pop(req.request_id, None)
        if req.branch_parent is not None:  # a branch that never forked
            parent = self.requests.get(req.branch_parent)
            if parent is not None and req in parent.pending_branches:
                parent.pending_branches.remove(req)
        for b in req.pending_branches:  # its parent ended before its prefill: run on its own
            b.branch_parent = None
            self.scheduler.add(b)
        req.pending_branches = []
        req.swapped_kv = None
        self.recent[req.request_id] = req
        while len(self.recent) > self.recent_limit:
            self.recent.popitem(last=False)
        self.scheduler.remove(req)
        self.kv.free(req.request_id)
        self.runner.sampler.release(req.request_id)
        if self.on_reclaim is not None:
            self.on_reclaim(req)

    # ---- the step loop -------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One tick: schedule -> run -> postprocess."""
        start, wall = time.monotonic_ns(), time.time_ns()
        self.runner.poll_compile()
        self._expire(self.clock())
        sched = self.scheduler.schedule()
        self.preemptions += len(sched.preempted)
        self.swaps += sum(1 for p in sched.preempted if p.mode == "swap")
        if sched.is_empty:
            return self._drain_ended([])
        context = prefill_context(sched)  # before the run moves the computed counts
        result = self._run(sched)
        if result is None:
            return self._drain_ended([])
        outputs = self._postprocess(sched, result)
        self._record_step(sched, result, start, wall, context)
        return self._drain_ended(outputs)

    def _expire(self, now: int) -> None:
        """End requests past their deadline (or their queue timeout, while still waiting)."""
        live = [*self.scheduler.running, *self.scheduler.waiting]
        live += [b for r in live for b in r.pending_branches]  # n > 1 samples not forked yet
        for req in live:
            d, q = req.deadline_ns, req.queue_deadline_ns
            if (d is None or now < d) and (q is None or now < q):
                continue  # the common case, in plain attribute reads: this runs every tick
            if req.is_finished:  # ended earlier in this loop
                continue
            if d is not None and now >= d:
                self._end(req, S.TIMED_OUT, "timeout", error="request deadline exceeded")
            elif (due := req.pending_queue_deadline_ns) is not None and now >= due:
                self._end(req, S.TIMED_OUT, "timeout",
                          error="waited in the engine queue past its queue timeout")

    def _run(self, sched: SchedulerOutput) -> RunnerResult | None:
        """The forward and sampling; a failed forward fails its batch, never the engine."""
        for s in sched.prefills:
            if s.request.state in (S.RUNNABLE, S.RESUMED):
                s.request.transition(S.PREFILLING)
        try:
            return self.runner.execute(sched, self.kv)
        except Exception as exc:
            log.exception("forward failed for %d requests", len(sched.all))
            for s in sched.all:
                self._end(s.request, S.FAILED, "error", error=f"{type(exc).__name__}: {exc}")
            return None

    def _postprocess(self, sched: SchedulerOutput, result: RunnerResult
                     ) -> list[RequestOutput]:
        """Commit computed KV, fork branches, append sampled tokens, end what stops."""
        t_tok = time.monotonic_ns()
        for s in sched.all:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.kv.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if req.pending_branches and req.num_computed_tokens == req.num_tokens:
                self._fork_branches(req, t_tok)
        for req, entries in result.prompt_logprobs:
            req.prompt_logprobs.extend(entries)
        for req, error in result.failed:  # only its own request fails
            self._end(req, S.FAILED, "error", error=error)
        outputs = []
        for req, token, logprobs in result.sampled:
            if req.is_finished:  # a branch cancelled while its parent's forward ran
                continue
            if req.state == S.PREFILLING:
                req.transition(S.DECODING, ts_ns=t_tok)
            req.output_token_ids.append(token)
            req.output_logprobs.append(logprobs)
            req.token_times_ns.append(t_tok)
            reason = self._stop_reason(req, token)
            if req.constraint is not None:
                try:
                    req.constraint.accept(token)
                except ValueError as exc:
                    self._end(req, S.FAILED, "error", error=str(exc), last_token=token)
                    continue
            if reason is not None:
                self._end(req, S.FINISHED, reason, last_token=token)
            else:
                outputs.append(RequestOutput(req.request_id, [token], [t_tok], req.state,
                                             new_logprobs=[logprobs],
                                             prompt_logprobs=self._prompt_logprobs(req),
                                             step=self.step_count + 1))
        return outputs

    def _record_step(self, sched: SchedulerOutput, result: RunnerResult, start: int,
                     wall: int, context: int = 0) -> None:
        self.step_count += 1
        usage = self.kv.usage()
        c = self.kv.pool.counters
        now = (c.queries, c.hits, c.evictions, self.preemptions)
        delta = [a - b for a, b in zip(now, self._last_counts, strict=True)]
        self._last_counts = now
        self.observer.on_step(StepStats(
            step=self.step_count, wall_ns=wall, duration_ms=(time.monotonic_ns() - start) / 1e6,
            num_seqs=len(sched.all), prefill_tokens=sched.num_prefill_tokens,
            decode_tokens=len(sched.decodes), kv_blocks_used=usage.blocks_used,
            kv_blocks_total=usage.blocks_total, forward_ms=result.forward_ms,
            sample_ms=result.sample_ms, host_ms=result.host_ms, prefix_queries=delta[0],
            prefix_hits=delta[1], evictions=delta[2], preemptions=delta[3],
            members=tuple([StepMember(s.request.request_id, 0, 1) for s in sched.decodes]
                          + [StepMember(s.request.request_id, s.num_new_tokens, 0)
                             for s in sched.prefills]) if self.config.step_detail else (),
            prefill_context=context,
        ))

    def _drain_ended(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        outputs.extend(self._ended)
        self._ended.clear()
        return outputs

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if not p.ignore_eos and token in self._eos_ids:
            return "stop"
        if token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- convenience -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None
                 ) -> list[Request]:
        """Run prompts to completion (all submitted at once); returns the finished requests."""
        base = self.step_count
        reqs = [self.add_request(f"gen-{base}-{i}", p, params) for i, p in enumerate(prompts)]
        while self.has_unfinished():
            self.step()
        return reqs


def _dtype_name(model: LlamaModel) -> str:
    return str(model.dtype).removeprefix("torch.")
