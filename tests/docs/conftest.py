from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """One strict build of the docs site for every test here: (the finished build, its
    directory). The strict-build test asserts it succeeded; the others need its pages."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    return run, out
