"""Model cards (OpenAI's ``/v1/models``) and the bundled model's tokenizer (vLLM's
``/tokenizer_info``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.routes import gw
from gateway.runtime import Gateway
from gateway.schemas import TokenizerInfoResponse

router = APIRouter()


def model_card(g: Gateway, name: str) -> dict:
    """OpenAI's card (``created``: when this gateway started, as vLLM's); the bundled model's
    also has vLLM's ``max_model_len`` (clients size prompts by it)."""
    card = {"id": name, "object": "model", "created": g.started, "owned_by": "tailscope"}
    if name == g.config.served_model_name and g.pool.max_model_len:
        card["max_model_len"] = g.pool.max_model_len
    return card


@router.get("/v1/models")
async def models(request: Request) -> dict:
    g = gw(request)
    return {"object": "list", "data": [model_card(g, n) for n in g.service.served_models()]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> dict:
    """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``): one model's card,
    or 404 ``model_not_found`` (a name may hold slashes: ``org/name``)."""
    g = gw(request)
    if model not in g.service.served_models():
        raise g.service.model_not_found(model)
    return model_card(g, model)


@router.get("/tokenizer_info", response_model=TokenizerInfoResponse, tags=["Utility"])
async def tokenizer_info(request: Request) -> dict:
    """The bundled model's tokenizer: special tokens and chat template (vLLM's shape)."""
    g = gw(request)
    g.registry.authenticate(request.headers.get("authorization"))
    tokenizer = g.tokenizer
    tok = tokenizer.tokenizer

    def text(token_id: int | None) -> str | None:
        return tok.id_to_token(token_id) if token_id is not None else None

    return {"tokenizer_class": "tokenizers.Tokenizer", "bos_token": text(
        tokenizer.bos_token_id), "eos_token": text(tokenizer.eos_token_id),
        "pad_token": None, "chat_template": tokenizer.chat_template.source
        if tokenizer.chat_template else None, "model_max_length": g.pool.max_model_len,
        "vocab_size": tokenizer.vocab_size, "revision": tokenizer.revision or ""}
