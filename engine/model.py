"""Llama-family decoder in plain PyTorch (Llama, SmolLM, Mistral, Qwen2, Qwen3 checkpoints).

Qwen2 adds biases to the Q/K/V projections (``ModelConfig.qkv_bias``), Qwen3 a per-head RMSNorm
of Q and K before RoPE (``ModelConfig.qk_norm``); otherwise the layers are Llama's.

Weights use the HF layout (``rotate_half`` RoPE); the GGUF loader un-permutes llama.cpp's Q/K
rows on load so both loaders feed the same module. Q/K/V and gate/up projections are fused
into one matrix each so a decoder layer is a handful of large matmuls.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import kernels
from engine.config import OUTPUT_FORMATS, WEIGHT_FORMATS, ModelConfig
from engine.quant import GROUP, Int4Weight, quantize_int4, quantize_int8, quantize_q8_0
from kernels import invariant, native, reference
from kernels.invariant import InvariantLinear
from kernels.linear import Int4Linear, Int8Linear, Int8Rows, Linear, Q8Output, RescoredOutput

WeightSource = torch.Tensor | Callable[[], torch.Tensor]


def _materialise(w: WeightSource) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w()


def _keep_guards(entries: Sequence) -> list[bool]:
    """``compile_decode``'s guard filter: drop the guards on the model (``self``, ``self.…``)
    and on every KV tensor past the first (``kv_caches[0][0]``)."""
    def drop(name: str) -> bool:
        return (name == "self" or name.startswith("self.")
                or (name.startswith("kv_caches[") and not name.startswith("kv_caches[0][0]")))
    return [not drop(e.name) for e in entries]


@dataclass
class PrefillSeq:
    start: int  # token range [start, end) in the flattened batch
    end: int
    context_len: int  # keys visible to the last query of the chunk (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass
class AttentionMetadata:
    """How the flattened tokens of one step map onto sequences and KV slots.

    Decode tokens come first (one per sequence, ``num_decodes`` of them), then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] flat KV slot of every token
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, M]
    decode_context_lens: torch.Tensor | None = None  # [B]
    prefills: list[PrefillSeq] = field(default_factory=list)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear | InvariantLinear | Int4Linear | Int8Linear  # [(H + 2*Hk) * D, hidden]
    o: Linear | InvariantLinear | Int4Linear | Int8Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | InvariantLinear | Int4Linear | Int8Linear  # [2 * ffn, hidden]
    down: Linear | InvariantLinear | Int4Linear | Int8Linear
    qkv_bias: torch.Tensor | None = None  # [(H + 2*Hk) * D] (Qwen2)
    q_norm: torch.Tensor | None = None  # [D] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # on the attention output (Gemma 3)
    post_ffn_norm: torch.Tensor | None = None  # on the MLP output (Gemma 3)


def _int4(src: WeightSource) -> Int4Weight:
    exact = src.int4() if hasattr(src, "int4") else None  # a GGUF Q4 tensor's codes
    return exact if exact is not None else quantize_int4(_materialise(src))


