"""Tenants, API keys and the ingress gate's limits (token buckets, concurrency, sizes).

Configured in a TOML file (``tailscope serve --config FILE`` or ``TAILSCOPE_CONFIG``)::

More: docs/design/gateway-notes.md#gatewaytenants."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import time
import tomllib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from engine.sampling_params import SamplingParams, SamplingParamsError
from gateway.degrade import DegradeRule, LoadThresholds
from gateway.errors import APIError


@dataclass
class TokenBucket:
    """``capacity`` units, refilled continuously at ``capacity`` per minute."""

    capacity: float
    level: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.capacity

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now

    def take(self, amount: float) -> float:
        """Take ``amount`` and return 0, or take nothing and return seconds until it fits."""
        self._refill()
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) * 60.0 / self.capacity

    def charge(self, amount: float) -> None:
        """Take ``amount`` whatever the level (use found after the fact: a backend's usage
        past what admission charged); below zero, later takes wait until it refills."""
        self._refill()
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)

    def state(self) -> tuple[int, float]:
        """(whole units left now, seconds until the bucket is full again)."""
        self._refill()
        return max(0, int(self.level)), (self.capacity - self.level) * 60.0 / self.capacity


def _duration(seconds: float) -> str:
    """A reset time as OpenAI's rate-limit headers write it: ``250ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest = f"{math.ceil(rest * 1000) / 1000:g}s"
    return f"{int(minutes)}m{rest}" if minutes else rest


def rate_limit_headers(tenant: Tenant) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for a tenant's token buckets (none without): the
    limit per minute, what is left now and when the bucket is full again, for requests and for
    tokens (a request holds its prompt + max_tokens until it ends, as admission charged it;
    the unused part comes back then). Clients that pace themselves by them (LiteLLM's router,
    OpenAI's cookbook throttler) read them off every answer, a 429 included."""
    out = {}
    for kind, limit, bucket in (("requests", tenant.requests_per_minute, tenant.request_bucket),
                                ("tokens", tenant.tokens_per_minute, tenant.token_bucket)):
        if bucket is not None:
            left, reset = bucket.state()
            out[f"x-ratelimit-limit-{kind}"] = f"{limit:g}"
            out[f"x-ratelimit-remaining-{kind}"] = str(left)
            out[f"x-ratelimit-reset-{kind}"] = _duration(reset)
    return out


@dataclass
class Tenant:
    name: str
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    admin: bool = False  # its keys may read /debug endpoints
    capture: str = "full"  # "full": token ids in records; "counts": counts only
    ttl_days: int | None = None  # how long the store keeps its rows (default: the store's)
    cache_namespace: str | None = None  # shared prefix-cache namespace (opt-in)
    priority: int = 0  # default request priority under the priority scheduling policy
    # the lowest (most urgent) priority its requests may ask for; None: its own ``priority``
    # for a configured tenant, no bound in open local mode (one user)
    min_priority: int | None = None
    weight: float = 1.0  # its share under the fair scheduling policy
    degrade: DegradeRule | None = None  # what it gives up under load (None: never degraded)
    active: int = 0
    request_bucket: TokenBucket | None = None
    token_bucket: TokenBucket | None = None

    @property
    def cache_salt(self) -> str:
        """The prefix-cache namespace of its requests: private to the tenant unless it opts
        into a shared one (the engine salts block hashes with it, so no hit, and no timing
        difference, can cross namespaces)."""
        return f"ns:{self.cache_namespace}" if self.cache_namespace else f"tenant:{self.name}"

    def check_priority(self, priority: int) -> None:
        """400 when a request asks for a priority more urgent than ``min_priority``."""
        if self.min_priority is not None and priority < self.min_priority:
            raise APIError(400, f"priority {priority} is more urgent than tenant "
                           f"{self.name!r} may ask for (its min_priority is "
                           f"{self.min_priority})", param="priority",
                           code="priority_not_allowed")

    def __post_init__(self) -> None:
        if self.requests_per_minute:
            self.request_bucket = TokenBucket(self.requests_per_minute)
        if self.tokens_per_minute:
            self.token_bucket = TokenBucket(self.tokens_per_minute)


def _too_many(message: str, wait_s: float) -> APIError:
    retry = "60" if math.isinf(wait_s) else str(max(1, math.ceil(wait_s)))
    return APIError(429, message, "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": retry})


