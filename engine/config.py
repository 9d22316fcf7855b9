"""Frozen, validated configuration dataclasses for the model and the engine (torch-free: the
gateway and the CLI read them too)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture values, always read from the checkpoint (never hard-coded)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # more ids that end a sequence as EOS does (HF configs list several: Gemma 3's
    # <end_of_turn>, Qwen2.5's <|im_end|> besides <|endoftext|>)
    extra_eos_token_ids: tuple[int, ...] = ()
    name: str = "unknown"
    revision: str = "unknown"
    qkv_bias: bool = False  # Q/K/V projections have biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of Q and K before RoPE (Qwen3, Gemma 3)
    # Gemma 3: the embedding output times sqrt(hidden) (the output matrix, tied, is not scaled),
    # a norm after attention and after the MLP besides the two before them, GELU (tanh) gating,
    # softmax scale query_pre_attn_scalar**-0.5, and RoPE bases per layer (local / global)
    embed_scale: float = 1.0
    post_norms: bool = False
    hidden_act: str = "silu"  # silu | gelu_tanh
    attn_scale: float | None = None  # None: head_dim ** -0.5
    layer_rope_theta: tuple[float, ...] = ()  # per layer; empty: rope_theta everywhere
    layer_rope_scale: tuple[float, ...] = ()  # per layer linear position scaling; empty: 1

    def __post_init__(self) -> None:
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r}: silu or gelu_tanh")
        for name in ("layer_rope_theta", "layer_rope_scale"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"{name} needs one value per layer ({self.num_layers})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence: ``eos_token_id`` and the extra ones."""
        return (() if self.eos_token_id is None else (self.eos_token_id,)) + \
            tuple(self.extra_eos_token_ids)

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


# Bytes per element of each dtype an engine runs in (torch names; the torch dtypes themselves
# live in engine.dtypes, so this module, and every process that reads a config, stays
# torch-free).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
PREEMPTION_MODES = ("recompute", "swap", "auto", "off")
SCHEDULING_POLICIES = ("fcfs", "priority", "sjf", "fair")  # engine.policy.POLICIES (torch-free)
BUDGET_SPLITS = ("decode_first", "prefill_first", "decode_reserve")
WEIGHT_FORMATS = ("native", "int4", "int4a8", "int8")
# the output matrix's: the same, or as GGUF's Q8_0 blocks on our kernel (kernels.linear.Q8Output)
OUTPUT_FORMATS = (*WEIGHT_FORMATS, "q8_0")
COMPILE_MODES = ("jit", "aot")
PROFILES = ("fast", "exact")  # engine.profiles


def setting(default, help: str):
    """A settings field: its default and the help the flags, environment and docs show."""
    return field(default=default, metadata={"help": help})


BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo: a native bf16 multiply
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})  # what our AVX2 kernel needs (kernels.native)


def native_kernels_switch() -> str:
    """``TAILSCOPE_NATIVE_KERNELS``: ``on`` (default: every library of our kernels this CPU
    runs), ``off``, or ``avx2`` (the AVX2 library alone: how its path is run and tested on an
    AVX-512 machine). Here, without torch: the profile reads it too."""
    from tailscope import env

    return env.native_kernels()