class LlamaModel:
    """Inference-only decoder. ``forward`` reads and writes K/V through block tables;
    ``dense_forward`` is the no-cache full-recompute reference used by tests.

    ``batch_invariant``: every kernel gives a token's row bitwise what it gives that row in any
    other batch, chunking or cache state (``kernels.invariant``); slower, CPU kernels only.

    ``weight_format`` ``int4`` / ``int8``: the decoder layers' projections hold 4-bit weights
    (``engine.quant``; a GGUF's Q4 tensors as stored, anything else quantized) or 8-bit ones
    (a scale per output row) and run ``kernels.linear.Int4Linear`` / ``Int8Linear``; norms and
    the embedding stay in ``dtype`` (a GGUF's Q8_0 embedding as stored, ``Int8Rows``, where no
    copy in ``dtype`` is needed: an untied one, or one tied to a packed output matrix without a
    dense copy; its rows read are the same values). ``output_format`` does the same for the
    output matrix (``lm_head``; with tied embeddings the embedding's values), quantized from its
    values in ``dtype``, with each small step's top logits rescored from them
    (``RescoredOutput``; every step's where the packed matrix keeps no dense copy); the
    embedding lookup uses those values as they are. ``output_format`` ``q8_0`` holds the output
    matrix as GGUF's Q8_0 blocks (as stored where it is, the bundled model's tied embedding;
    else quantized from its values) and multiplies them as such on our kernels (``Q8Output``:
    bfloat16 on AVX-512 BF16, float32 on AVX2), a tied embedding reading its rows from the same
    codes."""

    def __init__(self, config: ModelConfig, weights: dict[str, WeightSource],
                 dtype: torch.dtype = torch.float32, batch_invariant: bool = False,
                 weight_format: str = "native", output_format: str = "native") -> None:
        """Consumes ``weights`` (entries are popped as they are converted and fused; callables
        are materialised only then), so peak load memory stays near one copy of the model."""
        self.config = config
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.weight_format = weight_format
        self.output_format = output_format
        for what, fmt, formats in (("weight_format", weight_format, WEIGHT_FORMATS),
                                   ("output_format", output_format, OUTPUT_FORMATS)):
            if fmt not in formats:
                raise ValueError(f"{what} must be one of {formats}, got {fmt!r}")
            if fmt != "native" and batch_invariant:
                raise ValueError(f"{what} {fmt} cannot run batch_invariant")
        c = config
        # Gemma 3's extra norms, GELU and per-layer RoPE run on the plain torch path (the fused
        # Triton norm / activation / rotary kernels and the batch-invariant ones are Llama's)
        self.torch_only = (c.post_norms or c.hidden_act != "silu"
                           or len(set(c.layer_rope_theta)) > 1 or len(set(c.layer_rope_scale)) > 1)
        if batch_invariant and self.torch_only:
            raise ValueError("batch_invariant supports Llama-style layers only, not this "
                             "model's (post-norms, GELU or per-layer RoPE)")
        if batch_invariant and kernels.kernel_backend() == "triton":
            raise ValueError("batch_invariant runs on the CPU kernels (kernels.invariant); "
                             "unset TAILSCOPE_KERNELS=triton or turn the mode off")

        def take(*names: str) -> torch.Tensor:
            parts = [_materialise(weights.pop(n)).to(dtype) for n in names]
            return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)

        def proj(*names: str) -> Linear | InvariantLinear | Int4Linear | Int8Linear:
            if weight_format == "native":
                return self._linear(take(*names))
            return self._packed(weight_format, [weights.pop(n) for n in names])

        self.lm_head, self.embed = self._head_and_embedding(weights)
        self.final_norm = take("final_norm")
        self.layers = [
            LayerWeights(
                attn_norm=take(f"{i}.attn_norm"),
                qkv=proj(f"{i}.q", f"{i}.k", f"{i}.v"),
                o=proj(f"{i}.o"),
                ffn_norm=take(f"{i}.ffn_norm"),
                gate_up=proj(f"{i}.gate", f"{i}.up"),
                down=proj(f"{i}.down"),
                qkv_bias=take(f"{i}.q_bias", f"{i}.k_bias", f"{i}.v_bias") if c.qkv_bias
                else None,
                q_norm=take(f"{i}.q_norm") if c.qk_norm else None,
                k_norm=take(f"{i}.k_norm") if c.qk_norm else None,
                post_attn_norm=take(f"{i}.post_attn_norm") if c.post_norms else None,
                post_ffn_norm=take(f"{i}.post_ffn_norm") if c.post_norms else None,
            )
            for i in range(c.num_layers)
        ]
        self.scale = c.attn_scale if c.attn_scale is not None else c.head_dim ** -0.5
        # one RoPE table per (base, linear scale) the layers use; each layer keeps its key
        self.layer_rope = list(zip(c.layer_rope_theta or [c.rope_theta] * c.num_layers,
                                   c.layer_rope_scale or [1.0] * c.num_layers, strict=True))
        self.rope = {key: self._rope(*key) for key in dict.fromkeys(self.layer_rope)}
        self.cos, self.sin_signed, self.cos_half, self.sin_half = self.rope[self.layer_rope[0]]
        self._compiled_decode = None  # compile_decode
        self._aot = None  # use_aot_decode: the decode step compiled ahead of time (engine.aot)
        # the compiled batch-1 step's attention: straight from the paged cache (False: gather
        # and SDPA, as batches of more; bench/packed_weights.py's +gather compares the two)
        self.direct_decode_attention = True
        # decode attention through our own kernel, straight from the paged cache
        # (kernels/csrc/paged_attention.c: 4-6x torch's gather and SDPA at 8-32 sequences)
        # where it is built and fits this model (bfloat16); False: torch's gather and SDPA
        self.native_decode_attention = not batch_invariant and native.attention_fits(
            c.num_heads, c.num_kv_heads, c.head_dim, dtype) and native.available()

    def _linear(self, w: torch.Tensor) -> Linear | InvariantLinear:
        if self.batch_invariant:
            return InvariantLinear(w, invariant.invariant_chunk(tuple(w.shape), w.dtype))
        return Linear(w)

    def _packed(self, fmt: str, sources: list[WeightSource], dense: torch.Tensor | None = None
                ) -> Int4Linear | Int8Linear:
        """A packed matrix in ``fmt``; ``dense``: what steps past the packed kernel's rows
        multiply by (default: the packed values in ``dtype``)."""
        dtype = self.dtype
        if fmt == "int8":  # from the float32 values, each row its own scale
            q8, s8 = quantize_int8(torch.cat([_materialise(w).float() for w in sources]))
            return Int8Linear(q8, s8, (q8.float() * s8[:, None]).to(dtype)
                              if dense is None else dense)
        q = Int4Weight.cat([_int4(w) for w in sources])
        return Int4Linear(q.codes, q.scale, q.zero, (lambda: q.dequantize().to(dtype))
                          if dense is None else dense, GROUP, dtype=dtype,
                          int8_inputs=fmt == "int4a8")

    def _head_and_embedding(self, weights: dict):
        """(the output matrix, the embedding) in ``output_format``, a tied pair sharing one
        matrix."""
        # a GGUF's Q8_0 embedding (the bundled model's) is kept as stored where nothing needs
        # all of it in ``dtype`` at once: untied (the lookup reads a row a token), or tied to an
        # output matrix packed without a dense copy (every step's top logits rescored from it),
        # or multiplied as stored (``Q8Output``)
        src = weights.pop("embed")
        q8 = src.int8_rows() if hasattr(src, "int8_rows") else None
        rows = Int8Rows(*q8, self.dtype) if q8 is not None else None
        embed: torch.Tensor | Int8Rows = rows if rows is not None else \
            _materialise(src).to(self.dtype).contiguous()
        tied = self.config.tie_word_embeddings
        out_src = None if tied else weights.pop("lm_head")
        if self.output_format == "q8_0":
            q8_out = q8 if tied else (out_src.int8_rows() if hasattr(out_src, "int8_rows")
                                      else None)
            if q8_out is None:  # quantized from the values, as GGUF's Q8_0 rule does
                q8_out = quantize_q8_0(_materialise(src if tied else out_src).float())
            # tied: the embedding reads the same values (one matrix for both)
            if (self.dtype == torch.bfloat16 and native.available()) or (
                    self.dtype == torch.float32 and native.avx2_available()):
                lm_head = Q8Output(*q8_out, self.dtype)
                embedding = lm_head.embedding() if tied else embed
            else:  # no kernel for it here: a copy of the same values in ``dtype``
                exact = Int8Rows(*q8_out, self.dtype).dequantize()
                lm_head = self._linear(exact)
                embedding = exact if tied else embed
        else:
            if not tied:
                exact = _materialise(out_src).to(self.dtype).contiguous()
            else:  # the output matrix is built from the values in ``dtype``
                exact = rows.dequantize() if rows is not None else embed
            if self.output_format == "native":
                lm_head = self._linear(exact)
            else:  # low-bit for small steps, the top logits rescored from ``exact``
                head = self._packed(self.output_format, [exact], dense=exact)
                if tied and rows is not None and head.dense is None:
                    exact = rows  # rescored from the rows: no copy in ``dtype`` kept
                lm_head = RescoredOutput(head, exact)
            embedding = exact if tied else embed  # tied: one matrix for both
        return lm_head, embedding

    def _rope(self, theta: float, scale: float) -> tuple[torch.Tensor, ...]:
        """cos and sign-folded sin ``[max_pos, D]``, and the ``[max_pos, D/2]`` cos and sin
        tables of kernels.rotary (the Triton path), for base ``theta``; ``scale`` divides the
        positions (linear RoPE scaling)."""
        c, dtype = self.config, self.dtype
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        ) / scale
        t = torch.arange(c.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        half = c.head_dim // 2
        return (emb.cos().to(dtype),
                torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], -1).to(dtype),
                freqs.cos().to(dtype).contiguous(), freqs.sin().to(dtype).contiguous())

    @property
    def num_parameters(self) -> int:
        n = self.embed.numel() + self.final_norm.numel()
        if not self.config.tie_word_embeddings:
            n += self.lm_head.numel
        for lw in self.layers:
            n += lw.attn_norm.numel() + lw.ffn_norm.numel()
            n += lw.qkv.numel + lw.o.numel + lw.gate_up.numel + lw.down.numel
            n += sum(t.numel() for t in (lw.qkv_bias, lw.q_norm, lw.k_norm, lw.post_attn_norm,
                                         lw.post_ffn_norm) if t is not None)
        return n

    @property
    def weight_bytes(self) -> int:
        """Bytes one batch-1 decode step must read: every weight once (the tied output matrix
        once; an untied embedding not at all, its lookup reads one row), the packed low-bit ones
        as their codes and scales (what a small step, on the packed kernel, reads)."""
        packed = [m for lw in self.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)
                  if isinstance(m, Int4Linear | Int8Linear)]
        if isinstance(self.lm_head, RescoredOutput | Q8Output):
            packed.append(self.lm_head)
        rest = self.num_parameters - sum(m.numel for m in packed)
        if not self.config.tie_word_embeddings:  # the lookup reads a row a token, not all
            rest -= self.embed.numel()
        return rest * self.dtype.itemsize + sum(m.nbytes for m in packed)

    def _rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, cos and sign-folded sin for this step's positions (gathered once per
        table, shared by the layers that use it): ``rope(x) = x * cos + roll(x, half) *
        sin_signed`` equals HF's rotate_half form."""
        gathered = {key: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                    for key, (cos, sin, _, _) in self.rope.items()}
        return [gathered[key] for key in self.layer_rope]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[input_ids]
        if self.config.embed_scale != 1.0:  # Gemma: in the weights' dtype, as HF multiplies
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        return h

    def _qkv(self, lw: LayerWeights, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
             positions: torch.Tensor, triton: bool):
        """``triton``: the forward's one ``kernels.use_triton`` decision for every layer."""
        c = self.config
        if triton:
            x = kernels.rms_norm(h, lw.attn_norm, c.rms_norm_eps)
        else:
            x = F.rms_norm(h, (c.hidden_size,), lw.attn_norm, c.rms_norm_eps)
        qkv = lw.qkv(x)
        if lw.qkv_bias is not None:
            qkv = qkv + lw.qkv_bias
        nqk = (c.num_heads + c.num_kv_heads) * c.head_dim
        qk = qkv[:, :nqk].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
        if lw.q_norm is not None:  # per head, before RoPE
            d = (c.head_dim,)
            qk = torch.cat([F.rms_norm(qk[:, :c.num_heads], d, lw.q_norm, c.rms_norm_eps),
                            F.rms_norm(qk[:, c.num_heads:], d, lw.k_norm, c.rms_norm_eps)], 1)
        if triton:  # in place, Q and K heads in one launch
            qk = qk.contiguous()
            kernels.rotary(qk, positions, self.cos_half, self.sin_half)
        else:
            cos, sin = rope
            qk = qk * cos + qk.roll(c.head_dim // 2, dims=-1) * sin  # Q and K in one pass
        v = qkv[:, nqk:].view(-1, c.num_kv_heads, c.head_dim)
        return qk[:, :c.num_heads], qk[:, c.num_heads:], v

    def _mlp_residual(self, lw: LayerWeights, h: torch.Tensor, attn: torch.Tensor,
                      triton: bool) -> torch.Tensor:
        c = self.config
        if self.torch_only:
            return self._mlp_residual_post_norms(lw, h, attn)
        if triton:
            x, h = kernels.add_rms_norm(lw.o(attn.reshape(attn.shape[0], -1)), h, lw.ffn_norm,
                                        c.rms_norm_eps)
            gate, up = lw.gate_up(x).chunk(2, dim=-1)
            return h + lw.down(kernels.silu_and_mul(gate, up))
        h = h + lw.o(attn.reshape(attn.shape[0], -1))
        x = F.rms_norm(h, (c.hidden_size,), lw.ffn_norm, c.rms_norm_eps)
        gate, up = lw.gate_up(x).chunk(2, dim=-1)
        if self.batch_invariant:
            return h + lw.down(invariant.silu_and_mul(gate, up))
        return h + lw.down(F.silu(gate) * up)

    def _mlp_residual_post_norms(self, lw: LayerWeights, h: torch.Tensor, attn: torch.Tensor
                                 ) -> torch.Tensor:
        """Gemma 3's layer: each sub-layer's output normed before it joins the residual,
        GELU (tanh) or SiLU gating."""
        c, d = self.config, (self.config.hidden_size,)
        o = lw.o(attn.reshape(attn.shape[0], -1))
        if lw.post_attn_norm is not None:
            o = F.rms_norm(o, d, lw.post_attn_norm, c.rms_norm_eps)
        h = h + o
        gate, up = lw.gate_up(F.rms_norm(h, d, lw.ffn_norm, c.rms_norm_eps)).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if c.hidden_act == "gelu_tanh" else F.silu(gate)
        y = lw.down(act * up)
        if lw.post_ffn_norm is not None:
            y = F.rms_norm(y, d, lw.post_ffn_norm, c.rms_norm_eps)
        return h + y

    def _logits(self, h: torch.Tensor, triton: bool) -> torch.Tensor:
        c = self.config
        if triton:
            return self.lm_head(kernels.rms_norm(h, self.final_norm, c.rms_norm_eps)).float()
        return self.lm_head(F.rms_norm(h, (c.hidden_size,), self.final_norm, c.rms_norm_eps)
                            ).float()

    def compile_decode(self) -> None:
        """Run decode-only steps through ``torch.compile`` (inductor): ``_decode_step`` becomes
        fused C++ loops around the matmul and attention calls, so a step stops paying Python
        and dispatch for each of its ~40 small ops per layer (norms, RoPE, residual adds,
        activations). The batch size and the block-table width are symbolic (``_decode``
        marks them), so a few graphs serve every step: a batch of one (torch specialises size
        1), batches of two and more, and with packed weights that keep a dense copy, batches
        past their ``max_rows`` (the row-count dispatch is a guard). ``ModelRunner`` compiles
        them at start."""
        if self.batch_invariant:
            raise ValueError("compile cannot run batch_invariant (its kernels are not traced)")
        # Dynamo checks every graph's guards before each call: one per weight tensor, per KV
        # tensor, per config constant and attribute it read, ~2,000 here (0.9 ms of a 12 ms
        # batch-1 step). This model's weights, config and structure never change once loaded
        # and the runner passes the same KV tensors every step, so those guards can only ever
        # pass: the step is compiled as this model's own function (its own code object, so its
        # own graph cache, which no other model's calls can reach) and ``_keep_guards`` drops
        # them, keeping the inputs' (the batch size picks the graph), the first KV tensor's
        # (another runner's pool) and the global ones. 0.23 ms a call is left. Anything that
        # someday swaps a loaded model's weights or layers in place (a LoRA, a reload) must
        # call compile_decode again: these graphs would not notice.
        f = type(self)._decode_step
        own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__,
                                 f.__defaults__, f.__closure__)
        # size_asserts off: inductor's Python wrapper checks the size and strides of every input
        # and every custom operator's output at each call (~600 checks a step here, 0.3-0.5 ms
        # of a 14 ms 8-row step under torch.profiler); the inputs' sizes are what the graph
        # was compiled for (the guards above), and our operators' outputs are the new,
        # contiguous tensors their fake functions declare (kernels/native.py)
        self._compiled_decode = torch.compile(types.MethodType(own, self),
                                              options={"guard_filter_fn": _keep_guards,
                                                       "size_asserts": False})

    def use_aot_decode(self, aot) -> None:
        """Run decode-only steps through ``aot`` (``engine.aot.AotDecode``: the same step as
        ``compile_decode``'s, compiled ahead of time and loaded without dynamo)."""
        self._aot = aot

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The compiled decode step on this step's inputs, their sizes marked dynamic (block
        tables at least two wide, padded with block 0 past the context: a width of 1 would be
        specialised, and compiled mid-serving)."""
        tables = meta.decode_block_tables
        if tables.shape[1] < 2:
            tables = F.pad(tables, (0, 1))
        inputs = (input_ids, positions, meta.slot_mapping, tables, meta.decode_context_lens)
        if self._aot is not None:
            return self._aot(*inputs, kv_caches)
        if meta.num_decodes > 1:
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        return self._compiled_decode(*inputs, kv_caches)

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``forward`` for a step where every sequence decodes one token, written to be traced
        whole: the torch kernels only (no backend dispatch) and attention masked by context
        length (no data-dependent Python). Logits of every row.

        A batch of one (its own graph) attends through ``paged_decode_attention_direct``, which
        inductor fuses into the step with no gathered copy of K/V (``direct_decode_attention``;
        ``bench/packed_weights.py --engines int4+compile,int4+compile+gather`` compares):
        bf16 + int4 decode 9.5 against 10.1 ms/token after a 64-token prompt and 15.9 against
        23.7 after a 1,000-token one, faster in 5 of 5 interleaved rounds each.
        Batches of two and more keep the gather and SDPA: the direct loops were slower at 8
        sequences (39.1 against 35.0 ms a step, 0 of 4 rounds). Where our own attention kernel
        runs (``native_decode_attention``) every batch size goes through it instead."""
        # fixed per graph: size 1 is specialised
        direct = self.direct_decode_attention and input_ids.shape[0] == 1
        h = self._embed(input_ids)
        for lw, rope, (k_cache, v_cache) in zip(self.layers, self._rope_tables(positions),
                                                kv_caches, strict=True):
            q, k, v = self._qkv(lw, h, rope, positions, False)
            reference.write_kv(k, v, k_cache, v_cache, slot_mapping)
            if self.native_decode_attention:
                attn = native.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                     context_lens, self.scale)
            elif direct:
                attn = reference.paged_decode_attention_direct(
                    q, k_cache, v_cache, block_tables, context_lens, self.scale)
            else:
                attn = reference.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                        context_lens, self.scale, masked=True)
            h = self._mlp_residual(lw, h, attn, False)
        return self._logits(h, False)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step over the flattened tokens; returns float32 logits only at
        ``logits_indices`` (the positions that sample a token this step)."""
        attention = kernels.implementation(self.final_norm)  # write_kv and paged attention
        nd = meta.num_decodes
        # our own kernel walks each sequence's own blocks (as the Triton kernel does), with no
        # padding to cut; on torch's, decodes attend in groups of similar length (shared by
        # every layer)
        own = self.native_decode_attention and attention is reference
        groups = reference.decode_groups(meta.decode_block_tables, meta.decode_context_lens,
                                         kv_caches[0][0].shape[1]) \
            if nd and attention is reference and not self.batch_invariant and not own else None
        # a compiled step on torch's attention masks one batch padded to its widest: decodes of
        # very different lengths run eagerly instead, in their groups
        compiled = self._compiled_decode is not None or (
            self._aot is not None and nd
            and self._aot.covers(nd, meta.decode_block_tables.shape[1]))
        if compiled and not meta.prefills and attention is reference \
                and (own or (groups is not None and len(groups) == 1)):
            logits = self._decode(input_ids, positions, meta, kv_caches)
            # every row samples, in order (as ModelRunner asks): no copy of the logits (~0.1-0.25
            # ms at 8 rows of the bundled model's vocabulary)
            if logits_indices.shape[0] == logits.shape[0] and torch.equal(
                    logits_indices, torch.arange(logits.shape[0])):
                return logits
            return logits[logits_indices]
        triton = attention is not reference and not self.torch_only  # norms, RoPE, activation
        h = self._embed(input_ids)
        ropes = self._rope_tables(positions)
        if self.batch_invariant:
            return self._forward_invariant(h, positions, ropes[0], meta, kv_caches,
                                           logits_indices)
        for lw, rope, (k_cache, v_cache) in zip(self.layers, ropes, kv_caches, strict=True):
            q, k, v = self._qkv(lw, h, rope, positions, triton)
            attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = torch.empty_like(q)
            if nd and own:
                attn[:nd] = native.paged_decode_attention(
                    q[:nd], k_cache, v_cache, meta.decode_block_tables,
                    meta.decode_context_lens, self.scale)
            elif groups:
                attn[:nd] = reference.grouped_decode_attention(q[:nd], k_cache, v_cache,
                                                               groups, self.scale)
            elif nd:
                attn[:nd] = attention.paged_decode_attention(
                    q[:nd], k_cache, v_cache, meta.decode_block_tables,
                    meta.decode_context_lens, self.scale,
                )
            for p in meta.prefills:
                n = p.end - p.start
                if p.context_len == n and not triton:  # nothing cached before: dense causal
                    attn[p.start:p.end] = reference.causal_attention(
                        q[p.start:p.end], k[p.start:p.end], v[p.start:p.end], self.scale
                    )
                else:
                    attn[p.start:p.end] = attention.paged_prefill_attention(
                        q[p.start:p.end], k_cache, v_cache, p.block_table, p.context_len,
                        self.scale,
                    )
            h = self._mlp_residual(lw, h, attn, triton)
        return self._logits(h[logits_indices], triton)

    def _forward_invariant(self, h, positions, rope, meta: AttentionMetadata, kv_caches,
                           logits_indices):
        """``forward`` on the batch-invariant kernels: decodes and every prefill chunk (cached
        prefix or not) attend through the same fixed-order attention."""
        nd = meta.num_decodes
        group = self.config.num_heads // self.config.num_kv_heads
        # what every layer's attention shares this step: block tables, masks, query tiles
        block_size = kv_caches[0][0].shape[1]
        decodes = invariant.DecodePlan(meta.decode_block_tables, meta.decode_context_lens,
                                       block_size) if nd else None
        rows = invariant.row_multiple(kv_caches[0][0].shape[-1])
        prefills = [(p, invariant.PrefillPlan(p.block_table, p.context_len, p.end - p.start,
                                              group, block_size, rows)) for p in meta.prefills]
        for lw, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            q, k, v = self._qkv(lw, h, rope, positions, False)
            kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = torch.empty_like(q)
            if decodes is not None:
                attn[:nd] = invariant.decode_attention(q[:nd], k_cache, v_cache, decodes,
                                                       self.scale)
            for p, plan in prefills:
                attn[p.start:p.end] = invariant.prefill_attention(
                    q[p.start:p.end], k_cache, v_cache, plan, self.scale)
            h = self._mlp_residual(lw, h, attn, False)
        return self._logits(h[logits_indices], False)

    @torch.inference_mode()
    def dense_forward(self, input_ids: torch.Tensor, logit_rows: int | None = None
                      ) -> torch.Tensor:
        """No cache, full recompute: logits ``[n, vocab]`` for every position of one sequence.
        ``logit_rows``: the logits computed that many positions at a time, as decode steps of
        that many sequences compute theirs (a packed output matrix's small-step path)."""
        positions = torch.arange(input_ids.shape[0])
        ropes = self._rope_tables(positions)
        h = self._embed(input_ids)
        triton = kernels.use_triton(h) and not self.torch_only
        for lw, rope in zip(self.layers, ropes, strict=True):
            q, k, v = self._qkv(lw, h, rope, positions, triton)
            h = self._mlp_residual(lw, h, kernels.causal_attention(q, k, v, self.scale),
                                   triton)
        if logit_rows is not None:
            return torch.cat([self._logits(part, triton) for part in h.split(logit_rows)])
        return self._logits(h, triton)
