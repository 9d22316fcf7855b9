"""The sampling pipeline (docs/design/architecture.md), one vectorised pass over the batch per tick:

hard mask + min_tokens' stop mask + logit_bias -> repetition / frequency / presence penalties
-> [greedy: argmax] -> temperature -> top-k -> top-p -> min-p -> typical-p -> renormalise -> draw.

Semantics:
* greedy (``temperature < GREEDY_EPS``): argmax of the processed logits, lowest id on ties
  (``torch.argmax`` returns the first maximum); never a division by the temperature;
* top-k keeps the k best by (-logit, token id) (a stable descending sort);
* top-p keeps the smallest prefix of the sorted distribution whose mass reaches p: a token is
  kept when the mass strictly before it is below p, so the boundary token stays;
* min-p keeps tokens with p >= min_p * p_max (after temperature; the argmax always stays);
* typical-p (Meister et al.): sort by |-log p - H(p)| ascending, keep the smallest prefix whose
  mass reaches typical_p;
* each filter renormalises within its support (filters after top-k see renormalised mass).

Batch invariance: a row's values never depend on other rows. Rows that need a sort take the
sorted path, the others the unsorted one, by the row's own parameters; each request draws from
its own generator (seeded when it has a seed), one draw per generated token, so a seeded request
yields the same tokens whatever else is in the batch and in whatever order requests arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from kernels import native

NEG_INF = float("-inf")
CANDIDATES = 256  # top-k width of the sort-free fast path
SMALL_CANDIDATES = 64  # used when every row's top_k is below it


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability of the chosen token and the ``top_logprobs`` best alternatives, from
    the final distribution the token was drawn from (greedy: log-softmax of the processed
    logits)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: on CPU float32 logits our vectorised kernel where it is built
    (``kernels.native.argmax``, the same indices: torch's CPU argmax is a scalar loop, ~185 us
    a decode step of 8 rows of the bundled model's vocabulary), else torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and native.available():
        return native.argmax(logits)
    return logits.argmax(dim=-1)


def _rows(mask: list[bool]) -> torch.Tensor:
    return torch.tensor([i for i, m in enumerate(mask) if m], dtype=torch.long)


def apply_bias_and_masks(logits: torch.Tensor, reqs: list[Request],
                         eos_ids: tuple[int, ...] = ()) -> None:
    rows, cols, vals = [], [], []
    for i, r in enumerate(reqs):
        for tok, bias in r.params.logit_bias.items():
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
        if r.constraint is not None:
            logits[i].masked_fill_(~r.constraint.allowed_tokens(logits.shape[1]), NEG_INF)
        if r.params.allowed_token_ids is not None:
            _only(logits[i], r.params.allowed_token_ids)
        if len(r.output_token_ids) < r.params.min_tokens:
            _mask_stops(logits[i], r, eos_ids)
    if rows:
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)),
                          torch.tensor(vals, dtype=logits.dtype), accumulate=True)


def _only(row: torch.Tensor, allowed: tuple[int, ...]) -> None:
    """``allowed_token_ids``: every other token gets no mass."""
    idx = torch.tensor(allowed)
    kept = row[idx].clone()
    row.fill_(NEG_INF)
    row[idx] = kept


def _mask_stops(row: torch.Tensor, r: Request, eos_ids: tuple[int, ...]) -> None:
    """``min_tokens``: the tokens that would end the request (EOS unless ``ignore_eos``, its
    ``stop_token_ids``) get no mass yet. A grammar (or ``allowed_token_ids``) that allows
    nothing else keeps them: a constrained output must stay valid, and a row without mass
    cannot be sampled."""
    ids = [t for t in (() if r.params.ignore_eos else eos_ids) + r.params.stop_token_ids
           if t < row.shape[0]]
    if not ids:
        return
    idx = torch.tensor(ids)
    kept = row[idx].clone()
    row[idx] = NEG_INF
    if (r.constraint is not None or r.params.allowed_token_ids is not None) \
            and not bool(torch.isfinite(row).any()):
        row[idx] = kept


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Only tokens a request has seen change, so the work is O(seen tokens), never a pass
    over the vocabulary: each row's prompt + output ids are padded into one ``[n, W]`` table
    (padding repeats a real id, which recomputes the same value), their logits gathered,
    penalised and scattered back in one batched step."""
    which = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if not which:
        return
    sub = [reqs[i] for i in which]
    seen = [r.prompt_token_ids + r.output_token_ids for r in sub]
    width = max(map(len, seen))
    ids = torch.tensor([s + [s[0]] * (width - len(s)) for s in seen])
    out_width = max(len(r.output_token_ids) for r in sub)
    counts = torch.zeros(ids.shape)
    if out_width:
        outs = torch.tensor([r.output_token_ids + [-1] * (out_width - len(r.output_token_ids))
                             for r in sub])
        counts = (ids[:, :, None] == outs[:, None, :]).sum(-1).float()
    rows = torch.tensor(which)[:, None].expand_as(ids)
    z = logits[rows, ids]
    rep = torch.tensor([r.params.repetition_penalty for r in sub])[:, None]
    z = torch.where(z > 0, z / rep, z * rep)
    freq = torch.tensor([r.params.frequency_penalty for r in sub])[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in sub])[:, None]
    logits[rows, ids] = z - freq * counts - pres * (counts > 0).float()


