"""Our own C kernels for decode steps, each file saying why it exists: a 4-bit matmul
(``csrc/q4_gemm.c``), decode attention straight from the paged KV cache
(``csrc/paged_attention.c``), greedy sampling's argmax (``csrc/argmax.c``), the rescoring
of top logits from an output matrix kept as Q8_0 blocks (``csrc/q8_rows.c``), the whole
matmul with such a matrix (``csrc/q8_gemm.c``), and the choice of top logits and their merge
into the step's logits (``csrc/topk.c``), registered as the torch operators
``tailscope_native::int4_mm``, ``::paged_decode_attention``, ``::argmax``, ``::q8_rows_dot``,
``::q8_mm``, ``::topk_indices`` and ``::rescored_logits`` (``csrc/ops.cpp``), compiled
on first use with the system C and C++ compilers against the installed torch's headers (~10 s).

On a CPU without AVX-512 BF16 a second library, ``tailscope_avx2::int4_mm_f32`` and
``::q8_mm_f32`` (``csrc/q4_gemm_avx2.c``, ``csrc/q8_gemm_avx2.c``, AVX2 + FMA + F16C), runs
the 4-bit and the Q8_0 matmuls on float32 activations (``avx2_available()``;
``TAILSCOPE_NATIVE_KERNELS=avx2`` selects
it alone on any CPU that has those).

More: docs/design/engine-notes.md#kernelsnative."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.config import AVX2_FLAGS, c_compilers, cpu_flags, native_kernels_switch
from tailscope import env

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
C_SOURCES = (CSRC / "q4_gemm.c", CSRC / "paged_attention.c", CSRC / "argmax.c",
             CSRC / "q8_rows.c", CSRC / "q8_gemm.c", CSRC / "topk.c")
# what the build's cache key hashes
SOURCES = (*C_SOURCES, CSRC / "bf16.h", CSRC / "q4_operands.h", CSRC / "ops.cpp")
C_FLAGS = ["-O3", "-std=c11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
           "-mavx512vnni", "-mf16c", "-mfma", "-fopenmp", "-fPIC"]
CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c", "fma"}

# The AVX2 library: the 4-bit and Q8_0 matmuls on float32 activations, for CPUs
# without AVX-512 BF16, a library of its own so that it loads where the one above cannot.
AVX2_C_SOURCES = (CSRC / "q4_gemm_avx2.c", CSRC / "q8_gemm_avx2.c")
AVX2_SOURCES = (*AVX2_C_SOURCES, CSRC / "q4_operands.h", CSRC / "ops_avx2.cpp")
AVX2_C_FLAGS = ["-O3", "-std=c11", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC"]
AVX2_CPU_FLAGS = AVX2_FLAGS


def cache_dir() -> Path:
    return env.cache_dir() / "kernels"


def cpu_supported(needed: frozenset[str] | set[str] = CPU_FLAGS) -> tuple[bool, str]:
    """The CPU has every instruction set the kernel uses (/proc/cpuinfo's flags)."""
    flags = cpu_flags()
    if flags is None:
        return False, "no /proc/cpuinfo"
    missing = sorted(needed - flags)
    return (not missing, f"CPU lacks {', '.join(missing)}" if missing else "")


def _cxx_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return ["-O2", "-std=c++20", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in include_paths())]


