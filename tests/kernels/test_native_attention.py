"""Our own paged decode attention (``kernels/csrc/paged_attention.c`` through ``kernels.native``)
against the float64 attention of the same queries, keys and values, its refusals, and the
engine's use of it."""

from __future__ import annotations

import pytest
import torch

from kernels import native, reference

needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason="the native kernels are not available here")


def _case(b: int, h: int, hk: int, d: int, block_size: int, lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = 64
    k_cache = torch.randn(blocks, block_size, hk, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks, block_size, hk, d, generator=g).to(torch.bfloat16)
    width = max(-(-n // block_size) for n in lens) + 1  # padded past the longest
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(b)])
    # a query as the model hands it over: heads of a wider QKV row (a strided view)
    qkv = torch.randn(b, h + 2 * hk, d, generator=g).to(torch.bfloat16)
    return qkv[:, :h], k_cache, v_cache, tables, torch.tensor(lens)


@needs_kernel
@pytest.mark.parametrize("b,h,hk,d,block_size,lens", [
    (1, 9, 3, 64, 16, [1]),
    (1, 9, 3, 64, 16, [100]),
    (3, 9, 3, 64, 16, [17, 16, 33]),            # a block and one, exactly a block, a tail
    (8, 9, 3, 64, 16, [5, 64, 97, 128, 1, 300, 31, 250]),
    (4, 8, 8, 64, 8, [9, 40, 1, 77]),           # no grouping, a block size of 8
    (2, 16, 2, 128, 16, [200, 65]),             # 8 query heads per KV head, head size 128
    (32, 9, 3, 64, 16, list(range(3, 320, 10))),
])
def test_attention_equals_the_float64_attention_within_bf16_rounding(b, h, hk, d, block_size,
                                                                      lens):
    q, k_cache, v_cache, tables, ctx = _case(b, h, hk, d, block_size, lens, seed=b * 131 + d)
    scale = d ** -0.5
    got = native.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    assert got.shape == (b, h, d) and got.dtype == torch.bfloat16 and got.is_contiguous()
    want = reference.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(),
                                            tables, ctx, scale, masked=True)
    # float32 inside, one rounding to bf16 at the end: within bf16's half step (2^-9 of the
    # value) and float32's sums
    err = (got.double() - want).abs()
    assert bool((err <= want.abs() * 2 ** -8 + 1e-4).all()), float(err.max())
    # and no worse than torch's own bf16 attention on the same inputs
    torch_bf16 = reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale,
                                                  masked=True)
    assert float(err.max()) <= float((torch_bf16.double() - want).abs().max()) * 1.5 + 1e-6


