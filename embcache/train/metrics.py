"""Held-out metrics of a click model: AUC (exact, by ranks, ties counted half) and log loss.

    metrics = binary_metrics(logits, labels)   # {"auc": ..., "logloss": ..., "samples": ...}

AUC needs nothing beyond torch: torchmetrics' ``binary_auroc`` gives the same number (to float
rounding; `tests/train/test_metrics.py` compares them where it is installed), so a run on a
machine without torchmetrics still reports one.
"""

from __future__ import annotations

import torch
from torch.nn import functional


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the probability that a random positive scores above a random
    negative, a tie counting half (the Mann-Whitney U statistic over ``n_pos * n_neg``).

    With ``r_i`` the rank of sample i among all scores (1-based, tied scores sharing their mean
    rank), ``AUC = (sum_{i positive} r_i - n_pos (n_pos + 1) / 2) / (n_pos n_neg)``, in float64:
    exact for any tie pattern, O(n log n).

    Args:
        scores: ``[n]`` any monotone score (logits or probabilities give the same AUC).
        labels: ``[n]`` 0 or 1 (a label above 0.5 is a positive).

    Returns:
        The AUC, or NaN when one class is absent (it is undefined there).
    """
    scores = scores.detach().reshape(-1).double().cpu()
    positive = labels.detach().reshape(-1).cpu() > 0.5
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ordered, order = torch.sort(scores, stable=True)
    _, group, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()  # the 1-based rank of each tie group's last sample
    mean_rank = last - (counts.double() - 1.0) / 2.0  # [groups]
    positive_ranks = mean_rank[group][positive[order]].sum()
    u = float(positive_ranks) - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC (`binary_auc`; NaN only when one class is absent) and log loss (mean binary
    cross-entropy of the logits) of 0/1 ``labels``, and the number of samples.

    Args:
        logits: ``[n]`` scores before the sigmoid.
        labels: ``[n]`` 0 or 1.
    """
    logits = logits.detach().float().reshape(-1).cpu()
    labels = labels.detach().reshape(-1).cpu()
    return {
        "logloss": float(functional.binary_cross_entropy_with_logits(logits, labels.float())),
        "auc": binary_auc(logits, labels),
        "samples": float(labels.numel()),
    }
