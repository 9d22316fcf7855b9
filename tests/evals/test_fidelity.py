"""The fidelity gate (``tailscope eval fidelity``): a config against itself is identical
(zero KL divergence, full agreement, the same perplexity); the fast profile against the exact
one differs by a measured amount, and the command reports it and gates on perplexity."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.profiles import choose
from evals import fidelity as F


def test_a_config_against_itself_is_identical():
    got = F.run("exact", "exact", max_tokens=65, window=32)
    assert got.tokens == 64
    assert got.ppl == got.ref_ppl and got.kl_mean == 0 and got.kl_p99 == 0 and got.top1 == 1


@pytest.mark.skipif(choose("fast")[0] == choose("exact")[0],
                    reason="fast is the exact path on this CPU (no native bf16)")
def test_fast_against_exact_is_measured_and_gated():
    out = subprocess.run([sys.executable, "-m", "tailscope.cli", "eval", "fidelity",
                          "--max-tokens", "129", "--window", "64", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["tokens"] == 128 and got["kl_mean"] > 0 and 0.5 < got["top1"] <= 1
    assert out.returncode == (0 if got["ppl_increase"] <= F.MAX_PPL_INCREASE else 1)


def test_a_config_file_is_a_config(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("engine: {profile: exact, weights: int4}\n")
    config = F.engine_of(str(f))
    assert (config.profile, config.dtype, config.weights) == ("exact", "float32", "int4")
    with pytest.raises(ValueError):
        F.engine_of("fastest")  # neither a profile nor a file