@needs_kernel
def test_keys_past_the_context_are_never_read():
    """Rows past a sequence's length (in its last block, or whole blocks of padding) may hold
    anything, NaN included: the result must not change."""
    q, k_cache, v_cache, tables, ctx = _case(2, 9, 3, 64, 16, [20, 7], seed=5)
    before = native.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125)
    for i, n in enumerate(ctx.tolist()):
        for t in range(n, tables.shape[1] * 16):
            blk = int(tables[i, t // 16])
            if any(blk == int(tables[j, u // 16]) and u % 16 == t % 16
                   for j, m in enumerate(ctx.tolist()) for u in range(m)):
                continue  # a row another sequence (or this one) does read
            k_cache[blk, t % 16] = float("nan")
            v_cache[blk, t % 16] = float("nan")
    after = native.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125)
    assert torch.equal(before, after)


@needs_kernel
def test_bad_inputs_are_refused_not_read_out_of_bounds():
    q, k_cache, v_cache, tables, ctx = _case(2, 9, 3, 64, 16, [20, 7], seed=7)
    call = native.paged_decode_attention
    with pytest.raises(RuntimeError, match="block id outside"):
        call(q, k_cache, v_cache, torch.tensor([[0, 64], [1, 2]]), ctx, 0.125)
    with pytest.raises(RuntimeError, match="block id outside"):
        call(q, k_cache, v_cache, torch.tensor([[0, -1], [1, 2]]), ctx, 0.125)
    with pytest.raises(RuntimeError, match="context length outside"):
        call(q, k_cache, v_cache, tables[:, :1], torch.tensor([17, 3]), 0.125)
    with pytest.raises(RuntimeError, match="context length outside"):
        call(q, k_cache, v_cache, tables, torch.tensor([0, 3]), 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        call(q.float(), k_cache, v_cache, tables, ctx, 0.125)
    with pytest.raises(RuntimeError, match="unsupported shape"):
        call(q[..., :48], k_cache[..., :48].contiguous(), v_cache[..., :48].contiguous(), tables,
             ctx, 0.125)
    with pytest.raises(RuntimeError, match="block_tables"):
        call(q, k_cache, v_cache, tables.int(), ctx, 0.125)
    assert call(q[:0], k_cache, v_cache, tables[:0], ctx[:0], 0.125).shape == (0, 9, 64)
    assert native.attention_fits(9, 3, 64, torch.bfloat16)
    assert not native.attention_fits(9, 3, 64, torch.float32)
    assert not native.attention_fits(9, 3, 48, torch.bfloat16)
    assert not native.attention_fits(16, 1, 64, torch.bfloat16)  # 16 query heads per KV head


@needs_kernel
def test_a_bf16_engine_decodes_through_it_with_torch_attentions_tokens():
    """The bundled model in bf16, eager: decode steps of 4 sequences of different lengths attend
    through our kernel (it is the one used: the model says so, and a cache poisoned past every
    context would show NaN if it read there) and sample the tokens torch's gather and SDPA give,
    logprobs within two steps of a bf16 logit (the logits leave the bf16 output matrix: at
    16-32 their steps are 0.125 apart)."""
    from engine import Engine, EngineConfig, SamplingParams, load_model

    prompts = [list(range(200 + 7 * i, 200 + 7 * i + n)) for i, n in enumerate((9, 40, 130, 17))]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    runs = {}
    for own in (True, False):
        model = load_model(None, "bfloat16")
        assert model.native_decode_attention
        model.native_decode_attention = own
        engine = Engine(model, EngineConfig(dtype="bfloat16", kv_cache_mb=32))
        if own:
            for k_cache, v_cache in engine.runner.kv_caches:
                k_cache.fill_(float("nan"))
                v_cache.fill_(float("nan"))
        runs[own] = engine.generate(prompts, params)
    for ours, theirs in zip(runs[True], runs[False], strict=True):
        assert ours.output_token_ids == theirs.output_token_ids
        for a, b in zip(ours.output_logprobs, theirs.output_logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= 0.25


@needs_kernel
def test_argmax_gives_torchs_indices_ties_nan_and_infinities_included():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 49152, generator=g)
    x[1, 100] = x[1, 40000] = 50.0            # a tie: the first wins
    x[2] = float("-inf")                       # nothing above -inf: index 0
    x[3, 7] = float("nan")                     # a NaN is the largest
    x[3, 3] = float("nan")                     # the first NaN wins
    x[4, 49151] = 99.0                         # the very last value
    x[5, 49144:] = 80.0                        # ties inside the last 16 values
    x[6] = 1.0                                 # all equal
    x[7, 0] = float("inf")
    x[8, 12345] = float("inf")
    x[8, 23456] = float("inf")
    want = x.argmax(dim=-1)
    assert native.argmax(x).tolist() == want.tolist()
    for n in (1, 5, 16, 17, 33):               # lengths with and without a tail
        y = torch.randn(4, n, generator=g)
        assert native.argmax(y).tolist() == y.argmax(dim=-1).tolist()
    view = x[:, 1000:2000]                     # rows apart by more than their length
    assert native.argmax(view).tolist() == view.argmax(dim=-1).tolist()
    assert native.argmax(x[:0]).shape == (0,)
    with pytest.raises(RuntimeError, match="float32"):
        native.argmax(x.to(torch.bfloat16))
