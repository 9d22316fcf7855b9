"""The published OpenAPI document, fuzzed with schemathesis against a live gateway (tiny model,
real HTTP): every documented operation answers without a server error, and every 4xx body has
OpenAI's error shape. The example count and the generation are fixed (hypothesis derandomized),
so a CI run is repeatable."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from tests.gateway.conftest import start_server, stop_server

EXAMPLES = 25  # per operation


@pytest.fixture(scope="module")
def live(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--max-model-len", "256")
    yield server
    stop_server(server)


def test_the_document_describes_every_api_endpoint_with_its_models(live):
    doc = httpx.get(f"{live.url}/openapi.json").json()
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize",
                 "/detokenize", "/v1/models", "/debug/query", "/debug/requests/{trace_id}",
                 "/debug/replicas", "/debug/config"):
        assert path in paths, path
    chat = paths["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"messages", "tools", "tool_choice", "logprobs", "response_format"} <= set(
        body["properties"])
    assert body.get("additionalProperties") is False  # the unknown-field rule, published
    assert "400" in chat["responses"] and "text/event-stream" in \
        chat["responses"]["200"]["content"]
    assert httpx.get(f"{live.url}/docs").status_code == 200


def openai_error_shape(ctx, response, case):
    """A 4xx or 5xx body is {"error": {"message": str, "type": str, ...}}."""
    if response.status_code < 400:
        return None
    body = response.json()
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and isinstance(err.get("message"), str) \
        and isinstance(err.get("type"), str), f"not an OpenAI error body: {body!r}"
    return True


def test_fuzz_every_operation_no_server_error_and_openai_shaped_errors(live):
    from hypothesis import given
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    failures: list[str] = []
    seen: list[tuple[str, int]] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14

    def fuzz(operation) -> None:
        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case):
            response = case.call(base_url=live.url, timeout=60)
            seen.append((operation.path, response.status_code))
            try:
                case.validate_response(response, checks=[not_a_server_error,
                                                         openai_error_shape])
            except Exception as exc:  # collected: one report for every operation
                failures.append(f"{operation.method.upper()} {operation.path}: "
                                f"{response.status_code} {response.text[:300]} ({exc})")
        run()

    for operation in operations:
        fuzz(operation)
    assert not failures, "\n".join(failures[:10])
    # the fuzz reached the engine (the documented model names are served), not only the gate
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"):
        assert (path, 200) in seen, sorted(set(seen))