def c_compilers() -> tuple[str, str] | None:
    """The C and C++ compilers our kernels are built with (``$CC``/``cc``/``gcc``,
    ``$CXX``/``c++``/``g++``), None where either is missing."""
    import os
    import shutil

    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    cxx = shutil.which(os.environ.get("CXX") or "c++") or shutil.which("g++")
    return (cc, cxx) if cc is not None and cxx is not None else None


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags (/proc/cpuinfo), None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def auto_dtype(flags: set[str] | None = None) -> tuple[str, str]:
    """What ``dtype: auto`` becomes here, and why: ``bfloat16`` where the CPU multiplies bf16
    natively (the ``avx512_bf16`` or ``amx_bf16`` flag of /proc/cpuinfo: oneDNN then runs
    torch's bf16 matmuls on them, 3-4x the fp32 speed on the bundled model), else ``float32``
    (a CPU without them emulates bf16, slower than fp32). This engine runs on the CPU; on
    systems without /proc/cpuinfo the flags are unknown and it is float32."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return "float32", "no /proc/cpuinfo: CPU features unknown"
    native = sorted(flags & BF16_FLAGS)
    if native:
        return "bfloat16", f"the CPU multiplies bf16 natively ({', '.join(native)})"
    return "float32", "no native bf16 matmul on this CPU (neither avx512_bf16 nor amx_bf16)"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every engine setting, declared once: its type, default and meaning.

    The environment (``TAILSCOPE_<NAME>``), the command-line flags (``--<name>``), the YAML
    engine config (``engine:``) and the replica process (one encoded payload) are all derived
    from these fields (``setting_types``); ``config_id`` hashes them. A new setting is a new
    field here (plus its use), nothing else.
    """

    profile: str = setting("exact", "which settings fill in those not given (dtype, "
                                     "weights, output_weights, compile, compile_mode): fast, "
                                     "the CPU's fastest faithful path (bfloat16, packed 4-bit "
                                     "weights and the step compiled ahead of time where the "
                                     "CPU multiplies bf16 natively), or exact (float32, "
                                     "native weights: bitwise against a recompute); tailscope "
                                     "serve and generate default to fast: engine.profiles")
    dtype: str | None = setting(None, "weight and KV-cache dtype: " + ", ".join(DTYPE_BYTES)
                                 + ", or auto (bfloat16 where the CPU multiplies bf16 "
                                 "natively, else float32: engine.config.auto_dtype), "
                                 "resolved when the config is made (unset: the profile's)")
    weights: str | None = setting(None, "how the linear layers' weights are held (unset: "
                            "the profile's): native (in "
                            "dtype), int4 (4-bit codes with a scale and zero per 32 inputs: "
                            "GGUF Q4_0 / Q4_1 / Q4_K tensors kept as stored, others quantized), "
                            "int4a8 (int4 whose small decode steps quantize their inputs to "
                            "int8 per 32, GGUF's Q8_0 form, as llama.cpp multiplies its 4-bit "
                            "weights: twice the products an instruction on our kernel, AVX-512 "
                            "VNNI; not exact, ~1% relative error of each sum beyond the 4-bit "
                            "weights'; without our kernels it runs as int4), "
                            "or int8 (a scale per output row, quantized from float); decode "
                            "steps of up to 16 rows (int4 on our own kernel, kernels.native) or "
                            "4 (int8, or int4 on torch's kernel) run packed, larger steps a "
                            "dense copy of the same values: engine.quant")
    output_weights: str | None = setting(None, "how the output matrix (lm_head, or the tied "
                                   "embedding's values) is held: q8_0 (GGUF's Q8_0 blocks, as "
                                   "stored where the file holds them, else quantized per 32 "
                                   "inputs; in bfloat16 multiplied as such by our kernel, "
                                   "every logit from those values, a tied embedding read from "
                                   "them: kernels.linear.Q8Output), native (the values in "
                                   "dtype), or for small decode steps (as many rows as for "
                                   "weights) int4, int4a8 or int8 as for weights, each row's "
                                   "64 highest logits then recomputed from the exact matrix "
                                   "(only the tail keeps low-bit rounding); larger steps and "
                                   "the embedding lookup use the exact matrix: "
                                   "kernels.linear.RescoredOutput")
    kv_cache_mb: int = setting(512, "paged KV-cache budget in MiB; the block count derives "
                                     "from it")
    num_kv_blocks: int | None = setting(None, "pins the number of KV blocks (tests use tiny "
                                               "pools)")
    block_size: int = setting(16, "tokens per KV block")
    max_num_seqs: int = setting(64, "most sequences running in one tick")
    max_batched_tokens: int = setting(512, "token budget of one tick (bounds a prefill chunk)")
    max_model_len: int | None = setting(None, "context length (default: the model's)")
    prefix_caching: bool = setting(True, "reuse cached KV blocks of shared prompt prefixes")
    preemption: str = setting("recompute", "when KV runs out mid-decode: "
                                            + ", ".join(PREEMPTION_MODES))
    scheduling_policy: str = setting("fcfs", "which waiting request goes next and which "
                                              "running one yields: "
                                      + ", ".join(SCHEDULING_POLICIES))
    priority_aging_s: float = setting(1.0, "priority policy: one priority level is worth "
                                            "this many seconds of waiting, so nothing starves")
    sjf_token_s: float = setting(0.01, "sjf policy: one predicted output token is worth this "
                                        "many seconds of waiting, so long requests do not "
                                        "starve")
    fair_decode_cost: float = setting(2.0, "fair policy: a decode token counts as this many "
                                            "prefill tokens in a tenant's share")
    budget_split: str = setting("decode_first", "who gets a tick's token budget first: "
                                 + ", ".join(BUDGET_SPLITS))
    decode_reserve_tokens: int = setting(32, "budget_split decode_reserve: tokens of each "
                                              "tick kept for decodes, prefills first")
    batch_invariant: bool = setting(False, "bitwise the same logits for a request whatever "
                                            "else is in its batch, however its prompt was "
                                            "chunked and whether its prefix was cached "
                                            "(kernels.invariant; slower)")
    compile: bool | None = setting(None, "run decode-only steps through torch.compile "
                                    "(inductor: fused C++ loops around the matmuls; CPU only, "
                                    "not with batch_invariant; unset: the profile's). The "
                                    "replica compiles at start (jit) or loads the build "
                                    "(aot); a replica process builds aot in the background, "
                                    "serving on the eager step until it is ready")
    compile_mode: str | None = setting(None, "with compile: jit (torch.compile in the "
                                        "replica) or aot (the same step compiled ahead of "
                                        "time with AOTInductor in a child process, cached "
                                        "under $TAILSCOPE_CACHE_DIR/aot; the replica loads it "
                                        "without importing dynamo or inductor: less memory, no "
                                        "Python per step; bfloat16 with weights int4 or "
                                        "int4a8); unset: the profile's")
    step_detail: bool = setting(True, "record each step's members and each waiting request's "
                                       "wait causes (why a request was slow)")

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_batched_tokens", "kv_cache_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {self.profile!r}")
        if None in (self.dtype, self.weights, self.output_weights, self.compile,
                    self.compile_mode):
            from engine.profiles import resolve  # resolved once, like auto below

            for name, value in resolve(self).items():
                object.__setattr__(self, name, value)
        if self.dtype == "auto":  # resolved once, here: config_id and replicas see the choice
            object.__setattr__(self, "dtype", auto_dtype()[0])
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of "
                             f"{sorted(DTYPE_BYTES)} or auto")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                             f"{self.scheduling_policy!r}")
        for name, formats in (("weights", WEIGHT_FORMATS), ("output_weights", OUTPUT_FORMATS)):
            value = getattr(self, name)
            if value not in formats:
                raise ValueError(f"{name} must be one of {formats}, got {value!r}")
            if value != "native" and self.batch_invariant:
                raise ValueError(f"{name}: {value} cannot run batch_invariant: its two "
                                 "kernels (by a step's row count) round differently")
        if self.compile and self.batch_invariant:
            raise ValueError("compile cannot run batch_invariant: its kernels are not traced")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got "
                             f"{self.compile_mode!r}")
        if self.compile_mode != "jit" and not self.compile:
            raise ValueError(f"compile_mode {self.compile_mode} needs compile: true")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got "
                             f"{self.preemption!r}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if self.budget_split not in BUDGET_SPLITS:
            raise ValueError(f"budget_split must be one of {BUDGET_SPLITS}, got "
                             f"{self.budget_split!r}")
        if self.decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be >= 0, got "
                             f"{self.decode_reserve_tokens}")
        if not self.fair_decode_cost >= 0:
            raise ValueError(f"fair_decode_cost must be >= 0, got {self.fair_decode_cost}")
        if not self.sjf_token_s > 0:
            raise ValueError(f"sjf_token_s must be > 0, got {self.sjf_token_s}")

    @classmethod
    def setting_types(cls) -> dict[str, tuple[type, bool, str]]:
        """name -> (type, may be None, help) of every setting, for the derived surfaces."""
        out = {}
        for f in fields(cls):
            hint = str(f.type)
            base = hint.replace(" | None", "")
            out[f.name] = ({"int": int, "float": float, "str": str, "bool": bool}[base],
                           hint != base, f.metadata["help"])
        return out

    @classmethod
    def from_mapping(cls, values: dict[str, Any], where: str = "engine config") -> EngineConfig:
        """A config from a mapping of settings: unknown names and wrong types are errors
        naming the setting (a typo must never fall back to a default silently)."""
        types = cls.setting_types()
        unknown = set(values) - set(types)
        if unknown:
            raise ValueError(f"{where}: unknown engine keys {sorted(unknown)}; known: "
                             f"{', '.join(types)}")
        for name, value in values.items():
            kind, optional, _ = types[name]
            ok = (value is None and optional) or isinstance(value, kind) and not (
                kind is int and isinstance(value, bool))
            if not ok:
                raise ValueError(f"{where}: engine.{name} must be {kind.__name__}, "
                                 f"got {value!r}")
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def num_blocks_for(self, model: ModelConfig) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        per_block = model.kv_bytes_per_token(self.dtype) * self.block_size
        n = (self.kv_cache_mb << 20) // per_block
        if n < 1:
            raise ValueError(f"kv_cache_mb={self.kv_cache_mb} holds no {per_block}-byte block")
        return int(n)