def _build(cc: str, cxx: str, cxx_flags: list[str], path: Path,
           c_sources: tuple[Path, ...] = C_SOURCES, c_flags: list[str] = C_FLAGS,
           ops: Path = CSRC / "ops.cpp") -> None:
    torch_lib = Path(torch.__file__).parent / "lib"
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objects = [f"{tmp}/{src.stem}.o" for src in c_sources]
        steps = [*([cc, *c_flags, "-c", str(src), "-o", o]
                   for src, o in zip(c_sources, objects, strict=True)),
                 [cxx, *cxx_flags, "-c", str(ops), "-o", f"{tmp}/ops.o"],
                 [cxx, "-shared", "-fopenmp", f"{tmp}/ops.o", *objects,
                  f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-o", f"{tmp}/lib.so"]]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise OSError(f"{cmd[0]} failed: {done.stderr.strip()[-2000:]}")
        os.replace(f"{tmp}/lib.so", path)


def _load(name: str, sources: tuple[Path, ...], c_sources: tuple[Path, ...],
          c_flags: list[str], ops: Path, compilers: tuple[str, str]) -> Path:
    """Build (once, into the cache) and load one library; raises on failure."""
    cc, cxx = compilers
    versions = [subprocess.run([c, "--version"], capture_output=True, text=True,
                               timeout=30).stdout for c in (cc, cxx)]
    cxx_flags = _cxx_flags()
    key = hashlib.sha256("\0".join([*(p.read_text() for p in sources), cc, cxx, *versions,
                                    *c_flags, *cxx_flags, torch.__version__]).encode()
                         ).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        _build(cc, cxx, cxx_flags, path, c_sources, c_flags, ops)
    torch.ops.load_library(str(path))
    return path


@functools.cache
def available() -> bool:
    """The ``torch.ops.tailscope_native`` operators are loaded (built first if need be); when
    not, the reason is logged once (INFO: not this machine or switched off; WARNING: the
    build failed)."""
    switch = native_kernels_switch()
    if switch != "on":
        log.info("native kernels %s (TAILSCOPE_NATIVE_KERNELS)",
                 "off" if switch == "off" else "for AVX-512 off: the AVX2 ones alone")
        return False
    ok, why = cpu_supported()
    if not ok:
        log.info("native kernels not used: %s", why)
        return False
    compilers = c_compilers()
    if compilers is None:
        log.info("native kernels not used: no C / C++ compiler (cc, c++) on PATH")
        return False
    if hasattr(torch.ops.tailscope_native, "q8_mm"):  # loaded already (cache_clear)
        return True
    try:
        path = _load("tailscope_native", SOURCES, C_SOURCES, C_FLAGS, CSRC / "ops.cpp",
                     compilers)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native kernels not built, torch's kernels are used: %s", e)
        return False
    torch.library.register_fake("tailscope_native::int4_mm")(_int4_mm_fake)
    torch.library.register_fake("tailscope_native::int4_mm_a8")(_int4_mm_fake)
    torch.library.register_fake("tailscope_native::paged_decode_attention")(
        lambda q, *_: q.new_empty(q.shape))
    torch.library.register_fake("tailscope_native::argmax")(
        lambda x: x.new_empty(x.shape[:1], dtype=torch.long))
    torch.library.register_fake("tailscope_native::q8_rows_dot")(
        lambda x, codes, scale, idx: x.new_empty(idx.shape, dtype=torch.float32))
    torch.library.register_fake("tailscope_native::q8_mm")(
        lambda x, codes, scale, n: x.new_empty((x.shape[0], n), dtype=torch.float32))
    torch.library.register_fake("tailscope_native::topk_indices")(
        lambda x, k: x.new_empty((x.shape[0], k), dtype=torch.long))
    torch.library.register_fake("tailscope_native::rescored_logits")(
        lambda y, idx, top: y.new_empty(y.shape, dtype=torch.float32))
    log.info("native kernels loaded (%s)", path)
    return True


@functools.cache
def avx2_available() -> bool:
    """The ``torch.ops.tailscope_avx2`` operators (``int4_mm_f32``, ``q8_mm_f32``) are
    loaded, built first if need be: where the AVX-512 library is not (``available()`` False:
    this CPU lacks AVX-512 BF16, or ``TAILSCOPE_NATIVE_KERNELS=avx2``) and the CPU has AVX2,
    FMA and F16C."""
    if native_kernels_switch() == "off" or available():
        return False
    ok, why = cpu_supported(AVX2_CPU_FLAGS)
    compilers = c_compilers()
    if not ok or compilers is None:
        log.info("AVX2 kernels not used: %s", why or "no C / C++ compiler (cc, c++) on PATH")
        return False
    if hasattr(torch.ops.tailscope_avx2, "q8_mm_f32"):  # loaded already (cache_clear)
        return True
    try:
        path = _load("tailscope_avx2", AVX2_SOURCES, AVX2_C_SOURCES, AVX2_C_FLAGS,
                     CSRC / "ops_avx2.cpp", compilers)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("AVX2 kernels not built, torch's kernels are used: %s", e)
        return False
    torch.library.register_fake("tailscope_avx2::int4_mm_f32")(
        lambda x, packed, scale, zero, n: x.new_empty((x.shape[0], n)))
    torch.library.register_fake("tailscope_avx2::q8_mm_f32")(
        lambda x, codes, scale, n: x.new_empty((x.shape[0], n)))
    log.info("AVX2 kernels loaded (%s)", path)
    return True


def int4_mm_f32(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                out_features: int) -> torch.Tensor:
    """``x`` [M, K] float32 times the packed matrix (``pack_int4``), [M, N] float32, on AVX2
    (``csrc/q4_gemm_avx2.c``: exact products, float32 sums). Only where ``avx2_available()``."""
    return torch.ops.tailscope_avx2.int4_mm_f32(x, packed, scale, zero, out_features)


def q8_mm_f32(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, out_features: int
              ) -> torch.Tensor:
    """``q8_mm`` on float32 inputs, AVX2 (``csrc/q8_gemm_avx2.c``). Only where
    ``avx2_available()``."""
    return torch.ops.tailscope_avx2.q8_mm_f32(x, codes, scale, out_features)


def _int4_mm_fake(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  zero: torch.Tensor, out_features: int, out_dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features), dtype=out_dtype)


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``w = (code - 8) * scale + zero`` ([N, K] codes 0..15, [N, K / group] scales and zeros)
    in the kernel's layout: codes as [N/16, K/32, 8, 32] bytes, and the kernel's scale ``S`` and
    zero ``Z = zero - 8 * scale`` as [N/16, K/32, 16], float16 where that holds them exactly
    (GGUF's Q4_0 / Q4_1 scales are float16), else float32. None where the shape does not fit
    the kernel (N a multiple of 16, K of 32, groups of 32)."""
    n, k = codes.shape
    if group != 32 or n % 16 or k % 32:
        return None
    c = codes.to(torch.uint8).view(n // 16, 16, k // 32, 8, 2, 2)
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()
    s = scale.float()
    z = zero.float() - 8 * s
    half = all(bool(torch.equal(t.half().float(), t)) for t in (s, z))

    def tiles(t: torch.Tensor) -> torch.Tensor:
        t = t.view(n // 16, 16, k // 32).permute(0, 2, 1).contiguous()
        return t.half() if half else t

    return packed, tiles(s), tiles(z)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            out_features: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``x`` [M, K] bfloat16 times the packed matrix (``pack_int4``): [M, N] in ``out_dtype``
    (bfloat16 or float32). Only where ``available()``."""
    return torch.ops.tailscope_native.int4_mm(x, packed, scale, zero, out_features, out_dtype)


def int4_mm_a8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               out_features: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``int4_mm`` with the inputs of a step of up to 31 rows quantized to int8 per group of 32
    (``q = round(x / d)``, ``d = max |x| / 127``: GGUF's Q8_0 form) and multiplied with the
    codes by AVX-512 VNNI (``vpdpbusd``: 64 products an instruction, bf16's ``vdpbf16ps`` 32):
    not exact (~1% relative error of each output beyond the 4-bit weights'). Many rows as
    ``int4_mm``. Only where ``available()``."""
    return torch.ops.tailscope_native.int4_mm_a8(x, packed, scale, zero, out_features,
                                                 out_dtype)


def attention_fits(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """``paged_decode_attention`` takes this model's attention: bfloat16, a head size that is a
    multiple of 32 up to 256, at most 8 query heads per KV head."""
    return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 8)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
                           ) -> torch.Tensor:
    """``kernels.reference.paged_decode_attention`` (one query token per sequence, ``q``
    [B, H, D]) read straight from the paged caches [blocks, block_size, Hk, D]: no gathered
    copy, no padding; bfloat16 in and out, float32 inside. Only where ``available()`` and
    ``attention_fits``."""
    return torch.ops.tailscope_native.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                              context_lens, scale)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a [rows, n] float32 tensor, the same indices (the first of equal
    maxima, the first NaN), vectorised (``csrc/argmax.c``: torch's CPU argmax is a scalar loop,
    ~185 us a decode step of 8 rows here). Only where ``available()``."""
    return torch.ops.tailscope_native.argmax(x)


def q8_rows_dot(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor
                ) -> torch.Tensor:
    """``out[b, j] = rows[idx[b, j]] . x[b]`` in float32 for a matrix of GGUF Q8_0 blocks
    (``codes`` [V, H] int8, ``scale`` [V, H / 32] float16; ``kernels.linear.Int8Rows``), each
    weight rounded to bfloat16 as a bfloat16 copy of the matrix holds it; ``x`` [B, H]
    bfloat16, ``idx`` [B, k] int64 (``csrc/q8_rows.c``). Only where ``available()``."""
    return torch.ops.tailscope_native.q8_rows_dot(x, codes, scale, idx)


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 matrix (``codes`` [N, K] int8, ``scale`` [N, K / 32] float16) in ``q8_mm``'s
    layout: codes as [ceil(N / 16), K / 32, 16, 16, 2] (tile, group, input pair, output, input
    of the pair), scales as [ceil(N / 16), K / 32, 16]; rows past N zero."""
    n, k = codes.shape
    pad = -n % 16
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_zeros(pad, k // 32)])
    t = (n + pad) // 16
    tiled = codes.view(t, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    return tiled, scale.to(torch.float16).view(t, 16, k // 32).permute(0, 2, 1).contiguous()


def q8_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, out_features: int
          ) -> torch.Tensor:
    """``x`` [M, K] bfloat16 times a Q8_0 matrix packed by ``pack_q8``: [M, N] float32, the
    products exact and summed in float32 (``csrc/q8_gemm.c``). Only where ``available()``."""
    return torch.ops.tailscope_native.q8_mm(x, codes, scale, out_features)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x.topk(k, dim=-1).indices`` of a [rows, n] bfloat16 tensor: the k largest values'
    indices, largest first, of equal values the lower index (``csrc/topk.c``: torch's CPU topk
    on bfloat16 took ~290 us for 8 rows of a 49,152-token vocabulary here, every decode step
    of a model whose output matrix is rescored). Only where ``available()``."""
    return torch.ops.tailscope_native.topk_indices(x, k)


def rescored_logits(y: torch.Tensor, idx: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``y.scatter(-1, idx, top).float()`` for [rows, n] bfloat16 ``y``, [rows, k] int64
    ``idx`` and bfloat16 ``top``, in one pass (``csrc/topk.c``; in a compiled graph that
    scatter cost ~220 us a step beyond the conversion). Only where ``available()``."""
    return torch.ops.tailscope_native.rescored_logits(y, idx, top)
