"""Prompt logprobs (``SamplingParams.prompt_logprobs``, behind ``echo`` with ``logprobs``): each
prompt token's log-probability under the raw model distribution, equal to a dense forward of the
whole prompt, however the prompt was chunked, and never taken from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams


def reference(tiny49k, prompt: list[int], k: int):
    with torch.no_grad():
        logp = torch.log_softmax(tiny49k.dense_forward(torch.tensor(prompt)).float(), -1)
    chosen = [float(logp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    top = torch.topk(logp[:-1], k, dim=-1).indices.tolist() if k else None
    return chosen, top


@pytest.mark.parametrize("budget", [512, 16])  # one chunk; 16-token chunks
def test_prompt_logprobs_equal_a_dense_forward_however_chunked(tiny49k, budget):
    prompt = [(7 * i + 3) % 4000 + 10 for i in range(45)]
    engine = Engine(tiny49k, EngineConfig(num_kv_blocks=64, block_size=16,
                                        max_batched_tokens=budget))
    got = []
    engine.add_request("s", prompt, SamplingParams(max_tokens=2, prompt_logprobs=3))
    engine.add_request("other", prompt[:20], SamplingParams(max_tokens=3))  # shares the steps
    while engine.has_unfinished():
        got += [o for o in engine.step() if o.request_id == "s" and o.prompt_logprobs]
    assert len(got) == 1  # once, with the first token
    lps = got[0].prompt_logprobs
    chosen, top = reference(tiny49k, prompt, 3)
    assert len(lps) == len(prompt) and lps[0] is None
    assert [lp.token_id for lp in lps[1:]] == prompt[1:]
    assert [lp.logprob for lp in lps[1:]] == pytest.approx(chosen, abs=1e-4)
    assert [[i for i, _ in lp.top] for lp in lps[1:]] == top


def test_a_scoring_request_skips_the_prefix_cache_and_others_still_use_it(tiny49k):
    prompt = list(range(100, 148))
    engine = Engine(tiny49k, EngineConfig(num_kv_blocks=64, block_size=16))
    engine.generate([prompt], SamplingParams(max_tokens=1))  # its blocks are cached now
    scored = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0 and len(scored.prompt_logprobs) == len(prompt)
    assert all(lp.top == () for lp in scored.prompt_logprobs[1:])
    plain = engine.generate([prompt], SamplingParams(max_tokens=1))[0]
    assert plain.num_cached_tokens >= 32  # the cache still serves requests that do not score


def test_prompt_logprobs_out_of_range_are_refused():
    from engine.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
