"""Load a Llama-family GGUF checkpoint (metadata + dequantized tensors): the header through
``engine.loader.gguf_read`` (a single pass; ``gguf.GGUFReader`` takes seconds on a 49k-token
vocabulary), dequantization through the ``gguf`` package."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from engine.config import ModelConfig
from engine.loader.errors import UnsupportedModelError
from engine.loader.gguf_read import GGUFFile
from engine.quant import Int4Weight, from_gguf, q8_0_from_gguf

# llama.cpp's names; its converter permutes Q/K rows for llama only (qwen2/qwen3/phi3 keep HF's:
# their RoPE is the NEOX / rotate_half kind). phi3 keeps HF's fused matrices: attn_qkv holds
# [q; k; v] rows and ffn_up [gate; up] rows (llama.cpp's SWIGLU takes the first half as the
# gate: src/models/phi3.cpp, build_ffn with LLM_FFN_SWIGLU on ffn_up alone); split on load.
# gemma3 as llama.cpp reads it (src/models/gemma3.cpp): norms stored as 1 + w already (its
# converter's norm_shift), scaled embeddings, norms after attention and MLP, GELU-tanh gating,
# sliding-window layers by attention.sliding_window_pattern (default every 6th global) with
# rope.freq_base_swa (default 10000) and no scaling, the global ones rope.freq_base with the
# file's linear scaling, softmax scale head_dim ** -0.5 (the 62-layer 27B:
# (hidden / heads) ** -0.5).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
SUPPORTED_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})

_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "attn_post_norm": "post_attn_norm", "ffn_post_norm": "post_ffn_norm",
}


def open_gguf(path: Path) -> GGUFFile:
    """Not cached on purpose: a replica should not keep the vocabulary's strings after its
    weights are built."""
    return GGUFFile(path)


def field_value(reader: GGUFFile, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of Q/K rows (interleaved -> half-split RoPE)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
             .transpose(1, 2).reshape(w.shape))


def file_revision(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def read_config(reader: GGUFFile, path: Path) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and not (arch == "gemma3" and scaling == "linear"):
        raise UnsupportedModelError(f"{path.name}: rope scaling {scaling!r} is not supported")
    n_head = int(field_value(reader, f"{arch}.attention.head_count"))
    hidden = int(field_value(reader, f"{arch}.embedding_length"))
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    if any(".rope_factors_" in n for n in names):  # Phi-3's 128k models (longrope)
        raise UnsupportedModelError(f"{path.name}: rope scaling factors (longrope) are not "
                                    "supported")
    context = int(field_value(reader, f"{arch}.context_length", 2048))
    window = field_value(reader, f"{arch}.attention.sliding_window")
    if window and int(window) < context:  # within the window, full attention is exact
        context = int(window)
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    # end-of-turn / end-of-message ids end a sequence as EOS does (llama.cpp's EOG set)
    extra_eos = tuple(dict.fromkeys(
        int(v) for k in ("eot", "eom") if (v := field_value(reader, f"tokenizer.ggml.{k}_token_id"))
        is not None and int(v) != eos))
    n_layers = int(field_value(reader, f"{arch}.block_count"))
    gemma = _gemma3_fields(reader, path, n_layers, hidden, n_head) if arch == "gemma3" else {}
    return ModelConfig(
        architecture=arch,
        vocab_size=int(field_value(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=int(field_value(reader, f"{arch}.feed_forward_length")),
        num_layers=n_layers,
        num_heads=n_head,
        num_kv_heads=int(field_value(reader, f"{arch}.attention.head_count_kv", n_head)),
        head_dim=int(field_value(reader, f"{arch}.attention.key_length") or field_value(
            reader, f"{arch}.rope.dimension_count", hidden // n_head)),
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        name=str(field_value(reader, "general.name", path.stem)),
        revision=file_revision(path),
        extra_eos_token_ids=extra_eos,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        **gemma,
    )


def _gemma3_fields(reader: GGUFFile, path: Path, n_layers: int, hidden: int, n_head: int
                   ) -> dict:
    if field_value(reader, "gemma3.final_logit_softcapping"):
        raise UnsupportedModelError(f"{path.name}: final_logit_softcapping is not supported")
    head_dim = int(field_value(reader, "gemma3.attention.key_length") or hidden // n_head)
    swa = []
    if field_value(reader, "gemma3.attention.sliding_window"):
        pattern = field_value(reader, "gemma3.attention.sliding_window_pattern", 6)
        swa = [bool(x) for x in pattern] if isinstance(pattern, list) else [
            int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n_layers)]
    swa += [False] * (n_layers - len(swa))
    base = float(field_value(reader, "gemma3.rope.freq_base", 1e6))
    base_swa = float(field_value(reader, "gemma3.rope.freq_base_swa", 1e4))
    scale = float(field_value(reader, "gemma3.rope.scaling.factor", 1.0) or 1.0) \
        if field_value(reader, "gemma3.rope.scaling.type") == "linear" else 1.0
    return {"embed_scale": hidden ** 0.5, "post_norms": True, "hidden_act": "gelu_tanh",
            "attn_scale": (hidden / n_head if n_layers == 62 else head_dim) ** -0.5,
            "layer_rope_theta": tuple(base_swa if s else base for s in swa),
            "layer_rope_scale": tuple(1.0 if s else scale for s in swa)}


def _tensor(t) -> torch.Tensor:
    qtype = Q(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"tensor {t.name}: quantization type {qtype.name} is not supported "
            f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
        )
    shape = tuple(int(x) for x in reversed(t.shape))
    if qtype == Q.F32:
        arr = np.array(t.data, dtype=np.float32)
    else:
        arr = dequantize(t.data, qtype)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape).astype(np.float32, copy=False))


def load_gguf(path: str | Path
              ) -> tuple[ModelConfig, dict[str, Callable[[], torch.Tensor]]]:
    """Returns the config and *lazy* weights: each entry dequantizes its tensor when called, so
    the model can convert and fuse tensors one at a time instead of holding every float32 copy
    at once (peak load memory near one copy of the model)."""
    path = Path(path)
    reader = open_gguf(path.resolve())
    config = read_config(reader, path)
    weights: dict[str, Callable[[], torch.Tensor]] = {}
    for t in reader.tensors:
        name = t.name
        if name == "token_embd.weight":
            key = "embed"
        elif name == "output.weight":
            key = "lm_head"
        elif name == "output_norm.weight":
            key = "final_norm"
        elif name.startswith("blk."):
            _, idx, kind, suffix = name.split(".", 3)
            if config.architecture == "phi3" and (kind, suffix) in _PHI3_FUSED:
                whole = _Tensor(t, None)
                parts, start = _PHI3_FUSED[kind, suffix], 0
                for part, rows in zip(parts, _phi3_rows(config, kind), strict=True):
                    weights[f"{idx}.{part}"] = _Rows(whole, start, rows)
                    start += rows
                continue
            if kind not in _LAYER_TENSORS:
                continue  # e.g. rope_freqs: not used by the supported architectures
            key = f"{idx}.{_LAYER_TENSORS[kind]}" + ("_bias" if suffix == "bias" else "")
            if suffix == "bias" and kind not in ("attn_q", "attn_k", "attn_v"):
                raise UnsupportedModelError(f"{path.name}: tensor {name}: biases other than "
                                            "Q/K/V are not supported")
        else:
            continue
        n_head = {"q": config.num_heads, "k": config.num_kv_heads}.get(
            key.rsplit(".", 1)[-1]) if config.architecture == "llama" else None
        weights[key] = _Tensor(t, n_head)
    return config, weights


_PHI3_FUSED = {("attn_qkv", "weight"): ("q", "k", "v"), ("ffn_up", "weight"): ("gate", "up")}


def _phi3_rows(c: ModelConfig, kind: str) -> tuple[int, ...]:
    if kind == "attn_qkv":
        return (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                c.num_kv_heads * c.head_dim)
    return (c.intermediate_size, c.intermediate_size)


class _Tensor:
    """A lazy weight: called, the tensor dequantized to float32; ``int4()``, a 4-bit tensor's
    codes, scales and zeros as stored (``engine.quant``), None for other types; ``int8_rows()``,
    a Q8_0 tensor's codes and scales. Llama's Q/K rows are un-permuted either way. Each form is
    made once (a fused Phi-3 tensor feeds several parts) and only when asked for."""

    def __init__(self, t, unpermute_heads: int | None) -> None:
        self.t = t
        self.heads = unpermute_heads

    @functools.cached_property
    def _float(self) -> torch.Tensor:
        w = _tensor(self.t)
        return w if self.heads is None else unpermute_qk(w, self.heads)

    @functools.cached_property
    def _int4(self) -> Int4Weight | None:
        q = from_gguf(self.t.data, Q(self.t.tensor_type),
                      tuple(int(x) for x in reversed(self.t.shape)))
        if q is None or self.heads is None:
            return q
        return q.map_rows(functools.partial(unpermute_qk, n_head=self.heads))

    def __call__(self) -> torch.Tensor:
        return self._float

    def int4(self) -> Int4Weight | None:
        return self._int4

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A Q8_0 tensor's int8 codes and float16 scales as stored (``engine.quant``); None for
        other types and for Q/K tensors (un-permuted rows: never an embedding)."""
        if self.heads is not None:
            return None
        return q8_0_from_gguf(self.t.data, Q(self.t.tensor_type),
                              tuple(int(x) for x in reversed(self.t.shape)))


class _Rows:
    """Rows [start, start + n) of a fused tensor (read once for all its parts)."""

    def __init__(self, whole: _Tensor, start: int, n: int) -> None:
        self.whole, self.start, self.n = whole, start, n

    def _slice(self, rows: int):
        if self.start + self.n > rows:
            raise UnsupportedModelError(f"a fused tensor has {rows} rows, fewer than the "
                                        f"{self.start + self.n} the model's config implies")
        return slice(self.start, self.start + self.n)

    def __call__(self) -> torch.Tensor:
        w = self.whole()
        return w[self._slice(w.shape[0])]

    def int4(self) -> Int4Weight | None:
        q = self.whole.int4()
        return None if q is None else q.map_rows(lambda a: a[self._slice(a.shape[0])])
