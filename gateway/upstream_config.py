"""An external backend's declaration (``UpstreamConfig``: from the engine config YAML's
``backends:`` list or ``tailscope serve --backend NAME=URL[,key=value...]``)."""

from __future__ import annotations

from dataclasses import dataclass, fields


def _flag(v) -> bool | None:
    """A YAML bool, or true/false/1/0/yes/no as a --backend flag's text; None otherwise."""
    if isinstance(v, bool):
        return v
    return {"true": True, "1": True, "yes": True, "false": False, "0": False,
            "no": False}.get(str(v).strip().lower())


@dataclass(frozen=True)
class UpstreamConfig:
    name: str  # the replica name records and /debug/replicas use
    url: str  # base URL, with or without /v1
    model: str  # the model name clients send for it
    upstream_model: str = ""  # the name the upstream knows it by (default: ``model``)
    api_key_env: str = ""  # environment variable holding its API key (sent as a bearer token)
    max_concurrency: int = 64
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 120.0
    idle_timeout_s: float = 60.0
    eject_after: int = 3  # failures in a row that eject it
    eject_s: float = 10.0  # how long an ejected backend is left alone
    probe_interval_s: float = 5.0  # health probe period (0: no probes)
    # ask for token ids (vLLM's return_token_ids, vLLM >= 0.10.2, or another Tailscope) so the
    # records keep them; stripped from the answer unless the client asked for them itself
    return_token_ids: bool = False
    # ask for usage on streams (stream_options.include_usage) so the records have exact token
    # counts (and vLLM's per-request metrics, which come with the usage chunk); the usage chunk
    # is not passed on to a client that did not ask for it
    stream_usage: bool = True
    # what the gateway reads from it: a whole (non-streamed or error) body, one SSE line
    max_response_mb: float = 64.0
    max_line_kb: int = 1024

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"backend name {self.name!r} must be non-empty, without '/'")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend {self.name}: url must be http(s)://..., got {self.url!r}")
        if not self.model:
            raise ValueError(f"backend {self.name}: model (the name clients use) is required")
        for f in ("max_concurrency", "eject_after"):
            if getattr(self, f) < 1:
                raise ValueError(f"backend {self.name}: {f} must be >= 1")
        for f in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "eject_s",
                  "max_response_mb", "max_line_kb"):
            if getattr(self, f) <= 0:
                raise ValueError(f"backend {self.name}: {f} must be > 0")
        if self.probe_interval_s < 0:
            raise ValueError(f"backend {self.name}: probe_interval_s must be >= 0")

    @property
    def max_response_bytes(self) -> int:
        return int(self.max_response_mb * 2**20)

    @property
    def base(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"

    @property
    def root(self) -> str:
        """The server's root (where ``/health`` and version endpoints live)."""
        base = self.url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base

    @classmethod
    def from_mapping(cls, values: dict, where: str = "backend") -> UpstreamConfig:
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: "
                             f"{', '.join(known)}")
        out = {}
        for k, v in values.items():
            kind = {"int": int, "float": float, "str": str, "bool": _flag}[known[k]]
            try:
                out[k] = kind(v) if not isinstance(v, bool) or kind is _flag else None
            except (TypeError, ValueError):
                out[k] = None
            if out[k] is None:
                raise ValueError(f"{where}: {k} must be {known[k]}, got {v!r}")
        return cls(**out)

    @classmethod
    def parse_flag(cls, text: str) -> UpstreamConfig:
        """``NAME=URL[,key=value...]`` (keys as in the YAML; ``model`` defaults to NAME)."""
        head, _, rest = text.partition(",")
        name, eq, url = head.partition("=")
        if not eq:
            raise ValueError(f"--backend {text!r}: expected NAME=URL[,key=value...]")
        values: dict = {"name": name.strip(), "url": url.strip(), "model": name.strip()}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            k, eq, v = item.partition("=")
            if not eq:
                raise ValueError(f"--backend {text!r}: {item!r} is not key=value")
            values[k.strip()] = v.strip()
        return cls.from_mapping(values, f"--backend {name}")
