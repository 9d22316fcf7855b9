"""API keys, rate limits and concurrency per tenant, over real HTTP."""

from __future__ import annotations

import httpx
import pytest

from gateway.tenants import TenantRegistry, TokenBucket
from tests.gateway.conftest import start_server, stop_server

CONFIG = """
[[tenants]]
name = "slow"
keys = ["sk-slow"]
requests_per_minute = 2

[[tenants]]
name = "small"
keys = ["sk-small"]
max_output_tokens = 16

[[tenants]]
name = "fast"
keys = ["sk-fast"]
requests_per_minute = 1000
tokens_per_minute = 200
"""


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, bundled_path):
    cfg = tmp_path_factory.mktemp("cfg") / "tenants.toml"
    cfg.write_text(CONFIG)
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--config", str(cfg))
    yield server
    stop_server(server)


def post(server, key: str | None, **body):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60,
                      json={"model": server.model, "prompt": "Hi", "max_tokens": 2, **body})


def test_missing_and_wrong_keys_get_401(keyed_server):
    for key in (None, "sk-wrong"):
        r = post(keyed_server, key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200  # probes need no key


def test_rate_limit_429_with_retry_after_and_other_tenant_unaffected(keyed_server):
    first, second = post(keyed_server, "sk-slow"), post(keyed_server, "sk-slow")
    assert first.status_code == second.status_code == 200
    # OpenAI's x-ratelimit-* headers: the limit, what is left, when it is full again
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert (first.headers["x-ratelimit-remaining-requests"],
            second.headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert "x-ratelimit-limit-tokens" not in first.headers  # no tokens/min limit
    over = post(keyed_server, "sk-slow")
    assert over.status_code == 429
    assert int(over.headers["Retry-After"]) >= 1
    assert over.json()["error"]["code"] == "rate_limit_exceeded"
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    reset = over.headers["x-ratelimit-reset-requests"]  # two requests' worth: up to a minute
    minutes, _, seconds = reset.removesuffix("s").rpartition("m")
    assert 30 <= 60 * int(minutes or 0) + float(seconds) <= 60, reset
    fast = post(keyed_server, "sk-fast")
    assert fast.status_code == 200 and fast.headers["x-ratelimit-limit-tokens"] == "200"
    assert 0 <= int(fast.headers["x-ratelimit-remaining-tokens"]) < 200
    assert fast.headers["x-ratelimit-limit-requests"] == "1000"
    unlimited = post(keyed_server, "sk-small")
    assert unlimited.status_code == 200
    assert not [h for h in unlimited.headers if h.startswith("x-ratelimit")]


def test_tenant_token_limits(keyed_server):
    r = post(keyed_server, "sk-fast", max_tokens=150)  # prompt + 150 fits in 200 tokens/min
    assert r.status_code == 200
    r = post(keyed_server, "sk-fast", max_tokens=500)  # 500 never fits in 200/min
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert post(keyed_server, "sk-small", max_tokens=16).status_code == 200
    r = post(keyed_server, "sk-small", max_tokens=17)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_unused_tokens_and_slots_are_given_back():
    from gateway.tenants import Tenant

    reg = TenantRegistry([], {})
    t = Tenant("t", tokens_per_minute=200, max_concurrent=1)
    reg.admit_request(t)
    with pytest.raises(Exception, match="in flight"):
        reg.admit_request(t)
    reg.admit_tokens(t, 10, 150)
    assert t.token_bucket.level == pytest.approx(40, abs=1)
    reg.finish(t, unused_tokens=140)
    assert t.active == 0 and t.token_bucket.level == pytest.approx(180, abs=1)


def test_token_bucket_refills_and_refunds():
    bucket = TokenBucket(60)  # one per second
    assert bucket.take(60) == 0
    wait = bucket.take(3)
    assert 1.5 < wait <= 3.0
    bucket.give_back(10)
    assert bucket.take(10) == 0
    assert bucket.take(61) == float("inf")


def test_config_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tenants]]\nname = "x"\nkeys = ["k"]\nrequests_per_hour = 5\n')
    with pytest.raises(ValueError, match="requests_per_hour"):
        TenantRegistry.from_file(bad)
    dup = tmp_path / "dup.toml"
    dup.write_text('[[tenants]]\nname = "a"\nkeys = ["k"]\n[[tenants]]\nname = "b"\n'
                   'keys = ["k"]\n')
    with pytest.raises(ValueError, match="two tenants"):
        TenantRegistry.from_file(dup)


@pytest.mark.parametrize("body,error", [
    ('[limits]\nx = 1\n', r"unknown sections \['limits'\]"),
    ('[degraded_admission]\nqueue_len = 4\n', r"unknown fields \['queue_len'\]"),
    ('[degraded_admission]\nkv_fraction = 1.5\n', "kv_fraction must be in"),
    ('[[tenants]]\nname = "x"\nkeys = ["k"]\ndegrade = { max_tokens = 0 }\n',
     "degrade.max_tokens must be an integer >= 1"),
    ('[[tenants]]\nname = "x"\nkeys = ["k"]\ndegrade = { tokens = 5 }\n',
     r"unknown fields \['tokens'\]"),
    ('[[tenants]]\nname = "x"\nkeys = ["k"]\nweight = 0\n', "weight must be in"),
])
def test_fair_share_and_degraded_admission_config_errors_name_the_field(tmp_path, body, error):
    f = tmp_path / "t.toml"
    f.write_text(body)
    with pytest.raises(ValueError, match=error):
        TenantRegistry.from_file(f)


def test_a_degrade_rule_caps_what_it_names_and_says_what_changed():
    from engine.sampling_params import SamplingParams
    from gateway.degrade import DegradeRule, LoadThresholds

    rule = DegradeRule(max_tokens=64, n=1, priority=2)
    params, n, what = rule.apply(SamplingParams(max_tokens=512, priority=1), 4, lanes=True,
                                 why="9 requests waiting, queue_depth 8")
    assert (params.max_tokens, n, params.priority) == (64, 1, 3)
    assert what == params.degraded == ("max_tokens 512->64; n 4->1; priority 1->3 "
                                       "(9 requests waiting, queue_depth 8)")
    # no lanes (not the priority policy), and a request that already asks for less: unchanged
    same, n, what = rule.apply(SamplingParams(max_tokens=32), 1, lanes=False)
    assert (same, n, what) == (SamplingParams(max_tokens=32), 1, "")
    # min_tokens stays within the capped max_tokens (and says so)
    capped, _, what = rule.apply(SamplingParams(max_tokens=512, min_tokens=100), 1, lanes=False)
    assert (capped.max_tokens, capped.min_tokens) == (64, 64)
    assert what == "max_tokens 512->64; min_tokens 100->64"
    load = LoadThresholds(queue_depth=8, kv_fraction=0.9)
    assert load.pressure({"r0": {"waiting": 5, "kv_blocks_used": 80, "kv_blocks_total": 100},
                          "r1": {"waiting": 2, "kv_blocks_used": 80,
                                 "kv_blocks_total": 100}}) == ""
    assert load.pressure({"r0": {"waiting": 8}}) == "8 requests waiting, queue_depth 8"
    assert "180 of 200 KV blocks" in load.pressure({
        "r0": {"kv_blocks_used": 90, "kv_blocks_total": 100},
        "r1": {"kv_blocks_used": 90, "kv_blocks_total": 100}})
    assert LoadThresholds().pressure({"r0": {"waiting": 10**6}}) == ""
