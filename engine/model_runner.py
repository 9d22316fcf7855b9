"""Turns a scheduler output into one model forward over paged KV, and samples."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import time
from dataclasses import dataclass, field

import torch

import kernels
from engine.kv_manager import KVCacheManager
from engine.model import AttentionMetadata, LlamaModel, PrefillSeq
from engine.request import Request
from engine.sampler import Sampler, TokenLogprobs
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerResult:
    sampled: list[tuple[Request, int, TokenLogprobs | None]]
    host_ms: float
    forward_ms: float
    sample_ms: float
    failed: list[tuple[Request, str]] = field(default_factory=list)  # rows that could not sample
    # requests that asked for prompt logprobs: (request, entries for its next prompt tokens)
    prompt_logprobs: list[tuple[Request, list[TokenLogprobs]]] = field(default_factory=list)


def _tune_allocator() -> None:
    """Keep glibc from returning freed memory to the OS between steps.

    Every layer gathers ~10 MB of K/V per step into temporaries; with glibc's defaults those
    are mmapped or trimmed on free and page-faulted back in the next layer, which cost 40% of a
    batch-28 decode step here (474 -> 295 ms). Serving reuses the same peak every step, so
    raising the mmap and trim thresholds trades no peak memory for far fewer page faults.
    First, what loading the weights freed goes back to the OS (``malloc_trim``: its
    temporaries stayed in the heap, ~20 MB of the bundled model's resident memory here).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        libc.mallopt(_M_MMAP_THRESHOLD, 64 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):  # not glibc: keep the platform's allocator defaults
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose memory becomes resident only where it is written.

    A KV pool is the engine's largest allocation (512 MiB by default), and ``torch.zeros``
    writes every byte of it at start, so a replica held its whole budget from the first second
    whatever its traffic. Here the tensor is a private anonymous mapping of its own: the kernel
    gives its pages out zero-filled on first touch (reading an untouched page maps the shared
    zero page, which costs nothing), and ``BlockPool`` hands out the lowest free block ids
    first, so the resident part is the high-water mark of the blocks in use and cached, not
    the budget. Under traffic that keeps the prefix cache full it still grows to the whole
    budget. One mapping per tensor: views of one shared mapping would alias each other, and
    ``torch.compile`` treats mutated aliased inputs specially."""
    size = math.prod(shape) * dtype.itemsize
    if not size or not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows: no such flags)
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps the mapping alive (torch.frombuffer holds a reference to its buffer)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 compile: bool = False, compile_mode: str = "jit", max_batch: int = 256,
                 defer_compile: bool = False) -> None:
        """``compile``: decode-only steps run the model's ``torch.compile``d step
        (``LlamaModel.compile_decode``), compiled here, before the first request; with
        ``compile_mode`` ``aot``, the same step compiled ahead of time for batches of up to
        ``max_batch`` sequences (``engine.aot``), loaded (built first if need be) here, or
        with ``defer_compile`` by ``start_compile`` (in the background)."""
        kernels.kernel_backend()  # refuse an unknown TAILSCOPE_KERNELS before loading anything
        _tune_allocator()
        c = model.config
        self.model = model
        self.block_size = block_size
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [
            (zero_pages(shape, model.dtype), zero_pages(shape, model.dtype))
            for _ in range(c.num_layers)
        ]
        self.sampler = Sampler(c.eos_token_ids)
        self.compile_s = 0.0
        # off, compiled, or with start_compile: compiling, then compiled or failed: ...
        self.compile_state = "compiled" if compile else "off"
        self._aot_batch = min(max_batch, num_blocks * block_size)  # never more than slots
        self._build = None  # start_compile's: (engine.aot.Build, its thread, its outcome)
        if compile and compile_mode == "aot" and not defer_compile:
            from engine import aot

            t = time.perf_counter()
            model.use_aot_decode(aot.load(model, self.kv_caches, self._aot_batch))
            self.compile_s = time.perf_counter() - t
        elif compile and compile_mode == "aot":
            self.compile_state = "deferred"
        elif compile:
            self._compile()

    def start_compile(self, build: bool = True) -> None:
        """With ``defer_compile``: load the AOT step now if the cache holds it, else build it
        in the background (a thread waiting on the build child) while steps run eagerly;
        ``poll_compile`` between two steps swaps it in. A replica calls this once warm.
        ``build=False`` (a one-shot command): only a cached build is used, none is started."""
        if self.compile_state != "deferred":
            return
        import threading

        from engine import aot

        t = time.perf_counter()
        if aot.is_built(self.model, self.kv_caches, self._aot_batch):
            self.model.use_aot_decode(aot.load(self.model, self.kv_caches, self._aot_batch))
            self.compile_s, self.compile_state = time.perf_counter() - t, "compiled"
            return
        if not build:
            self.compile_state = "off: not built yet (a replica builds it in the background)"
            return
        build, outcome = aot.Build(), {}

        def run() -> None:
            try:
                outcome["aot"] = aot.load(self.model, self.kv_caches, self._aot_batch, build)
            except Exception as exc:  # noqa: BLE001 (reported by poll_compile, never raised)
                outcome["error"] = exc
            outcome["s"] = time.perf_counter() - t

        thread = threading.Thread(target=run, name="aot-build", daemon=True)
        self._build = (build, thread, outcome)
        self.compile_state = "compiling"
        thread.start()

    def poll_compile(self) -> bool:
        """Between two steps: swap in the background build's step once it is ready (the next
        decode-only step runs it). True when the state changed."""
        if self._build is None or self._build[1].is_alive():
            return False
        _, _, outcome = self._build
        self._build = None
        self.compile_s = outcome.get("s", 0.0)
        if "aot" in outcome:
            self.model.use_aot_decode(outcome["aot"])
            self.compile_state = "compiled"
            log.info("the compiled decode step is in use (built in the background in %.1f s)",
                     self.compile_s)
        else:
            exc = outcome.get("error")
            self.compile_state = f"failed: {exc}"[:500]
            log.error("the decode step's background build failed; serving on the eager step: "
                      "%s", exc)
        return True

    def close(self) -> None:
        """Stop a background build still running (its child is killed)."""
        if self._build is not None:
            self._build[0].cancel()

    @torch.inference_mode()
    def _compile(self) -> None:
        """Compile the decode step for every graph serving will need (a batch of one: torch
        specialises size 1; of two and more; with packed weights that keep a dense copy, past
        their ``max_rows`` rows, where they switch to it), on dummy decodes attending to block
        0, each writing its own slot of the first blocks (a batch past one block's slots writes
        into the next). Those blocks are free now; whatever they write there is overwritten
        before any sequence reads it (a slot is written before it is attended)."""
        t = time.perf_counter()
        self.model.compile_decode()
        rows = {1, 2}
        # a batch of more sequences than the pool has slots never runs: not compiled for either
        slots = self.kv_caches[0][0].shape[0] * self.block_size
        for lw in self.model.layers:
            if getattr(lw.qkv, "dense", None) is not None:  # a packed kernel with a dense copy
                rows.add(min(lw.qkv.max_rows + 1, slots))
        for b in sorted(rows):
            meta = AttentionMetadata(slot_mapping=torch.arange(b), num_decodes=b,
                                     decode_block_tables=torch.zeros(b, 1, dtype=torch.long),
                                     decode_context_lens=torch.ones(b, dtype=torch.long))
            self.model.forward(torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long),
                               meta, self.kv_caches, torch.arange(b))
        # inductor compiles in a pool of worker processes, kept alive for later compiles:
        # there will be none (every graph is made), so they go
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
        self.compile_s = time.perf_counter() - t
        log.info("decode step compiled in %.1f s (batch sizes %s)", self.compile_s,
                 sorted(rows))

    def copy_blocks_out(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host copies of these blocks' K/V in every layer (swap-out for preemption)."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.kv_caches]

    def copy_blocks_in(self, block_ids: list[int],
                       saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write saved K/V into (possibly different) physical blocks (swap-in)."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        for (k, v), (sk, sv) in zip(self.kv_caches, saved, strict=True):
            k.index_copy_(0, idx, sk)
            v.index_copy_(0, idx, sv)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` gets block ``src``'s K/V in every layer."""
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def run_pending_ops(self, kv: KVCacheManager) -> None:
        """Run the KV manager's queued copies in order (consecutive block copies batched)."""
        ops = kv.take_ops()
        try:
            i = 0
            while i < len(ops):
                op = ops[i]
                if op.kind == "copy":
                    j = i
                    while j < len(ops) and ops[j].kind == "copy":
                        j += 1
                    self.copy_blocks([(o.blocks[0], o.blocks[1]) for o in ops[i:j]])
                    i = j
                    continue
                if op.kind == "out":
                    op.host.data = self.copy_blocks_out(list(op.blocks))
                else:
                    self.copy_blocks_in(list(op.blocks), op.host.data)
                i += 1
        finally:
            kv.ops_done(ops)

    @property
    def kv_cache_bytes(self) -> int:
        k, _ = self.kv_caches[0]
        return 2 * len(self.kv_caches) * k.numel() * k.element_size()

    def _inputs(self, sched: SchedulerOutput, kv: KVCacheManager):
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        samplers: list[Request] = []
        scored: list[tuple[Request, int, list[int]]] = []  # prompt logprobs: request, rows
        tables, ctx_lens = [], []
        for s in sched.decodes:
            req = s.request
            pos = req.num_computed_tokens
            table = kv.block_table(req.request_id)
            logits_idx.append(len(ids))
            samplers.append(req)
            ids.append(req.all_token_ids[pos])
            positions.append(pos)
            slots.append(table.slot(pos))
            tables.append(table.blocks)
            ctx_lens.append(pos + 1)
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long),
                                 num_decodes=len(sched.decodes))
        if tables:
            width = max(len(t) for t in tables)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            meta.decode_context_lens = torch.tensor(ctx_lens)
        for s in sched.prefills:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            table = kv.block_table(req.request_id)
            meta.prefills.append(PrefillSeq(len(ids), len(ids) + s.num_new_tokens, end,
                                            torch.tensor(table.blocks, dtype=torch.long)))
            if req.params.prompt_logprobs is not None:
                # logits at position p score prompt token p + 1: the rows of this chunk that
                # score prompt tokens not scored yet (a recompute after preemption skips them)
                first = max(start, len(req.prompt_logprobs) - 1)
                last = min(end, len(req.prompt_token_ids) - 1)
                if first < last:
                    base = len(ids) - start
                    scored.append((req, first + 1, [base + p for p in range(first, last)]))
            ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table.slot(p) for p in range(start, end))
            if end == req.num_tokens:  # whole prompt computed: this forward yields token one
                logits_idx.append(len(ids) - 1)
                samplers.append(req)
                for branch in req.pending_branches:  # n > 1: each branch samples its own
                    logits_idx.append(len(ids) - 1)  # first token from the same logits
                    samplers.append(branch)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long)
        for _, _, rows in scored:  # after the sampling rows: the sampler sees only those
            logits_idx.extend(rows)
        return (torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                meta, torch.tensor(logits_idx, dtype=torch.long), samplers, scored)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> RunnerResult:
        t0 = time.perf_counter_ns()
        self.run_pending_ops(kv)  # queued copies before anything writes into their blocks
        ids, positions, meta, logits_idx, samplers, scored = self._inputs(sched, kv)
        t1 = time.perf_counter_ns()
        logits = self.model.forward(ids, positions, meta, self.kv_caches, logits_idx)
        t2 = time.perf_counter_ns()
        prompt_lps = self._score(logits[len(samplers):], scored) if scored else []
        sampled, failed = self._sample(logits[:len(samplers)], samplers)
        t3 = time.perf_counter_ns()
        return RunnerResult(sampled, (t1 - t0) / 1e6, (t2 - t1) / 1e6, (t3 - t2) / 1e6, failed,
                            prompt_lps)

    @staticmethod
    def _score(logits: torch.Tensor, scored: list[tuple[Request, int, list[int]]]
               ) -> list[tuple[Request, list[TokenLogprobs]]]:
        """Prompt logprobs from the raw model distribution (log-softmax in fp32): each row's
        logprob of the prompt token that follows it, and its top alternatives."""
        logp = torch.log_softmax(logits.float(), -1)
        out, at = [], 0
        for req, target, rows in scored:
            n, k = len(rows), req.params.prompt_logprobs or 0
            block = logp[at:at + n]
            tokens = req.prompt_token_ids[target:target + n]
            chosen = block.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
            tops: list[tuple[tuple[int, float], ...]] = [()] * n
            if k:
                vals, idx = torch.topk(block, k, dim=-1)
                tops = [tuple(zip(i, v, strict=True))
                        for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
            out.append((req, [TokenLogprobs(t, lp, top)
                              for t, lp, top in zip(tokens, chosen, tops, strict=True)]))
            at += n
        return out

    def _sample(self, logits: torch.Tensor, reqs: list[Request]):
        """Sample the batch; if that fails, sample each row alone from the untouched logits
        (the sampler edits them in place), so one request's bad state fails only itself."""
        if not reqs:
            return [], []
        original = logits.clone() if len(reqs) > 1 else logits
        try:
            out = self.sampler.sample(logits, reqs)
            return list(zip(reqs, out.token_ids, out.logprobs, strict=True)), []
        except Exception as exc:
            if len(reqs) == 1:
                log.exception("sampling failed for %s", reqs[0].request_id)
                return [], [(reqs[0], f"sampling failed: {type(exc).__name__}: {exc}")]
        sampled, failed = [], []
        for i, req in enumerate(reqs):
            try:
                out = self.sampler.sample(original[i:i + 1].clone(), [req])
                sampled.append((req, out.token_ids[0], out.logprobs[0]))
            except Exception as exc:
                log.exception("sampling failed for %s", req.request_id)
                failed.append((req, f"sampling failed: {type(exc).__name__}: {exc}"))
        return sampled, failed
