"""Engine profiles: the settings a CPU runs fastest with (``fast``), or the float32 path that is
bitwise equal to a dense recompute (``exact``).

A profile fills in only the settings nobody gave (``EngineConfig``'s ``dtype``, ``weights``,
``output_weights``, ``compile``, ``compile_mode`` left unset); every individual setting still
overrides it. ``fast`` is chosen per CPU from the flags in /proc/cpuinfo:

More: docs/design/engine-notes.md#engineprofiles."""

from __future__ import annotations

from engine.config import (
    AVX2_FLAGS,
    BF16_FLAGS,
    PROFILES,
    c_compilers,
    cpu_flags,
    native_kernels_switch,
)

PRODUCT_DEFAULT = "fast"
_EXACT = {"dtype": "float32", "weights": "native", "output_weights": "native",
          "compile": False, "compile_mode": "jit"}


def choose(profile: str, flags: set[str] | None = None, batch_invariant: bool = False
           ) -> tuple[dict[str, str], str]:
    """The settings ``profile`` means on a CPU with ``flags`` (default: this one's), and why;
    under ``batch_invariant`` (whose kernels packed weights cannot run) native weights."""
    settings, why = _choose(profile, flags)
    if batch_invariant and settings["weights"] != "native":
        settings.update(weights="native", output_weights="native", compile=False,
                        compile_mode="jit")
        why += " (native weights, not compiled: batch_invariant)"
    return settings, why


def resolve(config) -> dict:
    """The values of ``config``'s unset settings (an ``EngineConfig`` being made): its
    profile's, except that the profile's compiled step needs the profile's dtype and packed
    weights (AOT runs bfloat16 with int4 or int4a8 only): given others, compile stays off."""
    chosen, _ = choose(config.profile, batch_invariant=config.batch_invariant)
    out = {k: v for k, v in chosen.items() if getattr(config, k) is None}
    dtype = config.dtype or chosen["dtype"]
    aot_runs = dtype == "bfloat16" and (config.weights or chosen["weights"]) in ("int4",
                                                                               "int4a8")
    if config.compile is None and chosen["compile"] and not aot_runs:
        out["compile"] = False
    compiles = out.get("compile", config.compile)
    if config.compile_mode is None and out.get("compile_mode") == "aot" and not (
            aot_runs and compiles):
        out["compile_mode"] = "jit"
    return out


def _choose(profile: str, flags: set[str] | None) -> tuple[dict[str, str], str]:
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    if profile == "exact":
        return dict(_EXACT), "exact: float32 with native weights, bitwise against a recompute"
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return dict(_EXACT), "fast: CPU features unknown (no /proc/cpuinfo): the exact path"
    native = sorted(flags & BF16_FLAGS)
    if native:
        return ({"dtype": "bfloat16", "weights": "int4", "output_weights": "q8_0",
                 "compile": True, "compile_mode": "aot"},
                f"fast: the CPU multiplies bf16 natively ({', '.join(native)}): bfloat16 "
                "activations, packed 4-bit weights, the output matrix as Q8_0 blocks, the "
                "decode step compiled ahead of time")
    bare = "fast: no native bf16 multiply on this CPU (neither avx512_bf16 nor amx_bf16)"
    if AVX2_FLAGS <= flags:
        if _kernels_buildable():
            return ({"dtype": "float32", "weights": "int4", "output_weights": "q8_0",
                     "compile": False, "compile_mode": "jit"},
                    f"{bare}; {', '.join(sorted(AVX2_FLAGS))}: float32 activations, packed "
                    "4-bit weights and the output matrix as Q8_0 blocks on the AVX2 kernels")
        return dict(_EXACT), (f"{bare}, and our AVX2 kernel cannot be built here (no C / C++ "
                              "compiler, or TAILSCOPE_NATIVE_KERNELS off): float32 with native "
                              "weights, as exact")
    return dict(_EXACT), f"{bare}, nor AVX2 with FMA and F16C: float32 with native weights, " \
        "as exact"


def _kernels_buildable() -> bool:
    """What ``kernels.native`` needs to build its kernels (checked without importing torch)."""
    return native_kernels_switch() != "off" and c_compilers() is not None


def explain(config) -> str:
    """Why ``config`` (an ``EngineConfig``) runs as it does: its profile's reason here, and the
    settings given over it."""
    chosen, why = choose(config.profile, batch_invariant=config.batch_invariant)
    over = [f"{k}={getattr(config, k)}" for k, v in chosen.items() if getattr(config, k) != v]
    return why + (f"; set over it: {', '.join(over)}" if over else "")
