"""Training and evaluating a DLRM (or a `SequenceRecommender`): optimizer factories, the
training loop (through `TrainPipeline`, with prefetch of the next batch), held-out evaluation
and its metrics.

    data = open_dataset("criteo:train.txt.gz")        # or SyntheticCriteo(...), any ClickDataset
    model = DLRM(data.tables(dim=16), dense_in_features=data.num_dense, ...)
    sparse_opt = make_sparse_optimizer("adagrad", model.sparse_arch, lr=0.05)
    dense_opt = make_dense_optimizer("adagrad", model.dense_parameters(), lr=0.01)
    result = train(model, data.train_batches(), sparse_opt, dense_opt, steps=800, prefetch=True,
                   evaluate_every=200, held_out=lambda: data.eval_batches(20))
    metrics = evaluate(model, data.eval_batches())    # AUC and log loss on the held-out split

A model is one with the DLRM's surface (`Model`): ``model(dense, sparse) -> logits [B]``,
``loss``, ``device``, ``dense_parameters()`` and a ``sparse_arch`` whose cache counters the
loop reads; each of its cached collections (the DLRM's one, a `SequenceRecommender`'s bags and
sequences) is given the batch's whole sparse input, and reads its own features from it.

AUC (exact, by ranks: `embcache.train.metrics.binary_auc`) and log loss (torch's binary
cross-entropy on logits) are computed over every held-out sample at once.

While the progress bar shows, warnings and the ``embcache`` loggers' records print above it
(one line each, no source line), and the first compilation of embcache's numba kernels (not
a load from numba's disk cache) says so ("compiling CPU kernels"), then how long the first step
took; the bar's rate and ETA leave that step out.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import embcache.native as native
import embcache.optim
from embcache.data.batch import Batch
from embcache.engine.interface import CachedCollectionInterface
from embcache.kernels.optim_rules import RULES, by_cli
from embcache.models.dlrm import DLRM
from embcache.models.sequence_model import SequenceRecommender
from embcache.optim.sparse import SparseOptimizer
from embcache.train.metrics import binary_metrics
from embcache.train.pipeline import TrainPipeline

SPARSE_OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    s.cli: getattr(embcache.optim, s.sparse_class) for s in RULES.values()
}
"""The sparse optimizer of each CLI name (`kernels.optim_rules.RULES`: ``cli``,
``sparse_class``)."""

Model = DLRM | SequenceRecommender


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
    """The ``torch.optim`` optimizer matching a sparse rule for the dense parameters (the
    rule's ``dense_class``: SGD for "sgd", Adagrad for both AdaGrad rules, Adam for "adam",
    AdamW for "adamw")."""
    path = by_cli(name).dense_class
    assert path.startswith("torch.optim."), path
    return getattr(torch.optim, path.rpartition(".")[2])(list(params), lr=lr)


# ----------------------------------------------------------------------------------------------
# metrics and evaluation


@torch.no_grad()
def evaluate(model: Model, batches: Iterable[Batch]) -> dict[str, float]:
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
        stopped_early: the run ended before its steps (``early_stop`` evaluations in a row
            without a better AUC).
        compile_seconds: the first step's seconds, when numba compiled kernels in it (None:
            nothing compiled).
        interrupted: the run ended before its steps because ``stop()`` said so (a signal).
        kept_step: set by the caller when it kept the model of an earlier evaluation (the
            best) in place of the last one: that evaluation's step.
    """

    losses: list[float]
    hit_rates: list[float]
    seconds: float
    samples: int
    cache_stats: dict[str, float]
    io_stats: dict[str, int] | None
    evals: list[dict[str, float]] = field(default_factory=list)
    eval: dict[str, float] = field(default_factory=dict)
    stopped_early: bool = False
    compile_seconds: float | None = None
    interrupted: bool = False
    kept_step: int | None = None

    def best_eval(self) -> dict[str, float] | None:
        """The evaluation with the best AUC (the lowest log loss where AUC is NaN), the
        final one included (at the last step), the earliest of equals; None without any."""
        evals = list(self.evals)
        if self.eval:
            evals.append({**self.eval, "step": float(len(self.losses))})
        return max(evals, key=_score, default=None)

    def loss_window(self, last: bool) -> float:
        """Mean loss over the first (or last) 10% of steps (at least one step)."""
        k = max(1, len(self.losses) // 10)
        window = self.losses[-k:] if last else self.losses[:k]
        return sum(window) / len(window)


def _score(e: dict[str, float]) -> tuple[float, float]:
    """What makes one evaluation better than another: AUC, then log loss."""
    auc = e["auc"]
    return (-math.inf if math.isnan(auc) else auc, -e["logloss"])


@contextmanager
def _above(bar: Any, active: bool) -> Iterator[None]:
    """While ``active``: warnings and the ``embcache`` loggers' records are written above
    ``bar`` (tqdm's ``write``), one line each (no source line: the CLI's user wrote none of
    the code on the stack)."""
    if not active:
        yield
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        bar.write(f"warning: {category.__name__}: {message}", file=sys.stderr)

    class _Above(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            bar.write(self.format(record), file=sys.stderr)

    logger = logging.getLogger("embcache")
    handler = None if logger.hasHandlers() else _Above(logging.WARNING)
    warnings.showwarning = show
    if handler is not None:
        logger.addHandler(handler)
    try:
        yield
    finally:
        warnings.showwarning = shown
        if handler is not None:
            logger.removeHandler(handler)


def _stat_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in ("hits", "misses", "evictions", "writebacks")}


def train(
    model: Model,
    batches: Iterable[Batch],
    sparse_opt: Any,
    dense_opt: torch.optim.Optimizer,
    steps: int,
    prefetch: bool,
    progress: bool = True,
    wrapper: nn.Module | None = None,
    evaluate_every: int = 0,
    held_out: Callable[[], Iterable[Batch]] | None = None,
    early_stop: int = 0,
    stop: Callable[[], bool] | None = None,
    checkpoint_every: int = 0,
    on_checkpoint: Callable[[int], None] | None = None,
    on_best: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train ``model`` on the first ``steps`` of ``batches``.

    Args:
        model: the DLRM or `SequenceRecommender`.
        batches: training batches (CPU); each goes to ``model.device``.
        sparse_opt, dense_opt: the embcache and torch optimizers.
        steps: training steps.
        prefetch: resolve batch i+1 on a worker thread while batch i trains.
        progress: a tqdm bar with loss, samples/s and hit rate.
        wrapper: forwards go through it when given (DistributedDataParallel).
        evaluate_every: evaluate on ``held_out()`` every that many steps (0: never); the
            lookups of those evaluations are left out of the result's cache stats.
        held_out: the held-out batches, a fresh iterable per call.
        early_stop: with ``evaluate_every``, stop after that many evaluations in a row
            without a better AUC (0: never).
        stop: asked before each batch is taken; True ends the run after the steps already
            begun (the batch in flight, and one prefetched), with ``interrupted`` set. The
            same number of calls on every rank (it may be a collective).
        checkpoint_every: call ``on_checkpoint(steps_done_in_this_run)`` every that many
            steps (not after the last: the caller saves at the end), between steps, with no
            prefetch in flight.
        on_best: called as ``on_best(steps_done_in_this_run)`` after each evaluation during
            the run that is better than every one before it (with no prefetch in flight), so
            that the caller can keep that model (early stopping keeps the best, not the last).
    """
    from tqdm import tqdm

    if evaluate_every and held_out is None:
        raise ValueError("train: evaluate_every needs held_out")
    if early_stop and not evaluate_every:
        raise ValueError("train: early_stop counts evaluations: it needs evaluate_every")
    ebc = model.sparse_arch
    ebc.reset_stats()
    store = ebc.store
    store.reset_io_stats()
    device = model.device
    hit_rates: list[float] = []
    evals: list[dict[str, float]] = []
    bar = tqdm(total=steps, unit="step", disable=not progress, dynamic_ncols=True, leave=True)
    model.train()
    collections = sum(isinstance(m, CachedCollectionInterface) for m in model.modules())
    pipe = TrainPipeline(
        wrapper if wrapper is not None else model,
        sparse_opt,
        dense_opt,
        features=lambda batch: [batch.sparse_features] * collections,
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
    compiled: list[float] = []  # when the first compilation started, then the first step's s
    after_first = [0.0, 0]  # time and samples seen at the end of the run's first step

    losses: list[float] = []

    def on_step(step_in_run: int, loss: torch.Tensor) -> None:
        i = len(losses) + step_in_run
        after = ebc.cache_stats()
        if after["hits"] + after["misses"] > before[0]["hits"] + before[0]["misses"]:
            hit_rates.append(_hit_rate(before[0], after))  # the last step has no prefetch
        before[0] = after
        recent_losses.append(float(loss))
        if i == 1:  # the rate and ETA start after the first step (compilation, warm-up)
            now = time.perf_counter()
            after_first[:] = [now, seen[0]]
            if compiled:
                compiled[0] = now - start
                if progress:
                    bar.write(
                        f"compiled CPU kernels: the first step took {compiled[0]:.1f} s",
                        file=sys.stderr,
                    )
            bar.reset()
            bar.initial = bar.n = bar.last_print_n = 1
            bar.refresh()
        else:
            bar.update(1)
        if progress and i > 1 and (i % 10 == 0 or i == steps):
            elapsed = time.perf_counter() - after_first[0] - paused[0]
            recent = hit_rates[-50:] or [0.0]
            bar.set_postfix(
                loss=f"{sum(recent_losses[-10:]) / len(recent_losses[-10:]):.4f}",
                samples_s=f"{(seen[0] - after_first[1]) / elapsed:,.0f}",
                hit_rate=f"{sum(recent) / len(recent):.3f}",
                **({"auc": f"{evals[-1]['auc']:.4f}"} if evals else {}),
                refresh=False,
            )

    interrupted = [False]

    def to_device(source: Iterable[Batch]) -> Iterator[Batch]:
        for batch in _until(source, stop, interrupted):
            seen[0] += batch.labels.numel()
            yield batch.to(device)

    def compiling() -> None:  # numba starts compiling a kernel (on any thread)
        if not compiled:
            compiled.append(0.0)
            if progress:
                bar.write("compiling CPU kernels (once, cached)...", file=sys.stderr)

    start = time.perf_counter()
    stream = to_device(batches)
    stopped_early, since_best = False, 0
    with native.on_compile(compiling), _above(bar, progress):
        while len(losses) < steps:
            # Up to the next evaluation: the pipeline stops without a prefetch in flight, so
            # the evaluation's lookups are its own (and each batch is still resolved once).
            run = min(evaluate_every or steps, steps - len(losses))
            if checkpoint_every:
                run = min(run, checkpoint_every - len(losses) % checkpoint_every)
            done = pipe.run(stream, max_steps=run, on_step=on_step)
            losses += done
            if interrupted[0]:
                break
            if len(done) < run:
                raise ValueError(f"train: the batches ran out after {len(losses)} of {steps} steps")
            at_checkpoint = checkpoint_every and len(losses) % checkpoint_every == 0
            if at_checkpoint and on_checkpoint is not None and len(losses) < steps:
                on_checkpoint(len(losses))
            if evaluate_every and len(losses) < steps and len(losses) % evaluate_every == 0:
                t0 = time.perf_counter()
                evals.append({"step": float(len(losses)), **evaluate(model, held_out())})
                now = ebc.cache_stats()
                for k, v in _stat_delta(now, before[0]).items():
                    outside[k] += v
                before[0] = now
                paused[0] += time.perf_counter() - t0
                best = max(evals, key=_score)
                since_best = 0 if best is evals[-1] else since_best + 1
                if best is evals[-1] and on_best is not None:
                    t0 = time.perf_counter()
                    on_best(len(losses))
                    paused[0] += time.perf_counter() - t0
                if early_stop and since_best >= early_stop:
                    stopped_early = True
                    if progress:
                        bar.write(
                            f"early stop at step {len(losses)}: {early_stop} evaluations "
                            f"without a better AUC than step {int(best['step'])}'s "
                            f"{best['auc']:.4f}"
                        )
                    break
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
        stopped_early=stopped_early,
        compile_seconds=compiled[0] if compiled else None,
        interrupted=interrupted[0],
    )


def _until(
    source: Iterable[Batch], stop: Callable[[], bool] | None, stopped: list[bool]
) -> Iterator[Batch]:
    """``source``'s batches while ``stop()`` is False; ``stopped[0]`` tells why it ended."""
    it = iter(source)
    while True:
        if stop is not None and stop():
            stopped[0] = True
            return
        try:
            yield next(it)
        except StopIteration:
            return


def _hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    hits = after["hits"] - before["hits"]
    looked_up = hits + after["misses"] - before["misses"]
    return hits / looked_up if looked_up else 0.0
