"""The OpenAI-compatible gateway in front of engine replica processes."""

__version__ = "0.1.0"
