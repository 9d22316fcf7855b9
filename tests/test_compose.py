"""The docker compose stack: the file validates with docker-compose (Debian's package, which
checks a file without an engine) and matches what the README documents."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"clickhouse": "8123", "grafana": "3000", "jaeger": "16686",
            "otel-collector": "4318", "gateway": "8000", "drill": "8501"}


def config() -> dict:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is missing: make test installs it (apt-get install docker-compose)"
    out = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_compose_file_validates_with_the_documented_services_and_ports():
    services = config()["services"]
    assert set(services) == set(SERVICES)
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Full stack"):]
    for name, port in SERVICES.items():
        published = {str(p["published"]) if isinstance(p, dict) else str(p).split(":")[0]
                     for p in services[name].get("ports", [])}
        assert port in published, (name, published)
        assert f"localhost:{port}" in section, f"README's Full stack section lacks {name}"
    for svc in services.values():  # pinned images: a tag, never latest
        if "image" in svc and "tailscope" not in svc["image"]:
            assert re.search(r":[\w.]+$", svc["image"]) and not svc["image"].endswith(":latest")


def test_gateway_writes_to_the_clickhouse_server_and_exports_spans():
    services = config()["services"]
    env = services["gateway"]["environment"]
    assert env["TAILSCOPE_STORE_DSN"].startswith("http://") and "@clickhouse:8123/" in \
        env["TAILSCOPE_STORE_DSN"]
    assert env["TAILSCOPE_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    readme = (ROOT / "README.md").read_text()
    for var in env:
        assert var in readme, f"{var} is not documented"
    assert "clickhouse" in services["gateway"]["depends_on"]
    for name in ("clickhouse", "grafana", "gateway"):
        assert "healthcheck" in services[name], name
    volumes = {v["source"] for s in services.values() for v in s.get("volumes", [])
               if isinstance(v, dict) and v.get("type") == "bind"}
    for path in volumes:
        assert Path(path).exists(), f"a bind mount points at a missing path: {path}"