def key_id_secret(configured: str | None, path: str | Path = ".tailscope/key-id-secret"
                  ) -> bytes:
    """The configured secret, or the one kept in ``path`` (created on first use, mode 0600)."""
    if configured:
        return configured.encode()
    p = Path(path)
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return p.read_text().strip().encode()


class TenantRegistry:
    def __init__(self, tenants: list[Tenant], keys: dict[str, Tenant],
                 secret: bytes = b"", load: LoadThresholds | None = None) -> None:
        self.tenants = tenants
        self.load = load or LoadThresholds()  # degraded admission's thresholds
        self._keys = keys
        self._secret = secret
        self.open = not keys
        self.local = Tenant("local")
        self._bench_owners: OrderedDict[str, str] = OrderedDict()  # recent run ids -> tenant

    @classmethod
    def from_file(cls, path: str | Path | None, secret: str | None = None) -> TenantRegistry:
        if not path:
            return cls([], {})
        data = tomllib.loads(Path(path).read_text())
        unknown = set(data) - {"tenants", "degraded_admission"}
        if unknown:
            raise ValueError(f"{path}: unknown sections {sorted(unknown)}; the file takes "
                             "[[tenants]] and [degraded_admission]")
        load = LoadThresholds.parse(data.get("degraded_admission", {}), str(path))
        tenants, keys = [], {}
        for entry in data.get("tenants", []):
            entry = dict(entry)
            entry_keys = entry.pop("keys", [])
            unknown = set(entry) - set(Tenant.__dataclass_fields__) - {"name"}
            if unknown or "name" not in entry:
                raise ValueError(f"{path}: tenant entry {entry.get('name')!r} has unknown or "
                                 f"missing fields: {sorted(unknown) or ['name']}")
            if "degrade" in entry:
                entry["degrade"] = DegradeRule.parse(entry["degrade"],
                                                     f"{path}: tenant {entry['name']!r}")
            tenant = Tenant(**entry)
            if tenant.min_priority is None:
                tenant.min_priority = tenant.priority
            try:  # the weight's bounds are the engine's (SamplingParams.weight)
                SamplingParams(weight=tenant.weight)
            except SamplingParamsError as exc:
                raise ValueError(f"{path}: tenant {tenant.name!r}: {exc}") from None
            if tenant.capture not in ("full", "counts"):
                raise ValueError(f"{path}: tenant {tenant.name!r}: capture must be 'full' or "
                                 f"'counts', not {tenant.capture!r}")
            tenants.append(tenant)
            for key in entry_keys:
                if key in keys:
                    raise ValueError(f"{path}: an API key is listed for two tenants")
                keys[key] = tenant
        return cls(tenants, keys, key_id_secret(secret) if keys else b"", load)

    def key_id(self, key: str) -> str:
        return hmac.new(self._secret, key.encode(), hashlib.sha256).hexdigest()[:16]

    def bench_token(self, run_id: str) -> str:
        """The token an admin hands a load generator (``POST /debug/bench-runs/open``): with it
        any tenant's requests may tag records into ``run_id`` (a multi-tenant bench run). Keyed
        by the deployment's secret, so it holds across restarts and gateways of one fleet."""
        return hmac.new(self._secret, b"bench-run\0" + run_id.encode(),
                        hashlib.sha256).hexdigest()[:32]

    def check_bench_run(self, tenant: Tenant, run_id: str, token: str) -> None:
        """``x-tailscope-bench-run`` tags a record into a run that ``whatif --bench-run`` and the
        bench reports read, so one tenant must not tag into another's: a run belongs to the
        first tenant that tags it, unless the request carries the run's admin-minted token
        (``x-tailscope-bench-token``) or comes from an admin tenant. Open mode has one tenant."""
        if self.open or not run_id or tenant.admin:
            return
        if token and hmac.compare_digest(token.encode(), self.bench_token(run_id).encode()):
            return
        owner = self._bench_owners.setdefault(run_id, tenant.name)
        self._bench_owners.move_to_end(run_id)
        if len(self._bench_owners) > 65_536:
            self._bench_owners.popitem(last=False)
        if owner != tenant.name:
            raise APIError(403, f"bench run {run_id!r} belongs to another tenant; a run shared "
                           "by tenants needs its token from an admin (POST "
                           "/debug/bench-runs/open), sent as x-tailscope-bench-token",
                           "permission_error", param="x-tailscope-bench-run",
                           code="bench_run_forbidden")

    def authenticate(self, authorization: str | None) -> tuple[Tenant, str]:
        """(tenant, key id) for the request's ``Authorization: Bearer`` key; 401 otherwise."""
        if self.open:
            return self.local, ""
        if not authorization or not authorization.lower().startswith("bearer "):
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")
        key = authorization[7:].strip()
        # the dict lookup hashes the key; its timing says nothing a caller can use to guess a
        # key byte by byte (unlike a character-wise ==)
        tenant = self._keys.get(key)
        if tenant is None:
            raise APIError(401, "invalid API key", "authentication_error",
                           code="invalid_api_key")
        return tenant, self.key_id(key)

    def admit_request(self, tenant: Tenant) -> None:
        """Ingress: the request-rate bucket and the concurrency cap (before tokenizing)."""
        if tenant.max_concurrent is not None and tenant.active >= tenant.max_concurrent:
            raise _too_many(f"tenant {tenant.name!r} has {tenant.active} requests in flight "
                            f"(limit {tenant.max_concurrent})", 1.0)
        if tenant.request_bucket is not None:
            wait = tenant.request_bucket.take(1)
            if wait:
                raise _too_many(f"tenant {tenant.name!r} is over its "
                                f"{tenant.requests_per_minute:g} requests/min", wait)
        tenant.active += 1

    def admit_tokens(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> None:
        """After tokenizing: size limits and the tokens/min bucket (prompt + max_tokens)."""
        if tenant.max_prompt_tokens is not None and prompt_tokens > tenant.max_prompt_tokens:
            raise APIError(400, f"prompt has {prompt_tokens} tokens; tenant {tenant.name!r} "
                           f"allows {tenant.max_prompt_tokens}", param="messages")
        if tenant.max_output_tokens is not None and max_tokens > tenant.max_output_tokens:
            raise APIError(400, f"max_tokens {max_tokens} exceeds tenant {tenant.name!r}'s "
                           f"limit of {tenant.max_output_tokens}", param="max_tokens")
        self.charge_tokens(tenant, prompt_tokens + max_tokens)

    def charge_tokens(self, tenant: Tenant, tokens: int) -> None:
        """``tokens`` from the tenant's tokens/min bucket (a request's admission, a utility
        answer's size); 429 when they do not fit."""
        if tenant.token_bucket is not None and tokens > 0:
            wait = tenant.token_bucket.take(tokens)
            if wait:
                raise _too_many(f"tenant {tenant.name!r} is over its "
                                f"{tenant.tokens_per_minute:g} tokens/min", wait)

    def give_back_tokens(self, tenant: Tenant, tokens: int) -> None:
        if tenant.token_bucket is not None and tokens > 0:
            tenant.token_bucket.give_back(tokens)

    def finish(self, tenant: Tenant, unused_tokens: int = 0) -> None:
        tenant.active = max(0, tenant.active - 1)
        if tenant.token_bucket is not None and unused_tokens > 0:
            tenant.token_bucket.give_back(unused_tokens)
