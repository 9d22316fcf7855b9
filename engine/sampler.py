"""Token selection. Greedy (``temperature == 0``) is its own branch: argmax, lowest id wins ties
(torch.argmax returns the first maximum). ``temperature > 0`` draws from softmax(z / T) with a
per-request generator, seeded when the request has a seed. The full pipeline (penalties, top-k,
top-p, min-p, typical, logprobs) is the sampler issue's work; admission refuses those params
until then so no request silently ignores them.
"""

from __future__ import annotations

import torch

from engine.request import Request


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, req: Request) -> torch.Generator:
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator()
            if req.params.seed is not None:
                g.manual_seed(req.params.seed)
            else:
                g.seed()
            self._generators[req.request_id] = g
        return g

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """``logits`` is ``[len(requests), vocab]`` float32; returns one token id per row."""
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, req in enumerate(requests):
            if req.params.greedy:
                out.append(greedy[i])
            else:
                probs = torch.softmax(logits[i] / req.params.temperature, dim=-1)
                out.append(int(torch.multinomial(probs, 1, generator=self._generator(req))))
        return out
