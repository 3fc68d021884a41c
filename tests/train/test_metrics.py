"""`binary_auc`, the held-out AUC without torchmetrics: against every-pair counting in float64
and, where it is installed, torchmetrics' ``binary_auroc``, on scores with many ties."""

from __future__ import annotations

import math

import pytest
import torch

from embcache.train.metrics import binary_auc, binary_metrics
from tests.train.test_loop import reference_auc


def _case(n: int, ties: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=gen) < 0.3).float()
    labels[:2] = torch.tensor([1.0, 0.0])  # both classes
    if ties:
        scores = torch.randint(-2, 3, (n,), generator=gen).float()
    else:
        scores = torch.randn(n, generator=gen)
    return scores, labels


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
@pytest.mark.parametrize("n", [2, 5, 123, 4097], ids=lambda n: f"n{n}")
def test_auc_is_exact(n: int, ties: bool) -> None:
    scores, labels = _case(n, ties, seed=n)
    assert binary_auc(scores, labels) == pytest.approx(reference_auc(scores, labels), abs=1e-12)


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
@pytest.mark.parametrize("n", [7, 1000], ids=lambda n: f"n{n}")
def test_auc_equals_torchmetrics(n: int, ties: bool) -> None:
    classification = pytest.importorskip("torchmetrics.functional.classification")
    scores, labels = _case(n, ties, seed=n + 1)
    expected = float(classification.binary_auroc(scores.double(), labels.long()))
    assert binary_auc(scores, labels) == pytest.approx(expected, abs=1e-6)  # its float32


def test_edge_cases() -> None:
    assert binary_auc(torch.zeros(4), torch.tensor([0.0, 1.0, 0.0, 1.0])) == 0.5  # all tied
    assert binary_auc(torch.arange(4.0), torch.tensor([1.0, 1.0, 0.0, 0.0])) == 0.0
    assert math.isnan(binary_auc(torch.randn(3), torch.ones(3)))
    assert math.isnan(binary_metrics(torch.randn(3), torch.zeros(3))["auc"])
