"""Weight matrices prepared once for the fastest CPU matmul available.

For bfloat16 on CPU, oneDNN with the weight reordered ahead of time ("prepacked") uses AMX/AVX512
and is 2-5x faster than ``F.linear``, which reorders the weight on every call. Measured here
(3072x576, 2 threads): 167 vs 412 us at M=1, 1.0 vs 3.5 ms at M=512. For float32 the plain MKL
path of ``F.linear`` is kept: prepacking made batch-1 decode slower. Results are the same values
``F.linear`` gives (checked in tests/kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import native


def can_prepack(weight: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
                ) -> bool:
    """oneDNN can prepack ``weight`` (a CPU tensor in one of ``dtypes``). Its bf16 linear needs
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on a CPU with only AVX2 its reorder raises, so there
    a bf16 weight stays a plain tensor and ``F.linear`` runs (slowly: torch emulates bf16
    there; ``dtype: auto`` picks float32 on such a CPU)."""
    return (weight.dtype in dtypes and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (weight.dtype != torch.bfloat16 or bf16_matmul_supported()))


def bf16_matmul_supported() -> bool:
    """oneDNN runs bfloat16 matmuls on this CPU (torch's own check)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


@torch.library.custom_op("tailscope::prepacked_linear", mutates_args=())
def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """oneDNN's linear on a prepacked weight, as one opaque op for ``torch.compile``: inductor's
    own lowering of ``mkldnn._linear_pointwise`` only takes weights it froze itself, and these
    are prepacked at load. Eager calls skip this wrapper (its dispatch costs ~10 us)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@prepacked_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class Linear:
    """``y = x @ weight.T`` with ``weight`` ``[out, in]``; holds only the prepared form."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.prepacked = can_prepack(weight)
        if self.prepacked:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight.contiguous()

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked:
            if torch.compiler.is_compiling():
                return prepacked_linear(x, self.weight, self.shape[0])
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


# Rows up to which a step runs on packed low-bit weights; past it, on the dense copy. torch's
# weight-only int4 / int8 kernels cost about the same per row as a whole GEMV (they are one,
# per row), while a prepacked bf16 GEMM costs little more for 8 rows than for one once the
# weight is in cache. Measured here (3072x576, 2 threads, weights cold as in a real step):
# int4 89 / 100 / 140 / 284 us at 1 / 2 / 4 / 8 rows, int8 about the same, bf16 ~300 us at
# each; int4 at 64 rows 2 ms.
PACKED_MAX_ROWS = 4
# The same with our own 4-bit kernel (kernels/native.py), which reads each weight once for up
# to 8 rows. The bundled model's 120 layer matrices in sequence, 2 threads (ms, native / aten
# int4 / prepacked bf16): 1 row 3.4 / 5.2 / 13.3, 8 rows 7.0 / 12.1 / 13.4, 16 rows
# 11.8 / 22.2 / 15.8, 24 rows 21.0 / 37.7 / 24.2, 32 rows 28.4 / 50.2 / 28.6. It bounds the
# kernel only where a dense copy is kept (a float32 model); a bfloat16 model keeps none and runs
# every step on the kernel, whose many-rows path (from 32 rows) matches the bf16 GEMM
# (bench/int4_matmul.py).
NATIVE_MAX_ROWS = 16
# The same for our AVX2 kernel on float32 inputs (a float32 model keeps its dense copy for
# larger steps): it widens each code to float32 once for every 4 rows, so its cost grows with
# the rows faster than MKL's float32 GEMM on the dense copy. 1536x576 and 576x1536, 2 threads,
# AVX2 only, weights warm (us, kernel / MKL): 1 row 35 / 71, 8 rows 100 / 175, 16 rows
# 196 / 245, 24 rows 291 / 314, 32 rows 387 / 392.
AVX2_MAX_ROWS = 24


class _PackedLinear:
    """``y = x @ w.T`` with ``w`` packed low-bit (``_packed``) for steps of up to ``max_rows``
    rows (batch-1 and small-batch decode, where reading the weights is the cost) and, where the
    packed kernel is slow past them (prefill, many streams: the matmul is the cost there), a
    dense copy of the same values in the model's dtype for those (``dense``; None where the
    packed kernel takes every step). The packed kernels run on bfloat16 activations: their
    float32 paths are slow reference ones (int4 2.97 ms, int8 1.47 ms against ~90 us at one row
    here), so float32 activations go through them as bfloat16."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, dense: torch.Tensor | None,
                 max_rows: int | None) -> None:
        self.shape = shape
        self.dtype = dtype
        self.max_rows = PACKED_MAX_ROWS if max_rows is None else max_rows
        self.dense = Linear(dense) if dense is not None else None

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def _packed(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``x`` in bfloat16; the result in ``out_dtype`` or bfloat16 (the caller casts)."""
        raise NotImplementedError

    input_dtype = torch.bfloat16  # what ``_packed`` takes (our AVX2 kernel: float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is None or x.shape[0] <= self.max_rows:
            return self._packed(x.to(self.input_dtype), x.dtype).to(x.dtype)
        return self.dense(x)


class Int4Linear(_PackedLinear):
    """``w = (code - 8) * scale + zero`` per group of ``group`` inputs
    (``engine.quant.Int4Weight``). Where our own kernel is available and the shape fits it (N a
    multiple of 16, K of 32, groups of 32; ``self.native`` says so) it runs every step of a
    bfloat16 model: up to 31 rows on the exact values (each weight read once for up to 8 rows,
    scales in float16 or float32, float32 accumulation), from 32 rows on the values rounded to
    bfloat16 (each tile of 16 outputs dequantized once, then multiplied with every row: the
    dense bf16 copy's values at its speed; kernels/csrc/q4_gemm.c), so such a model keeps no
    dense copy (the bundled model's was 212 MB). A float32 model keeps its float32 copy for
    steps past ``NATIVE_MAX_ROWS`` rows (the kernel's bf16 activations would round them).
    Where only our AVX2 kernel is (``native.avx2_available()``: no AVX-512 BF16), a float32
    model runs steps of up to ``AVX2_MAX_ROWS`` rows on it, float32 inputs and exact products
    (``self.avx2``), the dense copy past them.
    Without our kernel: torch's ``_weight_int4pack_mm_for_cpu`` (scales and zeros rounded to
    bfloat16, one GEMV per row) up to ``PACKED_MAX_ROWS`` rows, the dense copy past them."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 dense: torch.Tensor | Callable[[], torch.Tensor], group: int,
                 max_rows: int | None = None, use_native: bool = True,
                 dtype: torch.dtype | None = None, int8_inputs: bool = False) -> None:
        """``codes`` [N, K] (0..15), ``scale`` / ``zero`` [N, K / group]; ``dense`` the same
        values in the model's dtype (``Int4Weight.dequantize``), or a function that makes them,
        called only where the copy is kept (then ``dtype`` names the model's dtype).
        ``max_rows`` defaults to the kernel's own (above); ``use_native=False`` keeps torch's
        kernel. ``int8_inputs`` (``weights: int4a8``): our kernel's steps of up to 31 rows
        quantize their inputs to int8 per group of 32 (``int4_mm_a8``: not exact); no effect
        on torch's kernel."""
        dtype = dense.dtype if isinstance(dense, torch.Tensor) else dtype
        if dtype is None:
            raise ValueError("Int4Linear: dtype is needed where dense is a function")
        packed = native.pack_int4(codes, scale, zero, group) \
            if use_native and native.available() else None
        # without the AVX-512 kernel, a float32 model takes the AVX2 one (float32 inputs)
        self.avx2 = packed is None and use_native and dtype == torch.float32 \
            and native.avx2_available()
        if self.avx2:
            packed = native.pack_int4(codes, scale, zero, group)
            self.avx2 = packed is not None
            if self.avx2:
                self.input_dtype = torch.float32
                max_rows = AVX2_MAX_ROWS if max_rows is None else max_rows
        self.native = packed is not None and not self.avx2
        self.int8_inputs = int8_inputs and self.native
        if self.native and dtype == torch.bfloat16:
            dense = None
        elif not isinstance(dense, torch.Tensor):
            dense = dense()
        super().__init__(tuple(codes.shape), dtype, dense, max_rows if max_rows is not None
                         else NATIVE_MAX_ROWS if self.native else PACKED_MAX_ROWS)
        self.group = group
        if packed is not None:  # [N/16, K/32, 8, 32] bytes; [N/16, K/32, 16] scales and zeros
            self.packed, self.scale, self.zero = packed
        else:  # [N, K / 2] bytes in torch's kernel's layout; [K / group, N, 2] scales and zeros
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32).contiguous(), 1)
            self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(
                torch.bfloat16)

    @property
    def nbytes(self) -> int:
        """What a small step reads: the packed codes and the scales and zeros."""
        extra = (self.scale, self.zero) if self.native or self.avx2 else (self.scales_zeros,)
        return sum(t.numel() * t.element_size() for t in (self.packed, *extra))

    def _packed(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if self.avx2:
            return native.int4_mm_f32(x, self.packed, self.scale, self.zero, self.shape[0])
        if not self.native:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                              self.scales_zeros)
        mm = native.int4_mm_a8 if self.int8_inputs else native.int4_mm
        return mm(x, self.packed, self.scale, self.zero, self.shape[0], out_dtype)


