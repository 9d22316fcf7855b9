"""The docker compose stack: the file validates with docker-compose (Debian's package, which
checks a file without an engine) and matches what the docs document."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tailscope.settings import variables

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"clickhouse": "8123", "grafana": "3000", "jaeger": "16686",
            "otel-collector": "4318", "gateway": "8000", "gateway-b": "8001", "drill": "8501"}


SECRETS = {"CLICKHOUSE_PASSWORD": "s3cret-writer", "CLICKHOUSE_VIEWER_PASSWORD": "s3cret-viewer",
           "GRAFANA_ADMIN_PASSWORD": "s3cret-grafana", "TAILSCOPE_ADMIN_KEY": "s3cret-admin"}


def run_config(env: dict[str, str]) -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is missing: make test installs it (apt-get install docker-compose)"
    base = {k: v for k, v in os.environ.items() if k not in SECRETS
            and k != "TAILSCOPE_BIND_ADDRESS"}
    return subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**base, **env})


def config() -> dict:
    out = run_config(SECRETS)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def published(port) -> tuple[str, str]:
    """(host address, host port) of a compose port entry, string or long form."""
    if isinstance(port, dict):
        return port.get("host_ip", "0.0.0.0"), str(port["published"])
    parts = str(port).split("/")[0].split(":")
    return (parts[0], parts[1]) if len(parts) == 3 else ("0.0.0.0", parts[0])


def test_compose_file_validates_with_the_documented_services_and_ports():
    services = config()["services"]
    assert set(services) == set(SERVICES)
    guide = (ROOT / "docs/guides/grafana.md").read_text()
    section = guide[guide.index("## Full stack"):]
    for name, port in SERVICES.items():
        ports = {published(p)[1] for p in services[name].get("ports", [])}
        assert port in ports, (name, ports)
        assert f"localhost:{port}" in section, f"the Full stack guide lacks {name}"
    for svc in services.values():  # pinned images: a tag, never latest
        if "image" in svc and "tailscope" not in svc["image"]:
            assert re.search(r":[\w.]+$", svc["image"]) and not svc["image"].endswith(":latest")


def test_gateway_writes_to_the_clickhouse_server_and_exports_spans():
    services = config()["services"]
    env = services["gateway"]["environment"]
    assert env["TAILSCOPE_STORE_DSN"].startswith("http://") and "@clickhouse:8123/" in \
        env["TAILSCOPE_STORE_DSN"]
    assert env["TAILSCOPE_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    docs = (ROOT / "docs/guides/grafana.md").read_text()
    for var in env:
        assert var in docs or var in variables(), f"{var} is not documented"
    assert "clickhouse" in services["gateway"]["depends_on"]
    for name in ("clickhouse", "grafana", "gateway"):
        assert "healthcheck" in services[name], name
    volumes = {v["source"] for s in services.values() for v in s.get("volumes", [])
               if isinstance(v, dict) and v.get("type") == "bind"}
    for path in volumes:
        assert Path(path).exists(), f"a bind mount points at a missing path: {path}"


def test_the_fleet_profile_adds_a_second_gateway_into_the_same_clickhouse():
    services = config()["services"]
    a, b = services["gateway"], services["gateway-b"]
    assert b["profiles"] == ["fleet"] and "profiles" not in a  # `up` alone: one gateway
    assert a["environment"]["TAILSCOPE_STORE_DSN"] == b["environment"]["TAILSCOPE_STORE_DSN"]
    ids = {a["environment"]["TAILSCOPE_INSTANCE_ID"], b["environment"]["TAILSCOPE_INSTANCE_ID"]}
    assert len(ids) == 2  # records, events, steps and replica ids never collide
    def sources(svc: dict) -> set[str]:
        return {v["source"] if isinstance(v, dict) else str(v).split(":")[0]
                for v in svc["volumes"]}
    assert sources(a).isdisjoint(sources(b))  # each its own spool
    assert "--profile fleet" in (ROOT / "docs/guides/scaling-out.md").read_text()


def test_every_port_is_on_loopback_and_no_secret_has_a_default():
    services = config()["services"]
    for name, svc in services.items():
        for p in svc.get("ports", []):
            assert published(p)[0] == "127.0.0.1", (name, p)
    text = (ROOT / "docker-compose.yml").read_text()
    for value in SECRETS.values():
        assert value not in text
    assert "tailscope-admin" not in text and ":tailscope@" not in text
    for missing in SECRETS:  # each secret is required: no default to fall back on
        out = run_config({k: v for k, v in SECRETS.items() if k != missing})
        assert out.returncode != 0 and missing in out.stderr, (missing, out.stderr[-300:])
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == SECRETS["GRAFANA_ADMIN_PASSWORD"]


def test_grafana_and_the_drill_down_read_as_a_read_only_user():
    ds = yaml.safe_load((ROOT / "dashboards/grafana/datasources/clickhouse.yaml").read_text())
    user = ds["datasources"][0]["jsonData"]["username"]
    assert user == "viewer"
    assert ds["datasources"][0]["secureJsonData"]["password"] == "$CLICKHOUSE_VIEWER_PASSWORD"
    users = (ROOT / "deploy/clickhouse/users.d/viewer.xml").read_text()
    assert "<readonly>2</readonly>" in users and 'from_env="CLICKHOUSE_VIEWER_PASSWORD"' in users
    assert "GRANT SELECT ON tailscope.*" in users
    services = config()["services"]
    mounts = [v["target"] if isinstance(v, dict) else str(v).split(":")[1]
              for v in services["clickhouse"]["volumes"]]
    assert "/etc/clickhouse-server/users.d/viewer.xml" in mounts
    assert "http://viewer:" in " ".join(services["drill"]["command"])
