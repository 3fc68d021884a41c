"""Training and evaluating a DLRM: optimizer factories, the training loop (through
`TrainPipeline`, with prefetch of the next batch), held-out evaluation and its metrics.

    data = open_dataset("criteo:train.txt.gz")        # or SyntheticCriteo(...), any ClickDataset
    model = DLRM(data.tables(dim=16), dense_in_features=data.num_dense, ...)
    sparse_opt = make_sparse_optimizer("adagrad", model.sparse_arch, lr=0.05)
    dense_opt = make_dense_optimizer("adagrad", model.dense_parameters(), lr=0.01)
    result = train(model, data.train_batches(), sparse_opt, dense_opt, steps=800, prefetch=True,
                   evaluate_every=200, held_out=lambda: data.eval_batches(20))
    metrics = evaluate(model, data.eval_batches())    # AUC and log loss on the held-out split

AUC is torchmetrics' ``binary_auroc`` and log loss torch's binary cross-entropy (on logits),
both over every held-out sample at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from embcache.data.batch import Batch
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
    return SPARSE_OPTIMIZERS[name](modules, lr=lr)


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


# ----------------------------------------------------------------------------------------------
# metrics and evaluation


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC (torchmetrics' ``binary_auroc``; NaN when one class is absent or torchmetrics is
    not installed) and log loss (mean binary cross-entropy of the logits) of 0/1 ``labels``.

    Args:
        logits: ``[n]`` scores before the sigmoid.
        labels: ``[n]`` 0 or 1.
    """
    logits = logits.detach().float().reshape(-1).cpu()
    labels = labels.detach().reshape(-1).cpu()
    out = {
        "logloss": float(functional.binary_cross_entropy_with_logits(logits, labels.float())),
        "auc": float("nan"),
        "samples": float(labels.numel()),
    }
    positives = int((labels > 0.5).sum())
    if 0 < positives < labels.numel():
        try:
            from torchmetrics.functional.classification import binary_auroc
        except ImportError:  # as on a GPU image without it: the summary says so
            return out
        out["auc"] = float(binary_auroc(torch.sigmoid(logits), labels.long()))
    return out


@torch.no_grad()
def evaluate(model: DLRM, batches: Iterable[Batch]) -> dict[str, float]:
    """AUC, log loss and sample count of ``model`` over ``batches`` (the held-out split)."""
    was_training = model.training
    model.eval()
    logits, labels = [], []
    try:
        for batch in batches:
            batch = batch.to(model.device)
            logits.append(model(batch.dense_features, batch.sparse_features).float().cpu())
            labels.append(batch.labels.cpu())
    finally:
        model.train(was_training)
    if not labels:
        raise ValueError("evaluate: the held-out split gave no batch")
    return binary_metrics(torch.cat(logits), torch.cat(labels))


# ----------------------------------------------------------------------------------------------
# training


@dataclass
class TrainResult:
    """What a training run measured (training phase only, evaluations excluded).

    Attributes:
        losses: training loss per step.
        hit_rates: per step: hits / lookups of that step's unique ids.
        seconds: wall time of the training steps (evaluations during the run excluded).
        samples: training samples seen.
        cache_stats: the collection's counters over the training steps alone.
        io_stats: the tier's traffic over the run (None when it keeps none).
        evals: ``{"step", "auc", "logloss", "samples"}`` of each evaluation during the run.
        eval: the final evaluation (set by the caller).
    """

    losses: list[float]
    hit_rates: list[float]
    seconds: float
    samples: int
    cache_stats: dict[str, float]
    io_stats: dict[str, int] | None
    evals: list[dict[str, float]] = field(default_factory=list)
    eval: dict[str, float] = field(default_factory=dict)

    def loss_window(self, last: bool) -> float:
        """Mean loss over the first (or last) 10% of steps (at least one step)."""
        k = max(1, len(self.losses) // 10)
        window = self.losses[-k:] if last else self.losses[:k]
        return sum(window) / len(window)


def _stat_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in ("hits", "misses", "evictions", "writebacks")}


