"""Every Triton kernel against its torch reference, in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set in tests/conftest.py), over ragged and awkward shapes: lengths that
are not multiples of the block size, single tokens, GQA ratios 1, 3 and 8, several dtypes. Then
the engine's greedy tokens with ``TAILSCOPE_KERNELS=triton`` against the torch path.

Tolerances are stated per dtype (``TOL``): fp32 kernels accumulate in a different order than
torch's; fp16/bf16 outputs are rounded once to their storage type.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref

tk = pytest.importorskip("kernels.triton_kernels", reason="triton is a dev dependency")

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=2e-2, atol=2e-3),
       torch.bfloat16: dict(rtol=5e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def paged(lengths, block_size, hk, d, dtype, g, extra_blocks=3):
    """Random K/V for sequences of ``lengths`` in shuffled blocks of a paged cache."""
    num_blocks = sum(-(-n // block_size) for n in lengths) + extra_blocks
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [free[0]] * (width - len(t)) for t in tables])
    return k_cache, v_cache, bt


DECODE_CASES = [(dt, h, hk, 16) for dt in DTYPES for h, hk in ((4, 4), (6, 2), (8, 1))] + [
    (torch.float32, 6, 2, 4), (torch.float32, 6, 2, 5)]  # other block sizes, one not a power of 2


@pytest.mark.parametrize("dtype,heads,kv_heads,block_size", DECODE_CASES)
def test_paged_decode_attention(dtype, heads, kv_heads, block_size):
    g = torch.Generator().manual_seed(heads * 31 + block_size)
    d = 16
    lengths = [1, 7, 33, 300]  # a single key, ragged, and more than one split-K partition
    k_cache, v_cache, bt = paged(lengths, block_size, kv_heads, d, dtype, g)
    q = torch.randn(len(lengths), heads, d, generator=g).to(dtype)
    ctx = torch.tensor(lengths)
    want = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), bt, ctx,
                                      d ** -0.5)
    got = tk.paged_decode_attention(q, k_cache, v_cache, bt, ctx, d ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_paged_prefill_attention_ragged_batch(dtype, heads, kv_heads):
    g = torch.Generator().manual_seed(heads)
    d, block_size = 16, 4
    contexts, chunks = [5, 23, 40, 1], [5, 7, 19, 1]  # whole prompt, chunk after a prefix, ...
    k_cache, v_cache, bt = paged(contexts, block_size, kv_heads, d, dtype, g)
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()])
    q = torch.randn(int(starts[-1]), heads, d, generator=g).to(dtype)
    want = ref.paged_prefill_attention_varlen(q.float(), k_cache.float(), v_cache.float(), bt,
                                              starts, torch.tensor(contexts), d ** -0.5)
    got = tk.paged_prefill_attention_varlen(q, k_cache, v_cache, bt, starts,
                                            torch.tensor(contexts), d ** -0.5)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    one = tk.paged_prefill_attention(q[5:12], k_cache, v_cache, bt[1], 23, d ** -0.5)
    torch.testing.assert_close(one.float(), want[5:12], **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_into_blocks(dtype):
    g = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(6, 5, 3, 8, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(7, 3, 8, generator=g).to(dtype)
    v = torch.randn(7, 3, 8, generator=g).to(dtype)
    slots = torch.tensor([0, 4, 5, 29, 13, 14, 22])
    rk, rv = k_cache.clone(), v_cache.clone()
    ref.write_kv(k, v, rk, rv, slots)
    tk.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, rk) and torch.equal(v_cache, rv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96)])
def test_rms_norm_and_fused_residual_add(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    torch.testing.assert_close(tk.rms_norm(x, w, 1e-5).float(),
                               ref.rms_norm(x.float(), w.float(), 1e-5), **TOL[dtype])
    out, new_res = tk.add_rms_norm(x, res, w, 1e-5)
    want_out, want_res = ref.add_rms_norm(x.float(), res.float(), w.float(), 1e-5)
    torch.testing.assert_close(new_res.float(), want_res, **TOL[dtype])
    torch.testing.assert_close(out.float(), want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_in_place_both_layouts(dtype, interleaved):
    g = torch.Generator().manual_seed(int(interleaved))
    d, max_pos = 16, 64
    freqs = torch.outer(torch.arange(max_pos).float(), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    x = torch.randn(6, 5, d, generator=g).to(dtype)
    pos = torch.tensor([0, 1, 7, 7, 30, 63])
    want = x.clone()
    ref.rotary(want, pos, cos, sin, interleaved)
    got = x.clone()
    tk.rotary(got, pos, cos, sin, interleaved)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert not torch.equal(got, x)  # it did rotate, in place


def test_rotary_half_split_matches_the_models_rotate_half_form(tiny_model):
    m = tiny_model
    d = m.config.head_dim
    x = torch.randn(4, 3, d, dtype=m.dtype, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 3, 9, 20])
    want = x * m.cos[pos].unsqueeze(1) + x.roll(d // 2, dims=-1) * m.sin_signed[pos].unsqueeze(1)
    got = x.clone()
    ref.rotary(got, pos, m.cos_half, m.sin_half)
    # the reference rotates in float32 whatever the dtype (this model is float64): float32's
    # tolerance (float64's 1e-7 failed by 1.7e-7 on one draw of x)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(3, 1500, generator=g).to(dtype)  # more than one column block
    up = torch.randn(3, 1500, generator=g).to(dtype)
    torch.testing.assert_close(tk.silu_and_mul(gate, up).float(),
                               ref.silu_and_mul(gate.float(), up.float()), **TOL[dtype])


def test_engine_greedy_tokens_match_the_torch_path(monkeypatch):
    """The whole engine (chunked prefill after a cached prefix, batched decode) with every
    kernel in Triton, on a tiny float32 model, gives the torch path's greedy tokens."""
    from engine import Engine, EngineConfig, SamplingParams, load_model

    model = load_model("tiny:512", dtype="float32")

    def run() -> list[list[int]]:
        engine = Engine(model, EngineConfig(block_size=4, num_kv_blocks=64, dtype="float32",
                                            max_batched_tokens=8, max_num_seqs=4))
        reqs = [engine.add_request(f"r{i}", [3 + (i * 7 + j) % 500 for j in range(5 + 3 * i)],
                                   SamplingParams(max_tokens=5, ignore_eos=True))
                for i in range(3)]
        while engine.has_unfinished():
            engine.step()
        return [r.output_token_ids for r in reqs]

    monkeypatch.setenv("TAILSCOPE_KERNELS", "torch")
    want = run()
    monkeypatch.setenv("TAILSCOPE_KERNELS", "triton")
    assert run() == want