def filter_probs(z: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature-scaled logits ``z`` -> filtered, renormalised probabilities (vocab order)."""
    sort_rows = [r.params.needs_sort for r in reqs]
    # common cases: the whole batch takes one path, so no row copies
    if all(sort_rows):
        return _sorted_filters(z, reqs)
    if not any(sort_rows):
        return _min_p(torch.softmax(z, -1), reqs)
    probs = torch.empty_like(z)
    idx = _rows([not s for s in sort_rows])
    probs[idx] = _min_p(torch.softmax(z[idx], -1), [reqs[i] for i in idx.tolist()])
    idx = _rows(sort_rows)
    probs[idx] = _sorted_filters(z[idx], [reqs[i] for i in idx.tolist()])
    return probs


def _renorm(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum(-1, keepdim=True)


def _min_p(p: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    min_p = torch.tensor([r.params.min_p for r in reqs])[:, None]
    if not bool((min_p > 0).any()):
        return p
    keep = p >= min_p * p.max(-1, keepdim=True).values
    return _renorm(p * keep)


def _sorted_filters(z: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Rows whose support provably lies within the top ``CANDIDATES`` logits take the
    candidate path (a top-k selection instead of a 49k-wide sort: ~15x cheaper); the others,
    and every typical-p row, take the full sort. Both give the same probabilities."""
    n, vocab = z.shape
    out = torch.empty_like(z)
    fast = [vocab > CANDIDATES and r.params.typical_p == 1.0 and r.params.top_k < CANDIDATES
            for r in reqs]
    done = torch.zeros(n, dtype=torch.bool)
    if all(fast):
        probs, ok = _candidate_filters(z, reqs)
        if bool(ok.all()):
            return probs
        out[ok] = probs[ok]
        done = ok
    elif any(fast):
        idx = _rows(fast)
        probs, ok = _candidate_filters(z[idx], [reqs[i] for i in idx.tolist()])
        out[idx[ok]] = probs[ok]
        done[idx[ok]] = True
    rest = (~done).nonzero().flatten()
    if len(rest):
        out[rest] = _full_sort_filters(z[rest], [reqs[i] for i in rest.tolist()])
    return out


def _candidate_filters(z: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    # A narrower selection is cheaper for rows whose top-k fits in it (top-p alone needs more).
    # The width is chosen per row, from the row's own parameters, to keep rows independent.
    small = [0 < r.params.top_k < SMALL_CANDIDATES for r in reqs]
    if all(small) or not any(small):
        return _candidates(z, reqs, SMALL_CANDIDATES if small[0] else CANDIDATES)
    probs = torch.empty_like(z)
    exact = torch.empty(len(reqs), dtype=torch.bool)
    for flag, width in ((True, SMALL_CANDIDATES), (False, CANDIDATES)):
        idx = _rows([s == flag for s in small])
        probs[idx], exact[idx] = _candidates(z[idx], [reqs[i] for i in idx.tolist()], width)
    return probs, exact


def _candidates(z: torch.Tensor, reqs: list[Request], width: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k / top-p / min-p over the ``CANDIDATES`` best logits of each row. Returns the
    probabilities (vocab order) and, per row, whether the result is exact: every token the
    filters keep must be strictly above the smallest candidate value, so no token outside the
    candidates (or tied with one at the edge) could belong to the support."""
    n, vocab = z.shape
    vals, ids = torch.topk(z, width, dim=-1)
    by_id = torch.argsort(ids, dim=-1, stable=True)  # canonical order: (-logit, token id)
    ids, vals = ids.gather(-1, by_id), vals.gather(-1, by_id)
    by_val = torch.argsort(vals, dim=-1, descending=True, stable=True)
    ids, vals = ids.gather(-1, by_val), vals.gather(-1, by_val)
    floor = vals[:, -1]
    pos = torch.arange(width)[None, :]
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs])
    has_k = top_k < width
    sz = vals.masked_fill(pos >= top_k[:, None], NEG_INF)
    lse = torch.logsumexp(sz, -1, keepdim=True)
    if not bool(has_k.all()):  # without top-k the mass is relative to the full vocabulary
        lse = torch.where(has_k[:, None], lse, torch.logsumexp(z, -1, keepdim=True))
    p = torch.exp(sz - lse)
    top_p = torch.tensor([r.params.top_p for r in reqs])[:, None]
    before = torch.cumsum(p, -1) - p
    keep = ((before < top_p) | (pos == 0)) & (pos < top_k[:, None])
    last = keep.sum(-1) - 1
    exact = vals.gather(-1, last[:, None]).squeeze(1) > floor
    exact &= ~keep[:, -1] | has_k
    p = _min_p(_renorm(p * keep), reqs)
    return torch.zeros_like(z).scatter_(-1, ids, p), exact


def _full_sort_filters(z: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    sz, order = torch.sort(z, dim=-1, descending=True, stable=True)  # ties: lower id first
    n, vocab = sz.shape
    pos = torch.arange(vocab)[None, :]
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs])
    sz = sz.masked_fill(pos >= top_k[:, None], NEG_INF)
    p = torch.softmax(sz, -1)
    top_p = torch.tensor([r.params.top_p for r in reqs])[:, None]
    before = torch.cumsum(p, -1) - p  # mass strictly before each token
    p = _renorm(p * ((before < top_p) | (pos == 0)))
    p = _min_p(p, reqs)
    typical = torch.tensor([r.params.typical_p for r in reqs])[:, None]
    if bool((typical < 1).any()):
        p = _typical(p, typical)
    return torch.zeros_like(p).scatter_(-1, order, p)


def _typical(p: torch.Tensor, typical: torch.Tensor) -> torch.Tensor:
    logp = torch.log(p)
    entropy = -(torch.where(p > 0, p * logp, 0.0)).sum(-1, keepdim=True)
    dist = torch.where(p > 0, (-logp - entropy).abs(), float("inf"))
    sd, order = torch.sort(dist, dim=-1, stable=True)
    sp = p.gather(-1, order)
    before = torch.cumsum(sp, -1) - sp
    keep_sorted = (before < typical) & (sp > 0)
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return torch.where(typical < 1, _renorm(p * keep), p)


class Sampler:
    def __init__(self, eos_ids: tuple[int, ...] = ()) -> None:
        """``eos_ids``: the model's end-of-sequence tokens (``min_tokens`` masks them)."""
        self._generators: dict[str, torch.Generator] = {}
        self.eos_ids = tuple(eos_ids)

    def _generator(self, req: Request) -> torch.Generator:
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator()
            if req.params.seed is not None:
                g.manual_seed(req.params.seed)
            else:
                g.seed()
            self._generators[req.request_id] = g
        return g

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """``logits`` ``[len(reqs), vocab]`` float32 (modified in place)."""
        apply_bias_and_masks(logits, reqs, self.eos_ids)
        apply_penalties(logits, reqs)
        greedy = [r.params.greedy for r in reqs]
        tokens = _argmax(logits) if any(greedy) else torch.empty(0, dtype=torch.long)
        final: torch.Tensor | None = None  # probabilities of the sampled rows
        sampled_rows = torch.empty(0, dtype=torch.long)
        if not all(greedy):
            sampled_rows = _rows([not g for g in greedy])
            sub = [reqs[i] for i in sampled_rows.tolist()]
            temp = torch.tensor([r.params.temperature for r in sub])[:, None]
            z = logits if len(sub) == len(reqs) else logits[sampled_rows]
            final = filter_probs(z / temp, sub)
            drawn = self._draw(final, sub)
            if len(sub) == len(reqs):
                tokens = drawn
            else:
                tokens[sampled_rows] = drawn
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(logits, final, sampled_rows, reqs,
                                                        token_list))

    def _draw(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Inverse-CDF draw, one uniform per row from the row's own generator (a per-row
        ``multinomial`` over 49k tokens cost 2 ms a row; this is one batched cumsum)."""
        u = torch.cat([torch.rand(1, generator=self._generator(r)) for r in reqs])
        cdf = torch.cumsum(probs, -1)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
        idx.clamp_(max=probs.shape[1] - 1)
        # float rounding can land on a token without mass (only ever at the tail): take the
        # last token that has mass at or before that position instead
        for row in (probs.gather(-1, idx[:, None]).squeeze(1) == 0).nonzero().flatten().tolist():
            idx[row] = int((probs[row, : idx[row] + 1] > 0).nonzero().max())
        return idx

    def _logprobs(self, logits, final, sampled_rows, reqs, tokens) -> list[TokenLogprobs | None]:
        wanted = [r.params.logprobs for r in reqs]
        if not any(wanted):
            return [None] * len(reqs)
        logp = torch.log_softmax(logits, -1)
        if final is not None:
            logp[sampled_rows] = torch.log(final)
        out: list[TokenLogprobs | None] = []
        for i, r in enumerate(reqs):
            if not wanted[i]:
                out.append(None)
                continue
            k = r.params.top_logprobs
            top: tuple[tuple[int, float], ...] = ()
            if k:
                vals, ids = torch.topk(logp[i], k)
                top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
            out.append(TokenLogprobs(tokens[i], float(logp[i, tokens[i]]), top))
        return out
