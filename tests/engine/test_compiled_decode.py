"""``compile: true``: decode-only steps run the model's ``torch.compile``d step (inductor). The
compiled graphs are made when the engine starts, serve batches of one and of many and contexts
across block boundaries without compiling again, and give the eager engine's tokens."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine import model as model_module
from engine.loader.tiny import TINY_CONFIG, tiny_llama
from engine.model import LlamaModel
from kernels import native, reference

# lengths across the 16-token blocks: contexts grow past one, two and three blocks while decoding
PROMPTS = [[5, 17, 300, 42, 9, 88, 123, 7], [3, 4, 5], list(range(40, 70)),
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
# a context long enough to sit in another length group than PROMPTS' (decode_groups)
LONG = [(7 * i) % 400 + 3 for i in range(900)]


# float32 steps: fused and eager ops round differently in the last bits. int4's packed steps
# (up to 16 rows on our kernel) take their activations as bfloat16, where such a difference
# can flip a rounding: 2^-9 of a value, measured 0.0012 of a logprob on this test's tiny model
LOGPROB_ATOL = {"native": 1e-3, "int4": 4e-3}


class CountingDecode:
    """Counts the calls into the compiled decode step (and passes them on)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls, self.rows = fn, 0, set()

    def __call__(self, input_ids, *rest):
        self.calls += 1
        self.rows.add(int(input_ids.shape[0]))
        return self.fn(input_ids, *rest)


def _engines(weights: str) -> tuple[Engine, Engine]:
    """``int4``: the output matrix too (``RescoredOutput``'s top-k rescoring, traced)."""
    config = dict(weights=weights, output_weights=weights, num_kv_blocks=160, max_num_seqs=24)
    eager = Engine(load_model("tiny", weights=weights, output_weights=weights),
                   EngineConfig(**config))
    compiled = Engine(load_model("tiny", weights=weights, output_weights=weights),
                      EngineConfig(**config, compile=True))
    return eager, compiled


@pytest.mark.parametrize("weights", ["native", "int4"])
def test_compiled_decode_steps_give_the_eager_engines_tokens(weights):
    eager, compiled = _engines(weights)
    assert compiled.runner.compile_s > 0
    counter = CountingDecode(compiled.model._compiled_decode)
    compiled.model._compiled_decode = counter
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    from torch._dynamo.utils import counters

    frames = counters["frames"]["ok"]
    # one at a time (batches of one), then all together (batches of 4: packed rows for int4)
    # and past the packed kernel's rows (the dense copy)
    for batch in ([p] for p in PROMPTS[:2]):
        want, got = eager.generate(batch, params), compiled.generate(batch, params)
        assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    past = getattr(compiled.model.layers[0].qkv, "max_rows", 7) + 1
    batch = [p[i:] + p[:i] for i in range(5) for p in PROMPTS + [p[::-1] for p in PROMPTS]]
    for prompts in (PROMPTS, batch[:past]):
        want, got = eager.generate(prompts, params), compiled.generate(prompts, params)
        assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
        for a, b in zip(got, want, strict=True):
            lp_a = torch.tensor([e.logprob for e in a.output_logprobs])
            lp_b = torch.tensor([e.logprob for e in b.output_logprobs])
            assert torch.allclose(lp_a, lp_b, atol=LOGPROB_ATOL[weights]), \
                (lp_a - lp_b).abs().max()
    # every decode step went through the compiled graphs, and none was compiled mid-serving
    assert counter.calls >= 3 * 23 and {1, 4, past} <= counter.rows
    assert counters["frames"]["ok"] == frames


def test_decodes_of_very_different_lengths_run_eagerly_in_their_groups(monkeypatch):
    """A compiled step masks one batch padded to its longest context; a step whose decodes
    fall into several length groups (``kernels.reference.decode_groups``) runs eagerly
    instead, each group attending only as far as its own longest, with the same tokens."""
    config = dict(num_kv_blocks=160, max_num_seqs=8, max_batched_tokens=2048)
    eager = Engine(load_model("tiny"), EngineConfig(**config))
    compiled = Engine(load_model("tiny"), EngineConfig(**config, compile=True))
    counter = CountingDecode(compiled.model._compiled_decode)
    compiled.model._compiled_decode = counter
    split = []  # decode steps that fell into more than one group
    plan = reference.decode_groups

    def groups(*args):
        out = plan(*args)
        split.append(len(out) > 1)
        return out

    monkeypatch.setattr(model_module.reference, "decode_groups", groups)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [LONG, *PROMPTS[:3]]  # one of 900 tokens beside three of 3-30
    want = eager.generate(prompts, params)
    split.clear()
    got = compiled.generate(prompts, params)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    # the steps where the long one decoded beside short ones ran eagerly; only the long one
    # alone (its last steps) went through the compiled graph
    assert any(split) and counter.rows <= {1}, (split, counter.rows)
    calls = counter.calls
    got = compiled.generate(PROMPTS[:3], params)  # without the long one: compiled again
    assert [r.output_token_ids for r in got] == [
        r.output_token_ids for r in eager.generate(PROMPTS[:3], params)]
    assert counter.calls >= calls + 11 and 3 in counter.rows


