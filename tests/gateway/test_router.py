"""Routing on plain load views: no processes, no sockets."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import pytest

from gateway.router import NoReplica, Overloaded, choose, prefix_hashes


@dataclass
class View:
    id: str
    ready: bool = True
    inflight: set[str] = field(default_factory=set)
    pending_tokens: int = 0
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)


PROMPT = list(range(100, 164))  # 4 blocks of 16


def test_least_expected_work_wins_and_ties_go_to_fewer_inflight_then_id():
    a, b, c = View("r0", pending_tokens=500), View("r1", pending_tokens=20), View("r2")
    assert choose([a, b, c], PROMPT, block_size=16, max_inflight=8).replica is c
    d, e = View("r3", inflight={"x"}), View("r4")
    assert choose([d, e], PROMPT, block_size=16, max_inflight=8).replica is e
    f, g = View("r6"), View("r5")
    assert choose([f, g], PROMPT, block_size=16, max_inflight=8).replica is g


def test_prefix_locality_outweighs_a_little_more_work_and_stays_per_namespace():
    a, b = View("r0"), View("r1", pending_tokens=30)
    first = choose([a, b], PROMPT, block_size=16, max_inflight=8, salt="t1")
    assert first.replica is a and first.prefix_hit_tokens == 0
    a.pending_tokens = 40  # busier now, but it holds the prompt's 64 tokens
    again = choose([a, b], PROMPT, block_size=16, max_inflight=8, salt="t1")
    assert again.replica is a and again.prefix_hit_tokens == 64
    other = choose([a, b], PROMPT, block_size=16, max_inflight=8, salt="t2")
    assert other.replica is b and other.prefix_hit_tokens == 0  # another tenant's cache
    assert prefix_hashes(PROMPT, 16, "t1") != prefix_hashes(PROMPT, 16, "t2")


def test_shedding_exclusion_and_the_preferred_replica():
    a, b = View("r0", inflight={"x", "y"}), View("r1", ready=False)
    with pytest.raises(Overloaded):
        choose([a, b], PROMPT, block_size=16, max_inflight=2)
    with pytest.raises(NoReplica, match="excluded"):
        choose([View("r0")], PROMPT, block_size=16, max_inflight=2, exclude=frozenset({"r0"}))
    busy, idle = View("r0", pending_tokens=900), View("r1")
    d = choose([busy, idle], PROMPT, block_size=16, max_inflight=8, prefer="r0")
    assert d.replica is busy and "branch" in d.reason


def test_backend_flags_and_yaml_entries_are_checked():
    from gateway.upstream_config import UpstreamConfig

    c = UpstreamConfig.parse_flag("vllm=http://gpu:8000,upstream_model=meta/llama,"
                                  "max_concurrency=8,idle_timeout_s=2.5")
    assert (c.name, c.model, c.upstream_model, c.max_concurrency, c.idle_timeout_s) == (
        "vllm", "vllm", "meta/llama", 8, 2.5) and c.base == "http://gpu:8000/v1"
    assert not c.return_token_ids
    assert UpstreamConfig.parse_flag("v=http://x,return_token_ids=yes").return_token_ids
    assert UpstreamConfig.from_mapping({"name": "v", "url": "http://x", "model": "m",
                                        "return_token_ids": True}).return_token_ids
    for bad, match in [("vllm", "NAME=URL"), ("v=ftp://x", "http"), ("v=http://x,oops", "key"),
                       ("v=http://x,max_concurrency=lots", "int"),
                       ("v=http://x,colour=red", "unknown"),
                       ("v=http://x,idle_timeout_s=0", "> 0"),
                       ("v=http://x,return_token_ids=maybe", "bool")]:
        with pytest.raises(ValueError, match=match):
            UpstreamConfig.parse_flag(bad)
