"""The documentation cannot drift: the site builds strictly (a broken link, a missing anchor
or a page left out of the nav fails), every setting, environment variable, record column,
stage, metric, CLI argument and Grafana panel has documentation, and the front door and the
source stay as the docs issue set them (a short README, no dated lines outside the benchmark
pages, no docstring over 250 words)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATE = re.compile(r"20\d\d-[01]\d-[0-3]\d")


def _reference():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages():
    return _reference().pages()


def test_the_site_builds_strictly(built_site):
    run, site = built_site
    assert run.returncode == 0, run.stdout + run.stderr
    for page in _reference().PAGES:  # every generated page is in the built site
        assert (site / page.removesuffix(".md") / "index.html").exists(), page


def test_every_item_of_every_reference_page_is_documented(pages):
    for path, (_, items) in pages.items():
        assert items, f"{path} lists nothing"
        missing = sorted(name for name, doc in items.items() if not str(doc).strip())
        assert not missing, f"{path}: no documentation for {missing}"


def test_every_tailscope_variable_read_in_the_code_is_in_the_reference(pages):
    documented = set(pages["reference/environment.md"][1])
    used = set()
    for package in ("gateway", "engine", "kernels", "tracing", "dashboards", "evals",
                    "tailscope"):
        for path in (ROOT / package).rglob("*.py"):
            used |= set(re.findall(r"TAILSCOPE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    used -= {"TAILSCOPE_QUERY", "TAILSCOPE_MAX"}  # prefixes named in prose
    assert not sorted(used - documented)


def test_every_metric_the_gateway_serves_is_in_the_reference(pages):
    from gateway.metrics import GatewayMetrics

    class NoPool:  # the pool collector's input: no replicas (names come from the others)
        def describe(self):
            return {}

    documented = set(pages["reference/metrics.md"][1])
    for family in GatewayMetrics(NoPool()).registry.collect():
        names = {family.name, family.name + "_total"}
        assert names & documented, family.name


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    assert not [line for line in lines if DATE.search(line)]
    assert not [line for line in lines if "python bench/" in line]
    for line in lines:
        if line.startswith("|"):
            for cell in line.strip("|").split("|"):
                assert len(cell.split()) <= 40, cell
    first_why = next(i for i, line in enumerate(lines) if "tailscope why" in line)
    assert first_why < 80


def test_docs_pages_are_short_and_links_from_the_readme_resolve():
    for path in (ROOT / "docs").rglob("*.md"):
        assert len(path.read_text().splitlines()) <= 400, path
    for target in re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text()):
        assert (ROOT / target).exists(), target


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.split()


def test_no_dated_lines_outside_the_benchmark_pages():
    dated = []
    for name in _tracked():
        if name.startswith("docs/benchmarks/") or name.endswith((".png", ".gguf", ".json")):
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        dated += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1)
                  if DATE.search(line)]
    assert not dated


def test_no_docstring_over_250_words():
    long = []
    for name in _tracked():
        if not name.endswith(".py"):
            continue
        tree = ast.parse((ROOT / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                if len(doc.split()) > 250:
                    long.append(f"{name}:{getattr(node, 'name', '<module>')}")
    assert not long