def test_each_model_compiles_its_own_graphs_and_guards_only_its_inputs():
    """The compiled step drops dynamo's guards on the model's weights and structure
    (``engine.model._keep_guards``): sound only because each model's step is its own function,
    with a graph cache no other model reaches. A second model of other shapes (another
    vocabulary) in the same process gets graphs of its own and its eager engine's tokens, and
    the first model's steps still run its own graphs (both vocabularies' logits come back)."""
    config = dict(num_kv_blocks=32, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engines = {}
    for model in ("tiny", "tiny:1000"):
        eager = Engine(load_model(model), EngineConfig(**config))
        compiled = Engine(load_model(model), EngineConfig(**config, compile=True))
        engines[model] = (eager, compiled)
    assert engines["tiny"][1].model.config.vocab_size != 1000
    for eager, compiled in engines.values():
        counter = CountingDecode(compiled.model._compiled_decode)
        compiled.model._compiled_decode = counter
        vocab = compiled.model.config.vocab_size
        prompts = [[5, 17, 300 % vocab, 42], [3, 4, 5]]
        for batch in ([prompts[0]], prompts):
            got, want = compiled.generate(batch, params), eager.generate(batch, params)
            assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
        assert counter.calls >= 2 * 5
    # the guards left: the inputs' and one KV tensor's, no weight among them
    from engine.model import _keep_guards

    names = ["input_ids", "self", "self.embed", "self.layers[3].qkv.packed", "kv_caches[0][0]",
             "kv_caches[0][1]", "kv_caches[7][0]", "G['torch']"]
    entries = [SimpleNamespace(name=n) for n in names]  # the one field the filter reads
    assert [n for n, keep in zip(names, _keep_guards(entries), strict=True)
            if keep] == ["input_ids", "kv_caches[0][0]", "G['torch']"]


def test_compile_is_refused_with_batch_invariant():
    with pytest.raises(ValueError, match="compile cannot run batch_invariant"):
        EngineConfig(compile=True, batch_invariant=True)


@pytest.mark.skipif(not native.available(), reason="our native kernels are not built here")
def test_bf16_compiled_steps_attend_through_our_kernel_at_any_mix_of_lengths(monkeypatch):
    """In bfloat16 the compiled graphs are traced through our paged attention
    (``kernels.native``), which walks each sequence's own blocks: a step of decodes as different
    as 900 and 3 tokens runs compiled (no padding to the longest, no groups), with the tokens of
    the eager engine (which attends through the same kernel)."""
    traced = []
    attend = native.paged_decode_attention

    def counting(*args):  # called while dynamo traces the step, not when the graph runs
        traced.append(args[0].shape)
        return attend(*args)

    monkeypatch.setattr(model_module.native, "paged_decode_attention", counting)
    config = dict(dtype="bfloat16", num_kv_blocks=160, max_num_seqs=8, max_batched_tokens=2048)
    # the tiny model with heads of 32 (our kernel takes head sizes of multiples of 32)
    shape = dataclasses.replace(TINY_CONFIG, head_dim=32, name="tiny-llama-d32")
    eager = Engine(LlamaModel(*tiny_llama(shape), torch.bfloat16), EngineConfig(**config))
    compiled = Engine(LlamaModel(*tiny_llama(shape), torch.bfloat16),
                      EngineConfig(**config, compile=True))
    assert compiled.model.native_decode_attention and eager.model.native_decode_attention
    layers = compiled.model.config.num_layers
    assert len(traced) >= 2 * layers  # the graph of one row and the graph of many
    counter = CountingDecode(compiled.model._compiled_decode)
    compiled.model._compiled_decode = counter
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    prompts = [LONG, *PROMPTS[:3]]  # one of 900 tokens beside three of 3-30
    want, got = eager.generate(prompts, params), compiled.generate(prompts, params)
    assert 4 in counter.rows and counter.calls >= 11  # every decode-only step, compiled
    # fused and eager ops round differently in bf16: the logprobs within 0.15 (0.06 seen: bf16
    # activations and a bf16 output matrix) wherever the two agree on every earlier token, and
    # at least three of the four sequences the same throughout
    for a, b in zip(got, want, strict=True):
        for ta, tb, la, lb in zip(a.output_token_ids, b.output_token_ids, a.output_logprobs,
                                  b.output_logprobs, strict=True):
            if ta != tb:
                break
            assert abs(la.logprob - lb.logprob) <= 0.15
    assert sum(a.output_token_ids == b.output_token_ids for a, b in zip(got, want, strict=True)) \
        >= 3
