"""What-if: recorded arrivals through the engine's own scheduler and KV code on a virtual clock,
each step costed by a model fitted from recorded step timings, no model weights loaded.

``simulate`` builds a real ``Engine`` (scheduler, KV manager, prefix cache, preemption, the
scheduling policy, every admission rule) around a ``CostRunner`` in place of the model runner:
a step "runs" in the time ``StepCost`` predicts for its prefill tokens, decode tokens, batch
size and KV in use, and every request whose prompt is computed samples a placeholder token
until it has its recorded number of output tokens (``ignore_eos``). So a candidate config
(another token budget, more sequences per step, another policy) schedules the same arrivals
exactly as a replica running that config would, given those step costs: the only model is the
cost of a step. (Simulators such as Vidur re-implement a scheduler; this one cannot drift from
the engine's, because it is the engine's.)

More: docs/design/engine-notes.md#enginewhatif."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.config import EngineConfig, ModelConfig
from engine.kv_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput, prefill_context

FEATURES = ("intercept", "prefill_tokens", "decode_tokens", "num_seqs", "kv_blocks_used",
            "prefill_context")
PLACEHOLDER_TOKEN = 100  # what a simulated request "samples": only its count matters
OFFSET_MIN_STEPS = 20  # training steps of one token count that give it an offset of its own
OFFSET_SHRINK = 5  # an offset is the residuals' sum over (their count + this): toward 0


@dataclass(frozen=True)
class FitError:
    median_rel: float  # of |predicted - measured| / measured, on held-out steps
    p95_rel: float
    n_train: int
    n_test: int
    # the same median for a constant: every held-out step priced at the training steps' mean
    # duration (what a model without the step's features would say). Step times jitter with
    # the machine and both figures carry that jitter: a fit no better than the constant says
    # the window's steps differ less than the machine's noise.
    baseline_median_rel: float = float("nan")


@dataclass(frozen=True)
class StepCost:
    """A step's duration in ms as a linear function of its ``FEATURES``, plus an offset for
    a step of a token count (prefill + decode tokens) in ``offsets``."""

    coef: tuple[float, ...]  # one per FEATURES entry (fewer: the missing ones cost nothing)
    error: FitError | None = None
    offsets: Mapping[int, float] = field(default_factory=dict)  # tokens in the step -> ms

    def __post_init__(self) -> None:
        if len(self.coef) < len(FEATURES):  # a cost stated before prefill_context was one
            object.__setattr__(self, "coef", (*self.coef,
                                              *[0.0] * (len(FEATURES) - len(self.coef))))

    def predict(self, prefill: int, decode: int, seqs: int, kv_blocks: int,
                prefill_context: int = 0) -> float:
        x = (1.0, prefill, decode, seqs, kv_blocks, prefill_context)
        return max(0.0, sum(c * v for c, v in zip(self.coef, x, strict=True))
                   + self.offsets.get(prefill + decode, 0.0))

    def scaled(self, speed: float) -> StepCost:
        """Every step ``speed`` times as fast (every term alike)."""
        return dataclasses.replace(self, coef=tuple(c / speed for c in self.coef),
                                   offsets={k: v / speed for k, v in self.offsets.items()})

    @staticmethod
    def features(s: dict) -> tuple[int, int, int, int, int]:
        """A recorded step's ``predict`` arguments (an ``engine_steps`` row; a row stored
        before ``prefill_context`` was recorded has none)."""
        return (s["prefill_tokens"], s["decode_tokens"], s["num_seqs"], s["kv_blocks_used"],
                s.get("prefill_context") or 0)

    def step(self, s: dict) -> float:
        """The cost of a recorded step."""
        return self.predict(*self.features(s))

    @classmethod
    def fit(cls, steps: Sequence[dict], holdout_every: int = 5) -> StepCost:
        """From recorded steps (``engine_steps`` rows: duration_ms, prefill_tokens,
        decode_tokens, num_seqs, kv_blocks_used, prefill_context); refuses fewer than 10."""
        if len(steps) < 10:
            raise ValueError(f"{len(steps)} steps are too few to fit a step-cost model "
                             "(need at least 10; widen the window)")
        x = np.array([(1.0, *cls.features(s)) for s in steps], dtype=np.float64)
        y = np.array([s["duration_ms"] for s in steps], dtype=np.float64)
        from scipy.optimize import nnls

        test = np.arange(len(steps)) % holdout_every == holdout_every - 1
        w = 1.0 / np.maximum(y[~test], 1e-3)  # relative error, as it is reported
        coef = nnls(x[~test] * w[:, None], y[~test] * w)[0]
        busy = float((x[~test] @ coef).sum())
        if busy > 0:  # then the shape kept, the total busy time matched: queues add it up
            coef = coef * float(y[~test].sum()) / busy
        tokens = x[:, 1] + x[:, 2]
        offsets = {}
        residual = y - x @ coef
        for m in np.unique(tokens[~test]):
            mine = ~test & (tokens == m)
            if int(mine.sum()) >= OFFSET_MIN_STEPS:
                offsets[int(m)] = float(residual[mine].sum() / (mine.sum() + OFFSET_SHRINK))
        pred = np.maximum(x[test] @ coef + np.array([offsets.get(int(m), 0.0)
                                                      for m in tokens[test]]), 0.0)
        rel = np.abs(pred - y[test]) / np.maximum(y[test], 1e-9)
        flat = np.abs(float(y[~test].mean()) - y[test]) / np.maximum(y[test], 1e-9)
        error = FitError(float(np.median(rel)), float(np.percentile(rel, 95)),
                         int((~test).sum()), int(test.sum()), float(np.median(flat)))
        return cls(tuple(float(c) for c in coef), error, offsets)

    def as_dict(self) -> dict:
        return {"features": list(FEATURES), "coef": list(self.coef),
                "offsets": {str(k): v for k, v in sorted(self.offsets.items())},
                "error": None if self.error is None else dataclasses.asdict(self.error)}


def loop_times(steps: Sequence[dict], max_gap_ms: float = 5.0) -> list[dict]:
    """``steps`` (in time order, with ``ts_us`` and ``duration_ms``) with ``duration_ms``
    replaced by the time to the next step's start when the next one followed within
    ``max_gap_ms`` of this one's end (the loop was busy), else left as it is (idle after)."""
    out = []
    for s, nxt in zip(steps, [*steps[1:], None], strict=True):
        d = dict(s)
        if nxt is not None:
            period = (nxt["ts_us"] - s["ts_us"]) / 1e3
            if 0 <= period - s["duration_ms"] < max_gap_ms:
                d["duration_ms"] = period
        out.append(d)
    return out


