from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run on CPU tensors in Triton's interpreter (must be set before triton loads)
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Gateways and replicas the tests start run the exact profile (float32, native weights): tests
# of the gateway compare tokens bitwise with in-process engines. The product's default, fast,
# has tests of its own (tests/engine/test_profiles.py), which lift this.
os.environ.setdefault("TAILSCOPE_PROFILE", "exact")


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny random Llama in float64, so chunking/batching cannot flip a greedy argmax
    through rounding: any token mismatch is a real bug."""
    from engine import load_model

    return load_model("tiny", dtype="float64")


@pytest.fixture(scope="session")
def tiny49k():
    """The tiny random Llama (float32) with the bundled tokenizer's vocabulary, for tests that
    drive the real text side (tokenizer, chat template, grammars) over a fast engine."""
    from engine import load_model

    return load_model("tiny:49152", dtype="float32")


@pytest.fixture(scope="session")
def bundled_path():
    from engine import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def bundled_model(bundled_path):
    from engine import load_model

    return load_model(bundled_path, dtype="float32")


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_path):
    from engine.text import load_tokenizer

    return load_tokenizer(bundled_path)


@pytest.fixture(scope="session")
def hf_gguf_model(bundled_path):
    """transformers' own implementation loading the same GGUF: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(bundled_path.parent), gguf_file=bundled_path.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """One embedded store for the whole session: chDB allows one directory per process."""
    from tracing.store import Store

    s = Store(f"chdb://{tmp_path_factory.mktemp('chdb') / 'store'}")
    s.migrate()
    yield s
    s.close()
