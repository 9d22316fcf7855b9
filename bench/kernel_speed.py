"""The Triton kernels against their torch references on a GPU, side by side in one run.

For each kernel: time per call (CUDA events, median of ``--iters`` after warm-up), achieved
memory bandwidth (bytes the kernel must move / time) as a share of the device's peak
(``--peak-gbs``; default: the H100/H200 class figure), and the torch reference's time (and
``scaled_dot_product_attention`` over a dense copy of the same keys for the attention kernels,
which is what the paged kernels compete with). On a machine without CUDA it says so and exits 0.

    python bench/kernel_speed.py [--dtype bfloat16] [--iters 50] [--peak-gbs 4800]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="device memory bandwidth")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: the Triton kernels are checked on the CPU by the interpreter "
              "tests (tests/kernels/test_triton_kernels.py); run this on a GPU for timings.")
        return 0
    import torch.nn.functional as F

    from kernels import reference as ref
    from kernels import triton_kernels as tk

    dt = getattr(torch, args.dtype)
    dev = "cuda"
    el = torch.empty((), dtype=dt).element_size()
    rows = []

    def add(name: str, nbytes: int, tri, torch_ref, sdpa=None) -> None:
        t_tri, t_ref = timed(tri, args.iters), timed(torch_ref, args.iters)
        t_sdpa = timed(sdpa, args.iters) if sdpa else None
        gbs = nbytes / (t_tri / 1e3) / 1e9
        rows.append((name, t_tri, gbs, gbs / args.peak_gbs, t_ref, t_sdpa))

    # paged decode: 64 sequences x 2048 context, 32 query heads over 8 KV heads, head dim 128
    b, h, hk, d, bs, ctx = 64, 32, 8, 128, 16, 2048
    nblk = b * ctx // bs
    kc = torch.randn(nblk, bs, hk, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nblk, device=dev).view(b, ctx // bs)
    cl = torch.full((b,), ctx, device=dev)
    q = torch.randn(b, h, d, device=dev, dtype=dt)
    kd = kc[bt].reshape(b, ctx, hk, d).transpose(1, 2).contiguous()
    vd = vc[bt].reshape(b, ctx, hk, d).transpose(1, 2).contiguous()
    add("paged_decode_attention", 2 * b * ctx * hk * d * el + 2 * b * h * d * el,
        lambda: tk.paged_decode_attention(q, kc, vc, bt, cl, d ** -0.5),
        lambda: ref.paged_decode_attention(q, kc, vc, bt, cl, d ** -0.5),
        lambda: F.scaled_dot_product_attention(q.view(b, hk, h // hk, d), kd, vd))
    # paged prefill: 4 sequences, 512-token chunks after 1536 cached tokens
    s, n, ctx2 = 4, 512, 2048
    starts = torch.arange(0, (s + 1) * n, n, device=dev)
    qp = torch.randn(s * n, h, d, device=dev, dtype=dt)
    bt2 = bt[:s]
    ctxs = torch.full((s,), ctx2, device=dev)
    add("paged_prefill_attention_varlen", 2 * s * ctx2 * hk * d * el + 2 * s * n * h * d * el,
        lambda: tk.paged_prefill_attention_varlen(qp, kc, vc, bt2, starts, ctxs, d ** -0.5),
        lambda: ref.paged_prefill_attention_varlen(qp, kc, vc, bt2, starts, ctxs, d ** -0.5))
    # norms, rotary, activation at 4096 tokens x hidden 4096 (intermediate 14336)
    t, hid, inter = 4096, 4096, 14336
    x = torch.randn(t, hid, device=dev, dtype=dt)
    r = torch.randn_like(x)
    w = torch.randn(hid, device=dev, dtype=dt)
    add("rms_norm", 2 * t * hid * el, lambda: tk.rms_norm(x, w, 1e-5),
        lambda: ref.rms_norm(x, w, 1e-5))
    add("add_rms_norm", 4 * t * hid * el, lambda: tk.add_rms_norm(x, r, w, 1e-5),
        lambda: ref.add_rms_norm(x, r, w, 1e-5))
    qk = torch.randn(t, h + hk, d, device=dev, dtype=dt)
    pos = torch.arange(t, device=dev)
    freqs = torch.outer(pos.float(), 1.0 / 10000 ** (torch.arange(0, d, 2, device=dev) / d))
    cos, sin = freqs.cos().to(dt), freqs.sin().to(dt)
    add("rotary", 2 * qk.numel() * el, lambda: tk.rotary(qk, pos, cos, sin),
        lambda: ref.rotary(qk, pos, cos, sin))
    g, u = torch.randn(t, inter, device=dev, dtype=dt), torch.randn(t, inter, device=dev, dtype=dt)
    add("silu_and_mul", 3 * t * inter * el, lambda: tk.silu_and_mul(g, u),
        lambda: ref.silu_and_mul(g, u))
    kn = torch.randn(t, hk, d, device=dev, dtype=dt)
    slots = torch.randperm(nblk * bs, device=dev)[:t]
    add("write_kv", 4 * t * hk * d * el, lambda: tk.write_kv(kn, kn, kc, vc, slots),
        lambda: ref.write_kv(kn, kn, kc, vc, slots))

    print(f"{torch.cuda.get_device_name()} · {args.dtype} · peak {args.peak_gbs:.0f} GB/s\n")
    print("| kernel | Triton ms | GB/s | % of peak | torch ms | SDPA (dense) ms |")
    print("|---|---|---|---|---|---|")
    for name, t_tri, gbs, frac, t_ref, t_sdpa in rows:
        sd = f"{t_sdpa:.3f}" if t_sdpa is not None else "-"
        print(f"| {name} | {t_tri:.3f} | {gbs:.0f} | {frac:.0%} | {t_ref:.3f} | {sd} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