def train(
    model: DLRM,
    batches: Iterable[Batch],
    sparse_opt: Any,
    dense_opt: torch.optim.Optimizer,
    steps: int,
    prefetch: bool,
    progress: bool = True,
    wrapper: nn.Module | None = None,
    evaluate_every: int = 0,
    held_out: Callable[[], Iterable[Batch]] | None = None,
) -> TrainResult:
    """Train ``model`` on the first ``steps`` of ``batches``.

    Args:
        model: the DLRM.
        batches: training batches (CPU); each goes to ``model.device``.
        sparse_opt, dense_opt: the embcache and torch optimizers.
        steps: training steps.
        prefetch: resolve batch i+1 on a worker thread while batch i trains.
        progress: a tqdm bar with loss, samples/s and hit rate.
        wrapper: forwards go through it when given (DistributedDataParallel).
        evaluate_every: evaluate on ``held_out()`` every that many steps (0: never); the
            lookups of those evaluations are left out of the result's cache stats.
        held_out: the held-out batches, a fresh iterable per call.
    """
    from tqdm import tqdm

    if evaluate_every and held_out is None:
        raise ValueError("train: evaluate_every needs held_out")
    ebc = model.sparse_arch
    ebc.reset_stats()
    store = ebc.store
    store.reset_io_stats()
    device = model.device
    hit_rates: list[float] = []
    evals: list[dict[str, float]] = []
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
    outside = dict.fromkeys(("hits", "misses", "evictions", "writebacks"), 0)  # evaluations
    recent_losses: list[float] = []
    seen = [0]
    paused = [0.0]

    losses: list[float] = []

    def on_step(step_in_run: int, loss: torch.Tensor) -> None:
        i = len(losses) + step_in_run
        after = ebc.cache_stats()
        if after["hits"] + after["misses"] > before[0]["hits"] + before[0]["misses"]:
            hit_rates.append(_hit_rate(before[0], after))  # the last step has no prefetch
        before[0] = after
        recent_losses.append(float(loss))
        bar.update(1)
        if progress and (i % 10 == 0 or i == steps):
            elapsed = time.perf_counter() - start - paused[0]
            recent = hit_rates[-50:] or [0.0]
            bar.set_postfix(
                loss=f"{sum(recent_losses[-10:]) / len(recent_losses[-10:]):.4f}",
                samples_s=f"{seen[0] / elapsed:,.0f}",
                hit_rate=f"{sum(recent) / len(recent):.3f}",
                **({"auc": f"{evals[-1]['auc']:.4f}"} if evals else {}),
                refresh=False,
            )

    def to_device(source: Iterable[Batch]) -> Iterator[Batch]:
        for batch in source:
            seen[0] += batch.labels.numel()
            yield batch.to(device)

    start = time.perf_counter()
    stream = to_device(batches)
    while len(losses) < steps:
        # Up to the next evaluation: the pipeline stops without a prefetch in flight, so the
        # evaluation's lookups are its own (and each batch is still resolved once).
        run = min(evaluate_every or steps, steps - len(losses))
        done = pipe.run(stream, max_steps=run, on_step=on_step)
        losses += done
        if len(done) < run:
            raise ValueError(f"train: the batches ran out after {len(losses)} of {steps} steps")
        if evaluate_every and len(losses) < steps:
            t0 = time.perf_counter()
            evals.append({"step": float(len(losses)), **evaluate(model, held_out())})
            now = ebc.cache_stats()
            for k, v in _stat_delta(now, before[0]).items():
                outside[k] += v
            before[0] = now
            paused[0] += time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start - paused[0]
    bar.close()
    stats = ebc.cache_stats()
    for k, v in outside.items():
        stats[k] -= v
    looked_up = stats["hits"] + stats["misses"]
    stats["hit_rate"] = stats["hits"] / looked_up if looked_up else 0.0
    return TrainResult(
        losses=losses,
        hit_rates=hit_rates,
        seconds=seconds,
        samples=seen[0],
        cache_stats=stats,
        io_stats=store.io_stats() or None,
        evals=evals,
    )


def _hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    hits = after["hits"] - before["hits"]
    looked_up = hits + after["misses"] - before["misses"]
    return hits / looked_up if looked_up else 0.0
