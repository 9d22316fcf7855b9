"""Tailscope: observability-first LLM inference gateway and debugging platform."""

__version__ = "0.1.0"
