"""Request limits checked at the gateway's edge, each a 400 naming its field
(docs/guides/security.md).

They bound the work one request can put on the gateway's event loop and on a replica: stop
strings are matched on the event loop for every token, logit_bias, stop_token_ids and
allowed_token_ids are applied at every engine step (and kept in the record), a JSON schema is
compiled into a grammar, and a deeply nested body would exhaust Python's recursion limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.errors import bad_request


@dataclass(frozen=True)
class RequestLimits:
    max_messages: int = 2048  # chat messages per request
    max_stop_strings: int = 16  # `stop` entries
    max_stop_chars: int = 256  # characters per stop string
    max_logit_bias: int = 1024  # logit_bias entries
    max_stop_token_ids: int = 1024  # stop_token_ids entries
    max_allowed_token_ids: int = 4096  # allowed_token_ids entries
    max_json_depth: int = 64  # nesting of the request body
    max_schema_bytes: int = 64 * 1024  # response_format's JSON schema, serialised
    max_batch_prompts: int = 64  # prompts of a /v1/completions batch, and prompts x n


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def check_body(data: object, raw: bytes, limits: RequestLimits) -> None:
    """The parsed body nests at most ``max_json_depth`` deep and holds no lone UTF-16 surrogate
    (JSON can spell one as an escape; the tokenizer cannot take it)."""
    stack = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > limits.max_json_depth:
            raise bad_request(f"request body nests deeper than {limits.max_json_depth} levels")
        if isinstance(obj, dict):
            stack.extend((v, depth + 1) for v in obj.values() if isinstance(v, dict | list))
        elif isinstance(obj, list):
            stack.extend((v, depth + 1) for v in obj if isinstance(v, dict | list))
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then walk the strings
        _check_strings(data)


def _check_strings(obj: object, path: str = "") -> None:
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"{path or 'body'}: string holds a lone UTF-16 surrogate, which "
                              "is not valid Unicode text", path or None) from None
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_strings(k, path)
            _check_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_strings(v, f"{path}.{i}")


def check_stops(stop: list[str], limits: RequestLimits) -> None:
    """How many stop strings, and how long (they are matched on the event loop every token)."""
    if len(stop) > limits.max_stop_strings:
        raise bad_request(f"{len(stop)} stop strings; at most {limits.max_stop_strings} are "
                          "accepted", "stop")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise bad_request(f"a stop string is longer than {limits.max_stop_chars} characters",
                          "stop")


def check_counts(req, limits: RequestLimits) -> None:
    """Sizes of the parsed request's lists and maps."""
    messages = getattr(req, "messages", None)
    if messages is not None and len(messages) > limits.max_messages:
        raise bad_request(f"{len(messages)} messages; at most {limits.max_messages} are "
                          "accepted", "messages")
    check_stops([req.stop] if isinstance(req.stop, str) else (req.stop or []), limits)
    if req.logit_bias and len(req.logit_bias) > limits.max_logit_bias:
        raise bad_request(f"{len(req.logit_bias)} logit_bias entries; at most "
                          f"{limits.max_logit_bias} are accepted", "logit_bias")
    if req.stop_token_ids and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise bad_request(f"{len(req.stop_token_ids)} stop_token_ids; at most "
                          f"{limits.max_stop_token_ids} are accepted", "stop_token_ids")
    prompts = req.prompts() if hasattr(req, "prompts") else ()
    if len(prompts) > 1 and len(prompts) * req.n > limits.max_batch_prompts:
        raise bad_request(f"a batch of {len(prompts)} prompts x n={req.n} is "
                          f"{len(prompts) * req.n} sequences; at most "
                          f"{limits.max_batch_prompts} are accepted", "prompt")
    allowed = getattr(req, "allowed_token_ids", None)
    if allowed and len(allowed) > limits.max_allowed_token_ids:
        raise bad_request(f"{len(allowed)} allowed_token_ids; at most "
                          f"{limits.max_allowed_token_ids} are accepted", "allowed_token_ids")
