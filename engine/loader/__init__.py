"""Model loaders: GGUF files, HF directories, and the tiny random test model."""

from engine.loader.errors import UnsupportedModelError
from engine.loader.paths import default_model_path, load_configured, load_model

__all__ = ["UnsupportedModelError", "default_model_path", "load_configured", "load_model"]
