"""Sampling pipeline semantics (the sampler's exact supports), statistics, seeding."""

from __future__ import annotations

import math

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.request import Request
from engine.sampler import Sampler, apply_penalties, filter_probs
from engine.sampling_params import SamplingParamsError


def req(params: SamplingParams, prompt=(1,), output=(), rid="x") -> Request:
    r = Request(rid, list(prompt), params)
    r.output_token_ids = list(output)
    return r


def support(probs: list[float], **kw) -> set[int]:
    z = torch.log(torch.tensor([probs]))
    p = filter_probs(z, [req(SamplingParams(temperature=1.0, **kw))])[0]
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-5)
    return {i for i, v in enumerate(p.tolist()) if v > 0}


def test_greedy_tie_goes_to_lowest_index_and_never_divides():
    logits = torch.tensor([[0.0, 3.0, 3.0, 0.0, 3.0]])
    out = Sampler().sample(logits, [req(SamplingParams(temperature=0.0))])
    assert out.token_ids == [1]
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(temperature=-0.5)
    assert err.value.param == "temperature"


class FakeGrammarAllowingOnly:
    """A fault-free stand-in for a compiled grammar (named fake): allows the given tokens."""

    def __init__(self, *tokens: int) -> None:
        self.tokens = tokens

    def allowed_tokens(self, vocab: int) -> torch.Tensor:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[list(self.tokens)] = True
        return mask


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_tokens_until_reached(temperature):
    eos, stop = 2, 4
    logits = torch.tensor([[0.0, 1.0, 50.0, 0.0, 40.0]])  # EOS, then the stop token, lead
    sampler = Sampler(eos_ids=(eos,))
    p = SamplingParams(temperature=temperature, max_tokens=8, min_tokens=2,
                       stop_token_ids=(stop,), seed=1)
    assert sampler.sample(logits.clone(), [req(p, output=[1])]).token_ids == [1]
    assert sampler.sample(logits.clone(), [req(p, output=[1, 1])]).token_ids == [eos]
    # ignore_eos: EOS does not end the request, so it is not held off; the stop token is
    p2 = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2, stop_token_ids=(stop,),
                        ignore_eos=True)
    assert sampler.sample(logits.clone(), [req(p2)]).token_ids == [eos]
    # a grammar that allows only EOS (its JSON is complete) keeps it: the output stays valid
    grammar = req(p, output=[1])
    grammar.constraint = FakeGrammarAllowingOnly(eos)
    assert sampler.sample(logits.clone(), [grammar]).token_ids == [eos]
    grammar.constraint = FakeGrammarAllowingOnly(eos, 3)
    assert sampler.sample(logits.clone(), [grammar]).token_ids == [3]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_leave_mass_to_those_tokens_only(temperature):
    logits = torch.tensor([[9.0, 1.0, 5.0, 0.5, 8.0]])
    sampler = Sampler(eos_ids=(2,))
    p = SamplingParams(temperature=temperature, allowed_token_ids=(1, 3), seed=2)
    drawn = {sampler.sample(logits.clone(), [req(p, rid=f"a{i}")]).token_ids[0]
             for i in range(20)}
    assert drawn <= {1, 3} and (temperature > 0 or drawn == {1})
    # min_tokens cannot take away the only allowed token (EOS): the row keeps its mass
    only_eos = SamplingParams(allowed_token_ids=(2,), min_tokens=3, max_tokens=4)
    assert sampler.sample(logits.clone(), [req(only_eos)]).token_ids == [2]
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(allowed_token_ids=())
    assert err.value.param == "allowed_token_ids"
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(allowed_token_ids=(7,)).check_vocab(5)
    assert err.value.param == "allowed_token_ids"


def test_top_p_keeps_smallest_prefix_reaching_p_with_boundary():
    assert support([0.4, 0.3, 0.2, 0.1], top_p=0.65) == {0, 1}
    assert support([0.4, 0.3, 0.2, 0.1], top_p=0.7) == {0, 1}
    assert support([0.4, 0.3, 0.2, 0.1], top_p=0.71) == {0, 1, 2}


def test_top_k_then_top_p_differs_from_top_p_then_top_k():
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]
    assert support(probs, top_k=3, top_p=0.8) == {0, 1}  # the pipeline's order
    z = torch.log(torch.tensor([probs]))
    after_p = filter_probs(z, [req(SamplingParams(temperature=1.0, top_p=0.8))])
    after_pk = filter_probs(torch.log(after_p), [req(SamplingParams(temperature=1.0, top_k=3))])
    assert {i for i, v in enumerate(after_pk[0].tolist()) if v > 0} == {0, 1, 2}


