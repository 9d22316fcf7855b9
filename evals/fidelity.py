"""Fidelity of an engine config against a reference: how far its next-token distributions are
from the reference's on a fixed text, not whether its greedy answers are bit-equal.

    tailscope eval fidelity --config fast --reference exact [--text FILE] [--window 512]

Both configs (a profile name, or an engine config YAML file) load the same model; the text is
cut into windows of ``window`` tokens, each run from scratch through both models' full-sequence
forward (``LlamaModel.dense_forward``: the config's dtype and weights' values), and each
position's next-token distribution compared: perplexity of the text under each, the KL
divergence KL(reference || config) per position (mean and 99th percentile), and how often the
two agree on the most likely token. The same figures llama.cpp's ``llama-perplexity
--kl-divergence`` reports against its own float baseline.

Both configs' output matrices are run one position at a time (``logit_rows=1``), as a
batch-1 decode step runs them: a packed output matrix's small-step path (a 4-bit one's rescored top
logits and rounded tail) is what the figures see. The decoder layers run the full-sequence
forward (the same weight formats on the kernels' many-rows paths): what it does not see is
how a few-rows layer kernel sums in another order, and a compiled step's fused ops.

The shipped text (``evals/data/shakespeare.txt``, ~23k tokens of the bundled tokenizer) is the
opening of William Shakespeare's *Coriolanus* and what follows it in the "tiny Shakespeare"
collection (public domain).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

TEXT = Path(__file__).with_name("data") / "shakespeare.txt"
# the gate: fast's perplexity within this of exact's (relative)
MAX_PPL_INCREASE = 0.01


@dataclass(frozen=True)
class Fidelity:
    tokens: int  # positions compared
    ppl: float  # the config's perplexity of the text
    ref_ppl: float  # the reference's
    kl_mean: float  # KL(reference || config), nats per position
    kl_p99: float
    top1: float  # share of positions where both pick the same most likely token

    @property
    def ppl_increase(self) -> float:
        return self.ppl / self.ref_ppl - 1

    def as_dict(self) -> dict:
        return {**asdict(self), "ppl_increase": self.ppl_increase}

    def text(self, name: str, ref: str) -> str:
        ok = self.ppl_increase <= MAX_PPL_INCREASE
        return (f"{name} against {ref} on {self.tokens} positions:\n"
                f"  perplexity     {self.ppl:.4f} vs {self.ref_ppl:.4f} "
                f"({self.ppl_increase * 100:+.3f} %; gate <= {MAX_PPL_INCREASE * 100:g} %: "
                f"{'met' if ok else 'NOT met'})\n"
                f"  KL divergence  mean {self.kl_mean:.6f}, p99 {self.kl_p99:.6f} nats\n"
                f"  top-1 agree    {self.top1 * 100:.2f} %")


def engine_of(spec: str):
    """An ``EngineConfig`` from a profile name or an engine config YAML file."""
    from engine.config import PROFILES, EngineConfig
    from tailscope.engine_config import load

    if spec in PROFILES:
        return EngineConfig(profile=spec)
    file = load(spec)
    return EngineConfig(**{"profile": "fast", **file.engine})


def load(config, model_path: str):
    from engine import load_configured

    return load_configured(model_path, config)


def measure(model, reference, ids: list[int], window: int = 512) -> Fidelity:
    """Compare ``model`` with ``reference`` on ``ids`` in windows of ``window`` tokens."""
    import torch

    nll = ref_nll = agree = 0.0
    kls: list[torch.Tensor] = []
    n = 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start:start + window + 1])
        if len(chunk) < 2:
            break
        inputs, targets = chunk[:-1], chunk[1:]
        lp = model.dense_forward(inputs, logit_rows=1).float().log_softmax(-1)
        lr = reference.dense_forward(inputs, logit_rows=1).float().log_softmax(-1)
        nll -= lp.gather(1, targets[:, None]).sum().item()
        ref_nll -= lr.gather(1, targets[:, None]).sum().item()
        kls.append((lr.exp() * (lr - lp)).sum(-1).clamp_min(0))
        agree += (lp.argmax(-1) == lr.argmax(-1)).sum().item()
        n += len(targets)
    kl = torch.cat(kls)
    return Fidelity(n, math.exp(nll / n), math.exp(ref_nll / n), kl.mean().item(),
                    torch.quantile(kl, 0.99).item(), agree / n)


def run(config: str, reference: str, text: Path = TEXT, window: int = 512,
        max_tokens: int | None = None, model: str = "bundled") -> Fidelity:
    """``tailscope eval fidelity``: the two configs on ``text`` (its first ``max_tokens``)."""
    from engine.loader.paths import resolve_model_path
    from engine.text import load_tokenizer

    path = str(resolve_model_path(model))
    ids = load_tokenizer(path).encode(Path(text).read_text(), False)[:max_tokens]
    return measure(load(engine_of(config), path), load(engine_of(reference), path), ids,
                   window)
