"""Step membership (``StepStats.members``) and the step index on every output: who ran in each
step with how many tokens, so a request's inter-token gaps join the exact steps inside them."""

from __future__ import annotations

from collections import defaultdict

from engine import Engine, EngineConfig, SamplingParams


def test_members_add_up_to_each_step_and_every_token_names_a_step_it_ran_in(tiny49k):
    engine = Engine(tiny49k, EngineConfig(num_kv_blocks=64, block_size=16, max_batched_tokens=24,
                                        prefix_caching=False))
    prompts = {f"r{i}": list(range(10 + i, 10 + i + n)) for i, n in enumerate((40, 7, 25, 3))}
    out_tokens = {"r0": 5, "r1": 9, "r2": 4, "r3": 12}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=out_tokens[rid], ignore_eos=True))
    token_steps: dict[str, list[int]] = defaultdict(list)
    while engine.has_unfinished():
        for o in engine.step():
            token_steps[o.request_id] += [o.step] * len(o.new_token_ids)
    steps = list(engine.observer.steps)
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    prefilled: dict[str, int] = defaultdict(int)
    decoded: dict[str, int] = defaultdict(int)
    ran_in: dict[str, set[int]] = defaultdict(set)
    for s in steps:
        assert len(s.members) == s.num_seqs
        assert sum(m.prefill_tokens for m in s.members) == s.prefill_tokens <= 24
        assert sum(m.decode_tokens for m in s.members) == s.decode_tokens
        for m in s.members:
            prefilled[m.request_id] += m.prefill_tokens
            decoded[m.request_id] += m.decode_tokens
            ran_in[m.request_id].add(s.step)
    for rid, p in prompts.items():
        # the prompt is prefilled exactly once, in chunks; every later token is a decode step
        assert prefilled[rid] == len(p)
        assert decoded[rid] == out_tokens[rid] - 1
        assert len(token_steps[rid]) == out_tokens[rid]
        assert token_steps[rid] == sorted(token_steps[rid])  # one token per step, in order
        assert set(token_steps[rid]) <= ran_in[rid]
    assert any(len(s.members) > 1 and s.prefill_tokens and s.decode_tokens for s in steps)
