"""Guards on how the project is put together: the gateway stays torch-free, and every bench
script runs as documented (``python bench/<script>.py``) from a fresh clone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tailscope", "gateway", "engine", "kernels", "tracing", "dashboards", "evals",
            "bench")
BENCH = sorted(p for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py")
SCRIPTS = [p for p in BENCH if '__name__ == "__main__"' in p.read_text()]  # not libraries


def test_importing_the_gateway_app_does_not_import_torch():
    code = "import sys, gateway.app; sys.exit(1 if 'torch' in sys.modules else 0)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, "gateway.app imports torch: " + out.stderr[-500:]


def test_bench_has_scripts():
    assert {p.name for p in SCRIPTS} >= {"engine_throughput.py", "gateway_overhead.py",
                                         "trace_overhead.py", "kernel_speed.py"}


def test_no_bench_script_shadows_a_package():
    # `python bench/x.py` puts bench/ first on sys.path: bench/kernels.py once hid `kernels`
    assert not {p.stem for p in BENCH} & set(PACKAGES)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_bench_script_answers_help(script):
    out = subprocess.run([sys.executable, str(script.relative_to(ROOT)), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stderr[-500:]


def test_importing_the_gateway_app_does_not_import_pandas():
    # the gateway reads the query library's SQL; pandas (~40 MB) stays out of its process
    code = ("import sys, gateway.app, gateway.store_api; "
            "sys.exit(1 if 'pandas' in sys.modules else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, "gateway.app imports pandas: " + out.stderr[-500:]


def test_sql_against_the_trace_tables_lives_in_the_query_library():
    # DDL lives in tracing/schema*.py, the store client in tracing/store.py; Grafana's panels
    # are SQL with the plugin's macros, run by Grafana, not by us
    allowed = {"tracing/queries.py", "tracing/why.py", "tracing/schema.py", "tracing/schema_v1.py",
               "tracing/store.py", "dashboards/grafana.py"}
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in allowed and "FROM tailscope." in path.read_text():
                offenders.append(rel)
    assert not offenders, f"SQL outside tracing/queries.py: {offenders}"
