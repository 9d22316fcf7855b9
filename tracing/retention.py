"""Tail-based retention: full detail for the requests worth debugging, counts for the rest.

Full detail is a record's token ids, its ITL array and its tokens' engine steps (everything
else, the stage columns, counts, timeline and wait causes, is always kept). It is kept for
every request above the sliding per-model ``quantile`` of E2E or of TTFT (the last
``window`` finished requests of that model), for every request that did not finish, during a
model's warm-up (its first ``warmup`` requests, before the quantile means anything), and for a
``sample`` share of the rest; the others lose it. The decision is made when the request ends
and is written on the row (``detail_kept``, ``detail_reason``). A tenant's ``capture = "counts"``
still wins: its records never carry token ids.

Why decide at the end rather than sample up front: a p99 request is only known to be one once
it has ended, and it is exactly the one an engineer opens in the drill-down.
"""

from __future__ import annotations

import bisect
import random
from collections import deque

from tracing.record import RequestRecord


class _Window:
    """The last ``size`` values, kept sorted too, for a quantile in O(log n) per value."""

    def __init__(self, size: int) -> None:
        self.order: deque[float] = deque()
        self.sorted: list[float] = []
        self.size = size

    def add(self, value: float) -> None:
        self.order.append(value)
        bisect.insort(self.sorted, value)
        if len(self.order) > self.size:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]

    def cut(self, q: float) -> float:
        return self.sorted[min(len(self.sorted) - 1, int(q * len(self.sorted)))]


class TailRetention:
    def __init__(self, sample: float = 1.0, quantile: float = 0.99, window: int = 1000,
                 warmup: int = 100, seed: int | None = None) -> None:
        if not 0 <= sample <= 1 or not 0 < quantile < 1 or window < 1 or warmup < 0:
            raise ValueError("detail retention: sample in [0, 1], quantile in (0, 1), "
                             "window >= 1, warmup >= 0")
        self.sample, self.quantile, self.window, self.warmup = sample, quantile, window, warmup
        self._rng = random.Random(seed)
        self._e2e: dict[str, _Window] = {}
        self._ttft: dict[str, _Window] = {}
        self._seen: dict[str, int] = {}

    def decide(self, r: RequestRecord) -> RequestRecord:
        """Set ``detail_kept``/``detail_reason`` on a finished record and drop its detail when
        it is not kept. Everything off (``sample`` 1) keeps it all."""
        r.keep_detail(self._reason(r))
        return r

    def _reason(self, r: RequestRecord) -> str:
        if self.sample >= 1:
            return "all"
        if r.final_state != "FINISHED":
            return "not_finished"
        e2e, ttft = self._e2e.get(r.model), self._ttft.get(r.model)
        if e2e is None or ttft is None:  # a model's first request (not a pair made per call)
            e2e = self._e2e[r.model] = _Window(self.window)
            ttft = self._ttft[r.model] = _Window(self.window)
        seen = self._seen[r.model] = self._seen.get(r.model, 0) + 1
        e2e_cut = e2e.cut(self.quantile) if e2e.sorted else None
        ttft_cut = ttft.cut(self.quantile) if ttft.sorted else None
        e2e.add(r.e2e_ms)
        if r.ttft_ms is not None:
            ttft.add(r.ttft_ms)
        if seen <= self.warmup:
            return "warmup"
        if e2e_cut is not None and r.e2e_ms > e2e_cut:
            return "tail_e2e"
        if ttft_cut is not None and r.ttft_ms is not None and r.ttft_ms > ttft_cut:
            return "tail_ttft"
        return "sampled" if self._rng.random() < self.sample else "dropped"
