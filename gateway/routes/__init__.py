"""The gateway's routes, one module per family: ``ops`` (health, version, readiness,
metrics), ``debug`` (config, replicas, bench-run tokens), ``store`` (the store's admin endpoints),
``models`` (model cards, the tokenizer), ``api`` (the OpenAI API and vLLM's tokenizer
endpoints). Handlers reach the running gateway (``gateway.runtime.Gateway``) through
``request.app.state.gw``."""

from __future__ import annotations

from fastapi import Request

from gateway.runtime import Gateway


def gw(request: Request) -> Gateway:
    return request.app.state.gw
