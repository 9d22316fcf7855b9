"""The choice of a rescored step's top logits and their merge (``csrc/topk.c``:
``kernels.native.topk_indices`` and ``rescored_logits``) against torch: the same values, ties
to the lower index (a stable descending sort's first k), NaN largest, and a merge equal to
``y.scatter(...).float()``."""

from __future__ import annotations

import pytest
import torch

from kernels import native

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels not built here")


def _stable_top(y: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(y.float(), dim=-1, descending=True, stable=True).indices[:, :k]


@needs_native
@pytest.mark.parametrize(("rows", "n", "k"), [(8, 49152, 64), (1, 49152, 64), (3, 100, 7),
                                               (2, 64, 64), (5, 1000, 1), (4, 33, 5)])
def test_topk_indices_are_a_stable_sorts_first_k(rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    # coarse values: many ties, some at the k-th place, where the tie rule decides
    y = (torch.randint(-40, 40, (rows, n), generator=g) / 8).to(torch.bfloat16)
    got = native.topk_indices(y, k)
    assert got.dtype == torch.long and got.shape == (rows, k)
    assert torch.equal(got, _stable_top(y, k))
    assert torch.equal(y.gather(-1, got), y.topk(k, dim=-1).values)


@needs_native
def test_topk_indices_order_nan_and_infinities_as_torch_does():
    y = torch.tensor([[-1.0, float("-inf"), float("inf"), float("nan"), 2.0, -float("nan")]]
                     ).to(torch.bfloat16)
    assert native.topk_indices(y, 6).tolist() == [[3, 5, 2, 4, 0, 1]]
    # a strided (non-contiguous) row view reads the same values
    wide = torch.randn(4, 200).to(torch.bfloat16)
    assert torch.equal(native.topk_indices(wide[:, ::2], 9), _stable_top(wide[:, ::2], 9))
    with pytest.raises(RuntimeError, match="k must be in"):
        native.topk_indices(wide, 201)


@needs_native
def test_rescored_logits_merge_as_scatter_does():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(6, 1000, generator=g).to(torch.bfloat16)
    idx = native.topk_indices(y, 16)
    top = torch.randn(6, 16, generator=g).to(torch.bfloat16)
    got = native.rescored_logits(y, idx, top)
    assert got.dtype == torch.float32
    assert torch.equal(got, y.scatter(-1, idx, top).float())
    bad = idx.clone()
    bad[2, 3] = 1000
    with pytest.raises(RuntimeError, match="outside"):
        native.rescored_logits(y, bad, top)