def test_top_k_ties_at_the_kth_place_go_to_lower_ids():
    assert support([0.3, 0.2, 0.2, 0.2, 0.1], top_k=2) == {0, 1}
    assert support([0.1, 0.2, 0.2, 0.3, 0.2], top_k=3) == {1, 2, 3}


def test_min_p_keeps_argmax_and_support_grows_as_min_p_falls():
    probs = [0.05, 0.4, 0.25, 0.15, 0.1, 0.05]
    previous: set[int] = set()
    for min_p in (1.0, 0.6, 0.3, 0.2, 0.1, 0.0):
        s = support(probs, min_p=min_p)
        assert 1 in s and previous <= s
        previous = s
    assert support(probs, min_p=1.0) == {1}
    assert support(probs, min_p=0.0) == set(range(6))


def test_min_p_support_changes_with_temperature():
    z = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    for t, expected in ((1.0, {0, 1}), (3.0, {0, 1, 2})):
        p = filter_probs(z / t, [req(SamplingParams(temperature=t, min_p=0.4))])[0]
        assert {i for i, v in enumerate(p.tolist()) if v > 0} == expected


def test_typical_p_can_exclude_the_most_likely_token():
    assert support([0.02, 0.35, 0.33, 0.30], typical_p=0.63) == {2, 3}


@pytest.mark.parametrize("kw", [dict(top_p=0.65), dict(top_k=2, top_p=0.9), dict(min_p=0.3),
                                dict(typical_p=0.63), dict(top_k=3, min_p=0.1, top_p=0.95)])
def test_adding_a_constant_to_all_logits_changes_no_support(kw):
    z = torch.log(torch.tensor([[0.02, 0.35, 0.33, 0.2, 0.1]]))
    params = SamplingParams(temperature=0.7, **kw)
    a = filter_probs(z / 0.7, [req(params)])
    b = filter_probs((z + 12.5) / 0.7, [req(params)])
    assert torch.equal(a > 0, b > 0)
    torch.testing.assert_close(a, b)


def test_sampled_frequencies_match_filtered_distribution():
    logits = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01]))
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, min_p=0.05, seed=1234)
    r = req(params)
    expected = filter_probs(logits[None] / 0.9, [r])[0]
    sampler, n = Sampler(), 20000
    counts = torch.zeros(8)
    for _ in range(n):
        counts[sampler.sample(logits[None].clone(), [r]).token_ids[0]] += 1
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was drawn"
    chi2 = float(((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept])).sum())
    # df = support size - 1 (4 here): the 0.999 quantile of chi-square(4) is 18.47.
    assert int(kept.sum()) == 5
    assert chi2 < 18.47, chi2


def test_penalties_are_sign_aware_and_count_the_documented_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    # token 0 in the prompt, token 1 generated once, token 3 generated twice
    r = req(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1, 3, 3))
    z = logits.clone()
    apply_penalties(z, [r])
    assert z.tolist() == [[1.0, -4.0, 1.0, 0.25, 3.0]]
    r = req(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=(0,),
            output=(1, 3, 3))
    z = logits.clone()
    apply_penalties(z, [r])  # prompt token 0 is not penalised by frequency/presence
    assert z.tolist() == [[2.0, -2.75, 1.0, -0.75, 3.0]]


def test_logit_bias_and_logprobs():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    params = SamplingParams(logit_bias={0: 5.0, 2: -100.0}, logprobs=True, top_logprobs=2)
    out = Sampler().sample(logits.clone(), [req(params)])
    assert out.token_ids == [0]
    lp = out.logprobs[0]
    expect = torch.log_softmax(torch.tensor([6.0, 2.0, -97.0, 0.0]), -1)
    assert lp.logprob == pytest.approx(float(expect[0]))
    assert [t for t, _ in lp.top] == [0, 1]
    params = SamplingParams(temperature=1.0, top_k=2, logprobs=True, top_logprobs=3, seed=3)
    out = Sampler().sample(logits.clone(), [req(params)])
    lp = out.logprobs[0]
    final = torch.softmax(torch.tensor([2.0, 3.0]), -1)  # top-2 renormalised
    assert out.token_ids[0] in (1, 2)
    assert lp.logprob == pytest.approx(math.log(float(final[out.token_ids[0] - 1])), rel=1e-5)
    assert lp.top[2][1] == float("-inf")  # filtered tokens have no mass


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(typical_p=0.0), "typical_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-3), "presence_penalty"), (dict(max_tokens=0), "max_tokens"),
    (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(top_logprobs=21), "top_logprobs"),
])
def test_invalid_parameters_are_named(kw, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kw)
    assert err.value.param == param and param in str(err.value)


