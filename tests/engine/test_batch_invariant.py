"""Batch-invariant mode (``engine.batch_invariant``): a request's logits are bitwise the same
whatever else is in its batch, however its prompt was chunked and whether its prefix came from
the cache; with the mode off, the same scenarios show a difference (so the test can tell)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, load_model
from kernels import invariant

TARGET = "target"
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


PROMPT = _prompt(150, 0)  # 3 key blocks, 3 query tiles: the folds and tiles are exercised


def _engine(model, dtype: str, bi: bool, **kw) -> Engine:
    cfg = dict(dtype=dtype, batch_invariant=bi, num_kv_blocks=400, block_size=16,
               max_num_seqs=16, max_batched_tokens=512)
    return Engine(model, EngineConfig(**{**cfg, **kw}))


def _run(engine: Engine, others: list[tuple[list[int], SamplingParams]], stagger: int = 0,
         warm: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """The target request among ``others`` (the first half submitted before it, the rest
    ``stagger`` ticks apart after it); its sampled tokens and the logits of every position it
    sampled from, captured as the sampler receives them."""
    if warm is not None:  # a request with the same prompt first: the target's prefix is cached
        engine.add_request("warm", warm, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
    rows: list[torch.Tensor] = []
    sample = engine.runner._sample

    def capture(logits, reqs):
        rows.extend(logits[i].clone() for i, r in enumerate(reqs) if r.request_id == TARGET)
        return sample(logits, reqs)

    engine.runner._sample = capture
    half = len(others) // 2
    for i, (p, sp) in enumerate(others[:half]):
        engine.add_request(f"o{i}", p, sp)
    target = engine.add_request(TARGET, PROMPT, SEEDED)
    later = list(enumerate(others[half:], half))
    tick = 0
    while later or engine.has_unfinished():
        if later and tick % max(stagger, 1) == 0:
            i, (p, sp) = later.pop(0)
            engine.add_request(f"o{i}", p, sp)
        engine.step()
        tick += 1
    engine.runner._sample = sample
    if warm is not None:
        assert target.num_cached_tokens > 0, "the prefix was meant to come from the cache"
    return target.output_token_ids, torch.stack(rows)


def _mixed(k: int) -> list[tuple[list[int], SamplingParams]]:
    lengths = [3, 70, 12, 140, 31, 7, 90, 25, 60, 5, 44, 18, 100, 9, 33]
    return [(_prompt(lengths[i % len(lengths)], 10 + i),
             SamplingParams(max_tokens=4 + 3 * (i % 5), temperature=0.8 * (i % 2), seed=i,
                            ignore_eos=True)) for i in range(k)]


def _scenarios(model, dtype: str, bi: bool) -> dict[str, tuple[list[int], torch.Tensor]]:
    return {
        "alone": _run(_engine(model, dtype, bi), []),
        "batch of 2": _run(_engine(model, dtype, bi), _mixed(1)),
        "batch of 7, staggered": _run(_engine(model, dtype, bi), _mixed(6), stagger=2),
        "max_num_seqs (16)": _run(_engine(model, dtype, bi), _mixed(15), stagger=1),
        "chunked prefill (chunks of 16)": _run(_engine(model, dtype, bi, max_batched_tokens=16),
                                               _mixed(3), stagger=3),
        "prefix cached": _run(_engine(model, dtype, bi), _mixed(2), warm=PROMPT[:130]),
    }


@pytest.fixture(scope="module")
def bi_models(bundled_path):
    return {d: load_model(bundled_path, d, batch_invariant=True)
            for d in ("float32", "bfloat16")}


@pytest.mark.bundled
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_are_bitwise_equal_in_every_batch_mix(bi_models, dtype):
    runs = _scenarios(bi_models[dtype], dtype, True)
    tokens, logits = runs.pop("alone")
    assert len(tokens) == SEEDED.max_tokens and logits.shape[0] == SEEDED.max_tokens
    for name, (t, lg) in runs.items():
        assert lg.shape == logits.shape, name
        diff = (lg != logits).any(-1).nonzero().flatten().tolist()
        assert not diff, f"{name}: logits differ at positions {diff}"
        assert t == tokens, name


@pytest.mark.bundled
def test_without_the_mode_the_same_scenarios_differ(bundled_model):
    """fp32 with the mode off: some scenario's logits are not bitwise those of the solo run
    (CPU GEMM blocking changes with the row count), so the test above can fail."""
    runs = _scenarios(bundled_model, "float32", False)
    _, logits = runs.pop("alone")
    differing = [name for name, (_, lg) in runs.items()
                 if lg.shape != logits.shape or not torch.equal(lg, logits)]
    assert differing, "expected the default kernels to differ in some batch mix"


def test_invariant_linear_rows_do_not_depend_on_the_call():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(96, 80, generator=g).to(dtype)
        lin = invariant.InvariantLinear(w, invariant.invariant_chunk(tuple(w.shape), dtype))
        x = torch.randn(70, 80, generator=g).to(dtype)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(70)])
        for m in (2, 5, 32, 33, 70):
            assert torch.equal(lin(x[:m]), alone[:m]), (dtype, m)
        assert torch.allclose(alone.float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-1)


def test_invariant_attention_matches_the_reference_and_any_chunking():
    from kernels import reference

    g = torch.Generator().manual_seed(5)
    kc, vc = torch.randn(2, 24, 8, 2, 16, generator=g)
    table = torch.randperm(24, generator=g)
    q = torch.randn(150, 6, 16, generator=g)
    alone = torch.stack([invariant.paged_decode_attention(
        q[p:p + 1], kc, vc, table[None], torch.tensor([p + 1]), 0.25)[0] for p in range(150)])
    ref = torch.stack([reference.paged_decode_attention(
        q[p:p + 1], kc, vc, table[None], torch.tensor([p + 1]), 0.25)[0] for p in range(150)])
    assert torch.allclose(alone, ref, atol=1e-5)
    for a, b in ((0, 150), (0, 7), (7, 99), (149, 150)):
        assert torch.equal(invariant.paged_prefill_attention(q[a:b], kc, vc, table, b, 0.25),
                           alone[a:b]), (a, b)
    batch = invariant.paged_decode_attention(
        torch.stack([q[40], q[3]]), kc, vc, torch.stack([table, table.flip(0)]),
        torch.tensor([41, 190]), 0.25)
    assert torch.equal(batch[0], alone[40])