def overlaps(steps: Sequence[dict]) -> list[int]:
    """For each step (``replica``, ``ts_us``, ``duration_ms``), how many other replicas had a
    step running at its start: the ``b`` of ``fit_contention`` and ``simulate``."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for s in steps:
        start = float(s["ts_us"])
        spans.setdefault(str(s["replica"]), []).append((start, start + s["duration_ms"] * 1e3))
    for v in spans.values():
        v.sort()
    starts = {r: np.array([a for a, _ in v]) for r, v in spans.items()}
    ends = {r: np.array([b for _, b in v]) for r, v in spans.items()}
    out = []
    for s in steps:
        t, me = float(s["ts_us"]), str(s["replica"])
        b = 0
        for r in spans:
            if r == me:
                continue
            k = int(np.searchsorted(starts[r], t, side="right")) - 1  # last step begun by t
            b += int(k >= 0 and ends[r][k] > t)
        out.append(b)
    return out


def fit_contention(steps: Sequence[dict], cost: StepCost, min_steps: int = 10
                   ) -> float | None:
    """beta in ``duration = cost(step) * (1 + beta * b)``, ``b`` each step's ``overlaps``:
    how much replicas sharing a host slow each other's steps. Fitted on totals, as
    ``StepCost.fit`` keeps the busy time: the time the steps that ran beside another took
    beyond their model cost (``cost``, fitted on the ones that ran alone), over their
    ``b``-weighted model cost. Not least squares on relative error: step times under
    contention are skewed (a tiny-model window, 2 replicas on 2 cores: median 1.03x the
    alone cost, mean 1.21x), and that fit came out at 0 where the busy time was 21% longer.
    None with fewer than ``min_steps`` steps beside another: a window of one replica cannot
    show it."""
    b = np.array(overlaps(steps), dtype=np.float64)
    mask = b > 0
    if int(mask.sum()) < min_steps:
        return None
    sel = [s for s, m in zip(steps, mask, strict=True) if m]
    base = np.array([cost.step(s) for s in sel])
    y = np.array([s["duration_ms"] for s in sel], dtype=np.float64)
    weighted = float((b[mask] * base).sum())
    return max(0.0, float((y - base).sum()) / weighted) if weighted > 0 else None


@dataclass(frozen=True)
class Arrival:
    request_id: str
    at_ms: float  # since the start of the window
    prompt_token_ids: list[int]  # recorded ids (prefix-cache hits as recorded), or stand-ins
    output_tokens: int  # how many it generated
    tenant: str = ""
    priority: int = 0
    cache_salt: str = ""
    # the engine queue timeout it was sent with (the gateway's TAILSCOPE_QUEUE_TIMEOUT_S):
    # past it, still waiting, it ends TIMED_OUT as on a replica (None: it waits for ever)
    queue_timeout_s: float | None = None
    # the output it was allowed (its max_tokens as the engine got it): what the gateway's
    # router counts as its remaining work, not knowing how long it will run (None: the
    # recorded output_tokens)
    max_tokens: int | None = None


@dataclass
class SimRequest:
    request_id: str
    arrival_ms: float
    first_scheduled_ms: float | None = None
    first_token_ms: float | None = None
    token_ms: list[float] = field(default_factory=list)
    end_ms: float | None = None
    state: str = ""

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_ms is None else self.first_token_ms - self.arrival_ms

    @property
    def queue_ms(self) -> float | None:
        return None if self.first_scheduled_ms is None else \
            self.first_scheduled_ms - self.arrival_ms

    @property
    def e2e_ms(self) -> float | None:
        return None if self.end_ms is None else self.end_ms - self.arrival_ms

    @property
    def tpot_ms(self) -> float | None:
        t = self.token_ms
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


class _SimModel:
    """What ``Engine`` reads of a model: its config (KV sizing, the prefix cache's salt)."""

    batch_invariant = False

    def __init__(self, config: ModelConfig) -> None:
        self.config = config


class _NoSampler:
    def release(self, request_id: str) -> None:
        pass


class CostRunner:
    """The model runner's interface without a model: a step takes ``cost``'s time on the
    virtual clock (``now_ms``), and every request whose prompt is computed samples a
    placeholder token."""

    def __init__(self, cost: StepCost, sims: dict[str, SimRequest],
                 contention: float = 0.0, others_busy: Callable[[], int] | None = None) -> None:
        self.cost = cost
        self.sims = sims
        self.now_ms = 0.0
        self.step_start_ms = 0.0  # when the last step began (it ends at now_ms)
        self.contention = contention
        self.others_busy = others_busy  # other replicas on the host mid-step at this instant
        self.sampler = _NoSampler()
        self.steps: list[list[tuple[str, int]]] = []  # each step's (request, tokens)
        self.step_ms: list[float] = []  # and what it cost

    def poll_compile(self) -> bool:  # no compiled step to swap in: the cost model is the step
        return False

    def execute(self, sched: SchedulerOutput, kv: KVCacheManager):
        from engine.model_runner import RunnerResult

        kv.ops_done(kv.take_ops())  # swap copies: instantaneous here
        start = self.now_ms
        usage = kv.usage()
        ms = self.cost.predict(sched.num_prefill_tokens, len(sched.decodes), len(sched.all),
                               usage.blocks_used, prefill_context(sched))
        if self.contention and self.others_busy is not None:
            ms *= 1.0 + self.contention * self.others_busy()
        self.step_start_ms = start
        self.now_ms += ms
        self.steps.append([(s.request.request_id, s.num_new_tokens) for s in sched.all])
        self.step_ms.append(ms)
        sampled = []
        for s in sched.all:
            req = s.request
            sim = self.sims[req.request_id]
            if sim.first_scheduled_ms is None:
                sim.first_scheduled_ms = start
            if req.num_computed_tokens + s.num_new_tokens == req.num_tokens:
                sampled.append((req, PLACEHOLDER_TOKEN, None))
                if sim.first_token_ms is None:
                    sim.first_token_ms = self.now_ms
                sim.token_ms.append(self.now_ms)
        return RunnerResult(sampled, 0.0, ms, 0.0)


class SimReplica:
    """One simulated replica: a real ``Engine`` around a ``CostRunner`` with its own virtual
    clock. It has what a router sees of a replica (``gateway.router.ReplicaView``: ``id``,
    ``ready``, ``inflight``, ``pending_tokens``, ``prefixes``), so the gateway's own routing
    rule can choose among simulated replicas as it does among real ones."""

    ready = True

    def __init__(self, replica_id: str, config: EngineConfig, cost: StepCost,
                 model_config: ModelConfig, sims: dict[str, SimRequest],
                 contention: float = 0.0, others_busy: Callable[[], int] | None = None) -> None:
        from engine.llm_engine import Engine

        self.id = replica_id
        self.runner = CostRunner(cost, sims, contention, others_busy)
        # deadlines run on the virtual clock, like the steps
        self.engine = Engine(_SimModel(model_config), config, runner=self.runner,
                             clock=lambda: int(self.runner.now_ms * 1e6))
        self.inflight: set[str] = set()
        # in-flight requests' output allowances where they differ from the engine's max_tokens
        self.allowed: dict[str, int] = {}
        self.prefixes: OrderedDict[int, None] = OrderedDict()

    @property
    def pending_tokens(self) -> int:
        """The gateway's estimate of work sent and not done, counted as it counts it
        (``gateway.replicas``): a request's whole prompt until its first token, then nothing
        of it, plus the output its ``max_tokens`` still allows (the gateway does not know where
        a prompt's prefill is, nor how long a request will run: an estimate made of the
        recorded output lengths would route with knowledge the real router lacks)."""
        total = 0
        for rid in self.inflight:
            req = self.engine.requests.get(rid)
            if req is not None:
                out = len(req.output_token_ids)
                total += (0 if out else len(req.prompt_token_ids)) + \
                    max(0, self.allowed.get(rid, req.params.max_tokens) - out)
        return total


Route = Callable[[Sequence[SimReplica], "Arrival"], "SimReplica | None"]


def _admit(rep: SimReplica, a: Arrival) -> None:
    """``a`` joins ``rep``: at its time when the replica was idle until then, else when the
    step in progress ends (its queue timeout still counts from its arrival)."""
    if not rep.engine.has_unfinished() and rep.runner.now_ms < a.at_ms:
        rep.runner.now_ms = a.at_ms  # it was idle until this arrival
    late_s = max(0.0, rep.runner.now_ms - a.at_ms) / 1e3  # it came during a step
    rep.engine.add_request(a.request_id, a.prompt_token_ids, SamplingParams(
        max_tokens=max(1, a.output_tokens), ignore_eos=True, tenant=a.tenant,
        priority=a.priority), cache_salt=a.cache_salt,
        queue_timeout_s=None if a.queue_timeout_s is None
        else max(0.0, a.queue_timeout_s - late_s))
    rep.inflight.add(a.request_id)
    if a.max_tokens is not None:  # else its engine max_tokens, the recorded length
        rep.allowed[a.request_id] = a.max_tokens


def _step(rep: SimReplica, sims: dict[str, SimRequest]) -> bool:
    """One step of ``rep``, its finished requests noted; False when it could run nothing and
    still has requests."""
    ran = len(rep.runner.steps)
    for out in rep.engine.step():
        if out.finished:
            sims[out.request_id].end_ms = rep.runner.now_ms
            sims[out.request_id].state = out.state.name
            rep.inflight.discard(out.request_id)
            rep.allowed.pop(out.request_id, None)
    return len(rep.runner.steps) != ran or not rep.engine.has_unfinished()


def simulate(arrivals: Sequence[Arrival], config: EngineConfig, cost: StepCost,
             model_config: ModelConfig, replicas: int = 1, route: Route | None = None,
             contention: float = 0.0) -> tuple[list[SimRequest], list[SimReplica]]:
    """Run ``arrivals`` through ``replicas`` engines of ``config`` on a virtual clock: each
    replica's clock advances by the cost of each of its steps, and an arrival joins its
    replica before the first step that starts at or after its time. ``route`` picks the
    replica of each arrival (``tailscope.whatif`` passes the gateway's router; ``None`` from it
    means shed, as the gateway sheds with 429); with one replica it may be omitted. Returns one
    ``SimRequest`` per arrival and the replicas (each ``runner.steps``: what each step ran).

    ``contention`` (beta, ``fit_contention``): the replicas share one host, and a step that
    starts while ``b`` other replicas are mid-step costs ``1 + beta * b`` times its model cost.
    Other replicas only ever step at or before the earliest clock, so "mid-step at t" is
    exact on the virtual clock: a step that began at or before t and ends after it, or one
    about to begin at t."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    if contention < 0:
        raise ValueError("contention must be >= 0")
    if replicas > 1 and route is None:
        raise ValueError("more than one replica needs a route")
    sims = {a.request_id: SimRequest(a.request_id, a.at_ms) for a in arrivals}
    stuck: set[str] = set()  # could not run anything and nothing more will arrive

    def others_busy(me: str) -> int:
        t = next(r for r in reps if r.id == me).runner.now_ms
        return sum(1 for r in reps if r.id != me and (
            r.runner.step_start_ms <= t < r.runner.now_ms
            or (r.runner.now_ms == t and r.engine.has_unfinished() and r.id not in stuck)))

    reps = [SimReplica(f"r{k}", config, cost, model_config, sims, contention,
                       (lambda me=f"r{k}": others_busy(me)) if replicas > 1 else None)
            for k in range(replicas)]
    pending = sorted(arrivals, key=lambda a: a.at_ms)
    i = 0
    while True:
        busy = [r for r in reps if r.engine.has_unfinished() and r.id not in stuck]
        t_step = min((r.runner.now_ms for r in busy), default=float("inf"))
        if i < len(pending) and pending[i].at_ms <= t_step:
            a = pending[i]
            i += 1
            rep = reps[0] if route is None else route(reps, a)
            if rep is None:
                sims[a.request_id].state = "SHED"
                continue
            _admit(rep, a)
            stuck.discard(rep.id)
            continue
        if not busy:
            break
        rep = min(busy, key=lambda r: (r.runner.now_ms, r.id))
        if not _step(rep, sims):
            # nothing could run (e.g. waiting on KV no running request will free): it waits
            # for the next arrival or the next queue timeout; with neither, its run is over
            now = rep.runner.now_ms
            due = [d / 1e6 for r in rep.engine.scheduler.waiting
                   if (d := r.pending_queue_deadline_ns) is not None and d / 1e6 > now]
            if i < len(pending) and pending[i].at_ms <= now:
                continue  # the next arrival joins first (it may be the one that unblocks it)
            wake = min([*due, *([pending[i].at_ms] if i < len(pending) else [])],
                       default=None)
            if wake is not None:
                rep.runner.now_ms = wake
            else:
                stuck.add(rep.id)
    for rep in reps:
        for req_id in rep.inflight:
            sim = sims[req_id]
            req = rep.engine.requests.get(req_id) or rep.engine.recent.get(req_id)
            sim.state = req.state.name if req is not None and req.state else "UNKNOWN"
    return [sims[a.request_id] for a in arrivals], reps