class Int8Linear(_PackedLinear):
    """``w = q * scale`` per output row (``engine.quant.quantize_int8``, the form of torch's
    ``_weight_int8pack_mm``)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dense: torch.Tensor,
                 max_rows: int | None = None) -> None:
        """``q`` int8 [N, K], ``scale`` [N]; ``dense`` the same values in the model's dtype."""
        super().__init__(tuple(q.shape), dense.dtype, dense, max_rows)
        self.q = q.contiguous()
        self.scale = scale.to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def _packed(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)


class Int8Rows:
    """A ``[rows, cols]`` matrix kept as GGUF's Q8_0 stores it, ``w = scale * code`` per block
    of 32 columns (``codes`` int8, ``scale`` float16 ``[rows, cols / 32]``), read a row at a
    time: an embedding (its lookup reads a token's row) and, tied, the exact output matrix of
    ``RescoredOutput`` (its rescoring reads ``top_k`` rows a step row). Half the memory of a
    bfloat16 copy (27 MB of the bundled model's 57), and the same values: a row read is
    ``scale * code`` in float32 (exact) cast to ``dtype``, what a copy in ``dtype`` holds."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        if codes.dtype != torch.int8 or codes.dim() != 2 or codes.shape[1] % 32 \
                or tuple(scale.shape) != (codes.shape[0], codes.shape[1] // 32):
            raise ValueError("Int8Rows: codes [rows, cols] int8 (cols a multiple of 32) and "
                             f"scale [rows, cols / 32]; got {tuple(codes.shape)} "
                             f"{codes.dtype} and {tuple(scale.shape)}")
        self.codes = codes.contiguous()
        self.scale = scale.to(torch.float16).contiguous()
        self.dtype = dtype
        self.shape = tuple(codes.shape)
        # rows_dot through our kernel (bfloat16 only: its rounding is bfloat16's)
        self.native = dtype == torch.bfloat16 and native.available()

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def row_bytes(self) -> int:
        return self.shape[1] + 2 * self.shape[1] // 32

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` (a tensor of row indices, any shape) as ``[*idx.shape, cols]``."""
        codes, scale = self.codes[idx], self.scale[idx]
        values = codes.view(*codes.shape[:-1], -1, 32).float() * scale.float().unsqueeze(-1)
        return values.view(codes.shape).to(self.dtype)

    def dequantize(self, chunk: int = 4096) -> torch.Tensor:
        """The whole matrix in ``dtype`` (a few thousand rows at a time: no float32 copy)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        for i in range(0, self.shape[0], chunk):
            out[i:i + chunk] = self[torch.arange(i, min(i + chunk, self.shape[0]))]
        return out

    def rows_dot(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out[b, j] = row(idx[b, j]) . x[b]`` in float32 (``idx`` [B, k], ``x`` [B, cols]):
        our kernel in bfloat16 (``csrc/q8_rows.c``), else the rows gathered and a bmm."""
        if self.native:
            return native.q8_rows_dot(x.to(torch.bfloat16), self.codes, self.scale, idx)
        return torch.bmm(self[idx], x.to(self.dtype).unsqueeze(-1)).squeeze(-1).float()


