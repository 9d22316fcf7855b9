"""The bundled model against transformers loading the same GGUF: logits and token ids."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.bundled

# Both sides dequantize the same Q4_1/Q8_0 blocks to float32; what differs is kernel order
# of floating-point sums, so logits agree to ~1e-4 relative to their spread.
LOGIT_ATOL = 2e-3

PROMPTS = [
    "Once upon a time",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef softmax(x):\n    \"\"\"Numerically stable softmax.\"\"\"\n",
]


@pytest.mark.parametrize("text", PROMPTS)
def test_logits_match_transformers(text, bundled_model, bundled_tokenizer, hf_gguf_model):
    ids = bundled_tokenizer.encode(text)
    ours = bundled_model.dense_forward(torch.tensor(ids))
    with torch.no_grad():
        theirs = hf_gguf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape == (len(ids), 49152)
    diff = (ours - theirs).abs().max().item()
    assert diff < LOGIT_ATOL, f"max |logit diff| {diff}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_paged_engine_logits_match_transformers(bundled_model, bundled_tokenizer,
                                                hf_gguf_model):
    """The first generated token's logits, computed through the paged chunked path."""
    from engine.model import AttentionMetadata, PrefillSeq

    ids = bundled_tokenizer.encode(PROMPTS[2])
    n, bs = len(ids), 4
    blocks = list(range(7, 7 + -(-n // bs)))[::-1]  # scattered, reversed physical blocks
    c = bundled_model.config
    shape = (64, bs, c.num_kv_heads, c.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]
    table = torch.tensor(blocks)
    half = n // 2
    for start, end in ((0, half), (half, n)):
        pos = torch.arange(start, end)
        slots = table[pos // bs] * bs + pos % bs
        meta = AttentionMetadata(slot_mapping=slots,
                                 prefills=[PrefillSeq(0, end - start, end, table)])
        logits = bundled_model.forward(torch.tensor(ids[start:end]), pos, meta, caches,
                                       torch.tensor([end - start - 1]))
    with torch.no_grad():
        theirs = hf_gguf_model(torch.tensor([ids])).logits[0, -1].float()
    assert (logits[0] - theirs).abs().max().item() < LOGIT_ATOL


TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\r\n",
    "Unicode: naïve café, Zürich, 東京, Москва, 🤖🚀, ﬁ ligature",
    "Numbers 1234567890 and 3.14159, 1e-9, 0x1F",
    "def f(x: int) -> list[int]:\n    return [i ** 2 for i in range(x)]  # squares\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|>text after a special token<|im_end|>",
    "",
]


def test_token_ids_equal_transformers_tokenizer(bundled_path, bundled_tokenizer):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(bundled_path.parent), gguf_file=bundled_path.name)
    for text in TEXTS:
        ours = bundled_tokenizer.encode(text)
        assert ours == ref.encode(text), text
        assert bundled_tokenizer.decode(ours) == ref.decode(ours)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert bundled_tokenizer.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("partial", ["The capital of France is", "The capital is ", " Paris\n"])
def test_continue_final_message_renders_as_transformers_does(bundled_path, bundled_tokenizer,
                                                              partial):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(bundled_path.parent), gguf_file=bundled_path.name)
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": partial}]
    ours = bundled_tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                 continue_final_message=True)
    assert ours == ref.apply_chat_template(messages, tokenize=False,
                                           continue_final_message=True)
    assert ours.rstrip().endswith(partial.strip())  # open: no end-of-turn after it


def test_chat_template_variables_and_refusals():
    from engine.text.chat_template import ChatTemplate

    t = ChatTemplate("{% if not enable_thinking %}/no_think {% endif %}"
                     "{% for m in messages %}{% if m.role == 'system' %}"
                     "{{ raise_exception('System role not supported') }}{% endif %}"
                     "{{ m.content }}|{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render(msgs, enable_thinking=True) == "hi|"
    assert t.render(msgs, enable_thinking=False) == "/no_think hi|"
    with pytest.raises(ValueError, match="System role not supported"):  # a 400, not a 500
        t.render([{"role": "system", "content": "x"}, *msgs])
    with pytest.raises(ValueError, match="bos_token"):
        t.render(msgs, bos_token="<x>")
    with pytest.raises(ValueError, match="cannot both be true"):
        t.render(msgs, add_generation_prompt=True, continue_final_message=True)


@pytest.mark.parametrize("weights", ["native", "int4"])
def test_cli_generate_chat_answers_paris(weights):
    env = {**os.environ, "TAILSCOPE_KV_CACHE_MB": "64", "TAILSCOPE_WEIGHTS": weights}
    out = subprocess.run(
        [sys.executable, "-m", "tailscope.cli", "generate", "--chat",
         "What is the capital of France?", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    )
    assert "Paris" in out.stdout
    assert "TTFT" in out.stderr and "tok/s" in out.stderr


def test_cli_generate_on_the_fast_profile_answers_eagerly_without_building(tmp_path):
    """A one-shot command never starts the compiled step's minutes-long build: it answers on
    the eager step and says so (a replica builds it; generate then loads that build)."""
    env = {**os.environ, "TAILSCOPE_KV_CACHE_MB": "64", "TAILSCOPE_PROFILE": "fast",
           "TAILSCOPE_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "tailscope.cli", "generate", "--chat",
         "What is the capital of France?", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    )
    assert "Paris" in out.stdout
    from engine.config import BF16_FLAGS, cpu_flags

    if cpu_flags() & BF16_FLAGS:  # the fast profile compiles only where bf16 is native
        assert "compile off: not built yet" in out.stderr
    assert not (tmp_path / "aot").exists() or not any((tmp_path / "aot").iterdir())
