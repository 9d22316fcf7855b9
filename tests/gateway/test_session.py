"""The request session (gateway.session): the tenant's slot is given back exactly once whoever
ends the request, and the in-flight map names steps' members by trace and tenant."""

from __future__ import annotations

from types import SimpleNamespace

from engine.sampling_params import SamplingParams
from gateway.records import RequestTrace
from gateway.session import ENDED_KEPT, Choice, InFlight, Part, RequestSession
from gateway.tenants import Tenant, TenantRegistry


def _session(registry: TenantRegistry, tenant: Tenant, trace_id: str) -> RequestSession:
    registry.admit_request(tenant)
    trace = RequestTrace("req", trace_id, "s" * 16, "", "/v1/completions")
    trace.admitted(tenant.name, "", 30)
    return RequestSession(None, tenant, registry, trace)


class _Stream:  # the one TextStream field the session reads
    generated_tokens = 3


def _choice(session: RequestSession, engine_id: str, max_tokens: int = 10) -> Choice:
    part = Part(session.trace, [1, 2], SamplingParams(max_tokens=max_tokens))
    c = Choice(0, engine_id, _Stream(), part.params, part.prompt, session, session.trace)
    part.choices.append(c)
    session.parts.append(part)
    return c


def test_the_slot_is_released_once_whoever_releases_it():
    registry = TenantRegistry([], {})
    tenant = Tenant("t", max_concurrent=2, tokens_per_minute=1000)
    a, b = _session(registry, tenant, "a" * 32), _session(registry, tenant, "b" * 32)
    assert tenant.active == 2
    registry.admit_tokens(tenant, 0, 100)
    level = tenant.token_bucket.level
    _choice(a, "e-0")
    assert a.release_unused()  # the answer's end: 7 unused tokens back
    assert not a.release()  # the gate's error path afterwards: nothing more
    assert not a.release_unused()  # a backend's abandon callback: nothing more
    assert tenant.active == 1
    assert tenant.token_bucket.level - level >= 7 - 1e-6
    assert b.holds_slot and b.release() and tenant.active == 0


def test_in_flight_names_neighbours_by_tenant_and_keeps_ended_trace_ids():
    registry = TenantRegistry([], {})
    victim = _session(registry, Tenant("victim"), "v" * 32)
    flood = _session(registry, Tenant("flood"), "f" * 32)
    inflight = InFlight()
    v, f = _choice(victim, "v-0"), _choice(flood, "f-0")
    inflight.add(v)
    inflight.add(f)
    member = SimpleNamespace  # a step report's member, as the replica sends it (fake)
    step = SimpleNamespace(members=[member(request_id="v-0", prefill_tokens=0),
                                    member(request_id="f-0", prefill_tokens=512),
                                    member(request_id="gone-0", prefill_tokens=64)])
    inflight.note_step(step)
    assert v.neighbours == {"flood": 512, "?": 64}
    assert f.neighbours == {"?": 64}
    inflight.abandoned("v-0")  # the backend cancelled it for a slow client
    assert not victim.holds_slot
    inflight.retire("v-0")
    assert inflight.trace_of("v-0") == "v" * 32  # a late step report still finds it
    for i in range(ENDED_KEPT):
        c = _choice(flood, f"x-{i}")
        inflight.add(c)
        inflight.retire(c.engine_id)
    assert inflight.trace_of("v-0") == "v-0"  # the bound: the oldest is forgotten
