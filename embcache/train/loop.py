"""Training and evaluating a DLRM: optimizer factories, the training loop (through
`TrainPipeline`, with prefetch of the next batch), held-out evaluation and its metrics.

    model = DLRM(data.tables(dim=16), cache=CacheConfig(load_factor=0.1))
    sparse_opt = make_sparse_optimizer("adagrad", model.sparse_arch, lr=0.05)
    dense_opt = make_dense_optimizer("adagrad", model.dense_parameters(), lr=0.01)
    result = train(model, data, sparse_opt, dense_opt, steps=800, prefetch=True)
    metrics = evaluate(model, data, num_batches=20)     # AUC and logloss on held-out batches
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from embcache.data.synthetic import SyntheticCriteo
from embcache.models.dlrm import DLRM
from embcache.optim.sparse import (
    SparseAdaGrad,
    SparseAdam,
    SparseOptimizer,
    SparseRowWiseAdaGrad,
    SparseSGD,
)
from embcache.train.pipeline import TrainPipeline

SPARSE_OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    "sgd": SparseSGD,
    "adagrad": SparseAdaGrad,
    "rowwise_adagrad": SparseRowWiseAdaGrad,
    "adam": SparseAdam,
}


def make_sparse_optimizer(
    name: str, modules: nn.Module | Sequence[nn.Module], lr: float
) -> SparseOptimizer:
    """The embcache sparse optimizer called ``name`` (a key of `SPARSE_OPTIMIZERS`)."""
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(
            f"unknown sparse optimizer {name!r}; choose from {list(SPARSE_OPTIMIZERS)}"
        )
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    return SPARSE_OPTIMIZERS[name](mods, lr=lr)


def make_dense_optimizer(
    name: str, params: Iterator[nn.Parameter] | list[nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer matching a sparse rule for the dense parameters
    (SGD for "sgd", Adagrad for both AdaGrad rules, Adam for "adam")."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name in ("adagrad", "rowwise_adagrad"):
        return torch.optim.Adagrad(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose from {list(SPARSE_OPTIMIZERS)}")


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for 0/1 ``labels`` (Mann-Whitney U over ranks;
    tied scores share their mean rank). NaN when one class is absent."""
    scores = scores.detach().double().reshape(-1).cpu()
    positive = labels.detach().reshape(-1).cpu() > 0.5
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_scores, order = torch.sort(scores)
    _, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # 1-based rank of each tie group's last member
    mean_rank = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(scores)
    ranks[order] = torch.repeat_interleave(mean_rank, counts)
    u = float(ranks[positive].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


# ----------------------------------------------------------------------------------------------
# training and evaluation on the synthetic data


@dataclass
class TrainResult:
    """What a training run measured (training phase only, evaluation excluded)."""

    losses: list[float]
    hit_rates: list[float]  # per step: hits / lookups of that step's unique ids
    seconds: float
    samples: int
    cache_stats: dict[str, float]
    io_stats: dict[str, int] | None
    eval: dict[str, float] = field(default_factory=dict)

    def loss_window(self, last: bool) -> float:
        """Mean loss over the first (or last) 10% of steps (at least one step)."""
        k = max(1, len(self.losses) // 10)
        window = self.losses[-k:] if last else self.losses[:k]
        return sum(window) / len(window)


def train(
    model: DLRM,
    data: SyntheticCriteo,
    sparse_opt: Any,
    dense_opt: torch.optim.Optimizer,
    steps: int,
    prefetch: bool,
    progress: bool = True,
    first_step: int = 0,
    wrapper: nn.Module | None = None,
) -> TrainResult:
    """Train ``model`` on batches ``first_step .. first_step + steps - 1`` of ``data``'s
    training split; forwards go through ``wrapper`` when given (DistributedDataParallel)."""
    from tqdm import tqdm

    ebc = model.sparse_arch
    ebc.reset_stats()
    store = ebc.store
    store.reset_io_stats()
    device = model.device
    hit_rates: list[float] = []
    bar = tqdm(total=steps, unit="step", disable=not progress, dynamic_ncols=True, leave=True)
    model.train()
    pipe = TrainPipeline(
        wrapper if wrapper is not None else model,
        sparse_opt,
        dense_opt,
        features=lambda batch: batch.sparse_features,
        loss=lambda m, batch: model.loss(
            m(batch.dense_features, batch.sparse_features), batch.labels
        ),
        prefetch=prefetch,
    )
    # Per-step hit rate: the lookups between two steps (with prefetch, the next batch's).
    before = [ebc.cache_stats()]
    recent_losses: list[float] = []

    def on_step(i: int, loss: torch.Tensor) -> None:
        after = ebc.cache_stats()
        if after["hits"] + after["misses"] > before[0]["hits"] + before[0]["misses"]:
            hit_rates.append(_hit_rate(before[0], after))  # the last step has no prefetch
        before[0] = after
        recent_losses.append(float(loss))
        bar.update(1)
        if progress and (i % 10 == 0 or i == steps):
            elapsed = time.perf_counter() - start
            recent = hit_rates[-50:] or [0.0]
            bar.set_postfix(
                loss=f"{sum(recent_losses[-10:]) / len(recent_losses[-10:]):.4f}",
                samples_s=f"{i * data.config.batch_size / elapsed:,.0f}",
                hit_rate=f"{sum(recent) / len(recent):.3f}",
                refresh=False,
            )

    start = time.perf_counter()
    batches = (data.batch(first_step + i).to(device) for i in range(steps))
    losses = pipe.run(batches, on_step=on_step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    bar.close()
    io = store.io_stats() or None
    return TrainResult(
        losses=losses,
        hit_rates=hit_rates,
        seconds=seconds,
        samples=steps * data.config.batch_size,
        cache_stats=ebc.cache_stats(),
        io_stats=io,
    )


def _hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    hits = after["hits"] - before["hits"]
    looked_up = hits + after["misses"] - before["misses"]
    return hits / looked_up if looked_up else 0.0


@torch.no_grad()
def evaluate(model: DLRM, data: SyntheticCriteo, num_batches: int) -> dict[str, float]:
    """AUC and logloss of ``model`` on the held-out split, and the hidden model's AUC."""
    model.eval()
    logits, labels, hidden = [], [], []
    for i in range(num_batches):
        batch = data.batch(i, split="eval").to(model.device)
        logits.append(model(batch.dense_features, batch.sparse_features).float().cpu())
        labels.append(batch.labels.cpu())
        hidden.append(data.hidden_logits(i, split="eval"))
    model.train()
    y = torch.cat(labels)
    p = torch.cat(logits)
    return {
        "auc": roc_auc(p, y),
        "logloss": float(DLRM.loss(p, y)),
        "hidden_auc": roc_auc(torch.cat(hidden), y),
        "samples": float(y.numel()),
    }
