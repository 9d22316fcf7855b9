"""The paged, chunked, continuously batched engine computes exactly what a plain forward does."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, RequestState, SamplingParams
from tests.engine.helpers import reference_greedy, run_staggered


def test_tiny_engine_matches_full_recompute_under_chunking_and_kv_pressure(tiny_model):
    g = torch.Generator().manual_seed(7)
    lengths = [5, 37, 12, 61, 3, 22, 9, 44, 17, 1]
    prompts = [torch.randint(3, tiny_model.config.vocab_size, (n,), generator=g).tolist()
               for n in lengths]
    # Chunk (16) < longest prompt (61); 30 blocks of 4 = 120 tokens cannot hold everyone.
    config = EngineConfig(block_size=4, num_kv_blocks=30, max_batched_tokens=16,
                          max_num_seqs=4, dtype="float64")
    engine = Engine(tiny_model, config)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    reqs, waited = run_staggered(engine, prompts, params, every=2)
    assert waited, "the KV pool was meant to be small enough that requests wait for blocks"
    assert max(s.prefill_tokens + s.decode_tokens for s in engine.observer.steps) <= 16
    assert any(s.prefill_tokens and s.decode_tokens for s in engine.observer.steps), \
        "expected mixed prefill+decode ticks"
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.state == RequestState.FINISHED and req.finish_reason == "length"
        assert req.output_token_ids == reference_greedy(tiny_model, prompt, 10)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert engine.kv.reserved_total == 0


@pytest.mark.bundled
def test_bundled_engine_matches_full_recompute(bundled_model, bundled_tokenizer):
    texts = [
        "Once upon a time",
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Water boils at a temperature of",
        "List three colours: red,",
        "In 1969, the first humans landed on the Moon. The mission was called",
        "Translate to French: 'Good morning, my friend.' ->",
        "The quick brown fox jumps over the lazy dog. " * 6 + "Summary:",
    ]
    prompts = [bundled_tokenizer.encode(t) for t in texts]
    assert max(map(len, prompts)) > 32 > min(map(len, prompts))
    # 32-token chunks, and 24 blocks of 8 tokens: fewer than the 8 requests need together.
    config = EngineConfig(block_size=8, num_kv_blocks=24, max_batched_tokens=32,
                          max_num_seqs=8)
    engine = Engine(bundled_model, config)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reqs, waited = run_staggered(engine, prompts, params, every=1)
    assert waited
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.state == RequestState.FINISHED
        assert req.output_token_ids == reference_greedy(bundled_model, prompt, 12), \
            bundled_tokenizer.decode(prompt)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