def test_unknown_token_ids_are_rejected_at_admission(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_kv_blocks=16, dtype="float64"))
    r = engine.add_request("b", [5, 6], SamplingParams(logit_bias={100000: 1.0}))
    assert r.finish_reason == "rejected" and "logit_bias" in r.error


def _run(engine: Engine, prompts: dict[str, tuple[list[int], SamplingParams]], order):
    for rid in order:
        engine.add_request(rid, *prompts[rid])
    while engine.has_unfinished():
        engine.step()
    return {rid: engine.get_request(rid).output_token_ids for rid in order}


def test_seeded_requests_are_reproducible_in_any_batch_and_order(tiny_model):
    g = torch.Generator().manual_seed(5)
    prompts = {
        f"r{i}": (torch.randint(3, 500, (int(n),), generator=g).tolist(),
                  SamplingParams(max_tokens=12, temperature=1.1, top_p=0.9, top_k=50,
                                 ignore_eos=True, seed=i if i < 4 else None))
        for i, n in enumerate(torch.randint(2, 30, (7,), generator=g))
    }

    def engine():
        return Engine(tiny_model, EngineConfig(block_size=4, num_kv_blocks=200,
                                               max_batched_tokens=24, dtype="float64"))

    alone = {rid: _run(engine(), prompts, [rid])[rid] for rid in ("r0", "r1", "r2", "r3")}
    together = _run(engine(), prompts, [f"r{i}" for i in range(7)])
    reversed_ = _run(engine(), prompts, [f"r{i}" for i in reversed(range(7))])
    pair = _run(engine(), prompts, ["r5", "r2", "r0"])
    for rid in alone:
        assert together[rid] == alone[rid] == reversed_[rid]
    assert pair["r2"] == alone["r2"] and pair["r0"] == alone["r0"]
    # unseeded requests draw independently: two runs of r4 differ (12 tokens at T=1.1)
    assert _run(engine(), prompts, ["r4"])["r4"] != _run(engine(), prompts, ["r4"])["r4"]


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_k=255), dict(top_p=0.5),
                                dict(top_p=0.9, min_p=0.01), dict(top_k=40, top_p=0.8),
                                dict(top_p=0.999999)])
def test_candidate_fast_path_equals_full_sort(kw):
    from engine.sampler import _candidate_filters, _full_sort_filters, _sorted_filters

    g = torch.Generator().manual_seed(len(str(kw)))
    z = torch.randn(6, 5000, generator=g) * 4
    z[3] = torch.round(z[3])  # heavy ties, including at the candidate boundary
    z[4, :] = 0.0  # all tied: only the full sort can order them
    reqs = [req(SamplingParams(temperature=1.0, **kw), rid=f"r{i}") for i in range(6)]
    full = _full_sort_filters(z, reqs)
    fast, exact = _candidate_filters(z, reqs)
    torch.testing.assert_close(fast[exact], full[exact], rtol=1e-5, atol=1e-7)
    assert not exact[4]  # ties across the candidate edge fall back to the full sort
    torch.testing.assert_close(_sorted_filters(z, reqs), full, rtol=1e-5, atol=1e-7)
    if "top_p" in kw and kw["top_p"] < 0.9 and "top_k" not in kw:
        assert exact[:3].all()  # the fast path is actually taken on ordinary rows


def test_row_probabilities_do_not_depend_on_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(11)
    z = torch.randn(5, 3000, generator=g) * 3
    params = [SamplingParams(temperature=1.0, top_k=10), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=1.0,
                                                                         typical_p=0.9),
              SamplingParams(temperature=1.0, top_k=100, min_p=0.02)]
    reqs = [req(p, rid=f"r{i}") for i, p in enumerate(params)]
    together = filter_probs(z, reqs)
    for i in range(5):
        alone = filter_probs(z[i:i + 1], [reqs[i]])
        assert torch.equal(alone[0], together[i]), params[i]