class Q8Output:
    """The output matrix as GGUF's Q8_0 blocks (the bundled model's tied embedding as stored),
    multiplied as stored by our kernel (``csrc/q8_gemm.c``: the codes times the inputs exactly,
    float32 sums, each block's scale once): every logit the model's own, at half a bfloat16
    copy's bytes (29 MB a step for the bundled model, against 57), with no rescoring. Where the
    embedding is the same matrix (tied), ``embedding()`` reads its rows from the same codes, so
    the model keeps one copy. A bfloat16 model's inputs on ``csrc/q8_gemm.c`` (only where
    ``native.available()``), a float32 model's on ``csrc/q8_gemm_avx2.c`` (only where
    ``native.avx2_available()``: CPUs without AVX-512 BF16).

    Why not a 4-bit copy with its top logits rescored (``RescoredOutput``, half these bytes):
    its tail cost the bundled model ~1.1 % perplexity on the shipped text, the fidelity gate's
    limit being 1 % (``evals.fidelity``)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        """``codes`` [N, K] int8, ``scale`` [N, K / 32] float16 (``engine.quant.q8_0_from_gguf``);
        ``dtype`` the model's (the embedding's rows are returned in it)."""
        n, k = codes.shape
        if codes.dtype != torch.int8 or k % 32 or tuple(scale.shape) != (n, k // 32):
            raise ValueError("Q8Output: codes [rows, cols] int8 (cols a multiple of 32) and "
                             f"scale [rows, cols / 32]; got {tuple(codes.shape)} "
                             f"{codes.dtype} and {tuple(scale.shape)}")
        self.codes, self.scale = native.pack_q8(codes, scale)
        self.shape = (n, k)
        self.dtype = dtype
        # float32 inputs on the AVX2 kernel, bfloat16 ones on the AVX-512 BF16 one
        self._f32 = dtype == torch.float32

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """What a step reads: the codes and the scales."""
        return self.numel + 2 * self.numel // 32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[M, N]`` float32 for ``x`` ``[M, K]``."""
        if self._f32:
            return native.q8_mm_f32(x.float(), self.codes, self.scale, self.shape[0])
        return native.q8_mm(x.to(torch.bfloat16), self.codes, self.scale, self.shape[0])

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` (any shape) as ``[*idx.shape, K]`` in ``dtype``: ``scale * code`` in
        float32 (exact), then cast, as ``Int8Rows`` reads them."""
        tile, lane = idx // 16, idx % 16
        codes = self.codes[tile, :, :, lane, :]  # [*idx.shape, K / 32, 16 pairs, 2]
        scale = self.scale[tile, :, lane]  # [*idx.shape, K / 32]
        values = codes.flatten(-2).float() * scale.float().unsqueeze(-1)
        return values.flatten(-2).to(self.dtype)

    def embedding(self) -> Q8Embedding:
        return Q8Embedding(self)


class Q8Embedding:
    """A tied embedding read from its ``Q8Output``'s codes (``embed[ids]``)."""

    def __init__(self, matrix: Q8Output) -> None:
        self.matrix = matrix
        self.shape = matrix.shape
        self.dtype = matrix.dtype

    def numel(self) -> int:
        return self.matrix.numel

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.matrix.rows(idx)


class RescoredOutput:
    """The output matrix for ``output_weights: int4 | int8``: a packed low-bit copy scores every
    token in steps of up to ``max_rows`` rows, then each row's ``top_k`` highest logits are
    recomputed from the exact weights (``exact``: ``[vocab, hidden]`` in the model's dtype, the
    tied embedding itself where there is one), so the tokens greedy, top-k, top-p and min-p
    choose among carry the model's own logits and only the tail keeps low-bit rounding.
    Larger steps run ``packed``'s dense copy where it keeps one (the exact values: every logit
    exact); where it keeps none (our 4-bit kernel in a bfloat16 model) they are rescored the
    same way, so a row's top logits are exact whatever the step's size.

    Why: the output matrix is a quarter of a batch-1 bf16 + int4 decode step (56.6 MB a token
    for the bundled model); at 4 bits alone it moves the bundled model's logits by up to ~4
    (spread ~25-30), enough to change greedy tokens in 7 of 8 test prompts within 16 tokens.
    The tail's rounding still reaches sampling where it holds real mass: total variation from
    the exact distribution up to 0.048 at temperature 1 on a flat one (its top 64 held 73%),
    0.013 at 0.7; a larger ``top_k`` narrows it (256: 0.026) and costs more (1,024 cost as much
    as the exact matrix)."""

    def __init__(self, packed: Int4Linear | Int8Linear, exact: torch.Tensor | Int8Rows,
                 top_k: int = 64) -> None:
        """``exact`` a tensor or, where ``packed`` keeps no dense copy (every step rescored),
        the matrix as ``Int8Rows``."""
        if isinstance(exact, Int8Rows) and packed.dense is not None:
            raise ValueError("RescoredOutput: exact Int8Rows needs a packed matrix without a "
                             "dense copy (its large steps multiply that copy)")
        self.packed = packed
        self.exact = exact
        self.top_k = min(top_k, exact.shape[0])
        self.shape = packed.shape
        self.dtype = packed.dtype
        # decided here, not per call: a compiled decode step would break its graph at the
        # cached available() call
        self._native = native.available()

    @property
    def numel(self) -> int:
        return self.packed.numel

    @property
    def nbytes(self) -> int:
        """What a small step reads: the packed matrix and ``top_k`` exact rows a row."""
        row = self.exact.row_bytes if isinstance(self.exact, Int8Rows) \
            else self.shape[1] * self.exact.element_size()
        return self.packed.nbytes + self.top_k * row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, V]: the packed matrix's dtype where a large step multiplies its dense
        copy; float32 where a step is rescored (the same values as the packed dtype's: the
        rescored ones are rounded to it first)."""
        y = self.packed(x)
        if self.packed.dense is not None and x.shape[0] > self.packed.max_rows:
            return y
        fast = self._native and y.dtype == torch.bfloat16
        # [B, k]; our kernel reads the bf16 logits once (torch's topk: ~290 us a step of 8)
        idx = native.topk_indices(y, self.top_k) if fast \
            else y.topk(self.top_k, dim=-1).indices
        if isinstance(self.exact, Int8Rows):
            # rounded to the model's dtype, as a bmm with a copy in that dtype gives them: the
            # engine's outputs stay the copy's (smoke-qa one request at a time: 0 of 51 changed)
            top = self.exact.rows_dot(idx, x).to(self.exact.dtype)
        else:
            top = torch.bmm(self.exact[idx], x.to(self.exact.dtype).unsqueeze(-1)).squeeze(-1)
        # into y's dtype as stored, so a compiled graph cannot drop the rounding (inductor
        # removes a float32 -> bfloat16 -> float32 round trip it sees whole)
        top = top.to(y.dtype)
        if fast:
            return native.rescored_logits(y, idx, top)
        return y.scatter(-1, idx, top).float()
