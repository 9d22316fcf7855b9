"""A tenant's rules for a request to an external backend, before it is forwarded.

The body goes to the backend as the client sent it (``gateway.upstream``), so the bundled
path's schema cannot check it (it would refuse vendor fields); the fields the tenant's limits
and the gateway's bounds are about are checked here, named as the bundled path names them: the
sample count, stop strings, logit bias, logprobs, metadata, the priority against the tenant's
``min_priority``, ``max_tokens`` against the
tenant's ``max_output_tokens`` (filled in when absent), the prompt against its
``max_prompt_tokens``, and prompt + output tokens charged to its tokens-per-minute bucket
(corrected from the upstream's own ``usage`` when the answer ends).

The prompt is counted with the gateway's tokenizer: the backend's model may split text
differently, so for another model it is an estimate (the bucket is corrected from ``usage``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import MAX_TOP_LOGPROBS
from gateway.errors import APIError, bad_request
from gateway.limits import RequestLimits, check_stops
from gateway.schemas import _check_metadata
from gateway.tenants import Tenant, TenantRegistry

MAX_N = 16  # the bundled path's bound (gateway.schemas)


@dataclass
class Charge:
    """What a backend request was charged at admission (tokens per minute)."""

    tokens: int = 0


def _int(value, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _check_fields(data: dict, limits: RequestLimits, tenant: Tenant) -> None:
    n = data.get("n", 1)
    if n is not None and not _int(n, 1, MAX_N):
        raise bad_request(f"n must be an integer in [1, {MAX_N}]", "n")
    stop = data.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    check_stops(stops, limits)
    bias = data.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or len(bias) > limits.max_logit_bias):
        raise bad_request(f"logit_bias must be an object of at most {limits.max_logit_bias} "
                          "entries", "logit_bias")
    for name in ("top_logprobs", "prompt_logprobs") + (
            ("logprobs",) if not isinstance(data.get("logprobs"), bool) else ()):
        value = data.get(name)
        if value is not None and not _int(value, 0, MAX_TOP_LOGPROBS):
            raise bad_request(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}]", name)
    if isinstance(data.get("priority"), int):
        tenant.check_priority(data["priority"])
    metadata = data.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise bad_request("metadata must be an object of string values", "metadata")
        try:
            _check_metadata(metadata)
        except ValueError as exc:
            raise bad_request(f"metadata: {exc}", "metadata") from None
    for name in ("user", "safety_identifier"):
        value = data.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > 256):
            raise bad_request(f"{name} must be a string of at most 256 characters", name)


def _prompt_text(data: dict) -> tuple[list[str], int, str]:
    """(texts to count, token ids given as such, the field's name)."""
    if "messages" in data:
        texts = []
        for m in data["messages"] if isinstance(data["messages"], list) else []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [p["text"] for p in content
                          if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return texts, 0, "messages"
    prompt = data.get("prompt", data.get("input"))
    items = prompt if isinstance(prompt, list) else [prompt]
    if items and all(isinstance(t, int) for t in items):  # one prompt as token ids
        return [], len(items), "prompt"
    texts = [t for t in items if isinstance(t, str)]
    ids = sum(len(t) for t in items if isinstance(t, list))  # a batch of token-id prompts
    return texts, ids, "prompt"


async def admit(data: dict, tenant: Tenant, registry: TenantRegistry, limits: RequestLimits,
                encode) -> tuple[dict, Charge]:
    """``data`` as it may be forwarded (``max_tokens`` filled in from the tenant's limit when
    absent) and what it was charged; a 400 or 429 as the bundled path gives them otherwise.
    ``encode(text)``: the gateway's tokenizer (awaited: a long text is tokenized off the event
    loop)."""
    _check_fields(data, limits, tenant)
    key = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
    max_tokens = data.get(key)
    if max_tokens is not None and not _int(max_tokens, 0, 2**31 - 1):
        raise bad_request(f"{key} must be a non-negative integer", key)
    if max_tokens is None and tenant.max_output_tokens is not None:
        data = {**data, "max_tokens": tenant.max_output_tokens}
        max_tokens = tenant.max_output_tokens
    if (max_tokens is not None and tenant.max_output_tokens is not None
            and max_tokens > tenant.max_output_tokens):
        raise APIError(400, f"{key} {max_tokens} exceeds tenant {tenant.name!r}'s limit of "
                       f"{tenant.max_output_tokens}", param=key)
    texts, ids, field_name = _prompt_text(data)
    prompt = ids
    for text in texts:
        prompt += len(await encode(text))
    if tenant.max_prompt_tokens is not None and prompt > tenant.max_prompt_tokens:
        raise APIError(400, f"prompt has {prompt} tokens; tenant {tenant.name!r} allows "
                       f"{tenant.max_prompt_tokens}", param=field_name)
    samples = data.get("n") or 1
    output = (max_tokens or 0) * samples
    registry.admit_tokens(tenant, prompt, output)
    return data, Charge(prompt + output)


def settle(charge: Charge, used: int | None, tenant: Tenant,
           registry: TenantRegistry) -> None:
    """The answer ended: ``used`` tokens by the upstream's own ``usage`` (prompt +
    completion), 0 when nothing was produced, None when it produced something but said nothing
    (the admission charge then stands). What was charged and not used comes back; what was
    used past it is charged now (the bucket may go below zero: later requests wait)."""
    if used is None or tenant.token_bucket is None:
        return
    if used < charge.tokens:
        registry.give_back_tokens(tenant, charge.tokens - used)
    else:
        tenant.token_bucket.charge(used - charge.tokens)
