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
    if evaluate_every and held_out is None:
        raise ValueError("train: evaluate_every needs held_out")
    if early_stop and not evaluate_every:
        raise ValueError("train: early_stop counts evaluations: it needs evaluate_every")
    run = _Run(model, steps, progress, stop)
    model.train()
    pipe = _pipeline(model, wrapper, sparse_opt, dense_opt, prefetch)
    stream = run.start(batches)
    with native.on_compile(run.compiling), _above(run.bar, progress):
        while len(run.losses) < steps:
            if not run.train_until_pause(pipe, stream, evaluate_every, checkpoint_every):
                break  # stop() said so
            done = len(run.losses)
            at_checkpoint = checkpoint_every and done % checkpoint_every == 0
            if at_checkpoint and on_checkpoint is not None and done < steps:
                on_checkpoint(done)
            if evaluate_every and done < steps and done % evaluate_every == 0:
                assert held_out is not None  # checked above
                if run.evaluate_during_run(held_out, on_best, early_stop):
                    break  # early stop
    return run.result()


def _pipeline(
    model: Model,
    wrapper: nn.Module | None,
    sparse_opt: Any,
    dense_opt: torch.optim.Optimizer,
    prefetch: bool,
) -> TrainPipeline:
    """The `TrainPipeline` that trains ``model``: forwards through ``wrapper`` when given,
    each cached collection given the batch's whole sparse input."""
    collections = sum(isinstance(m, CachedCollectionInterface) for m in model.modules())
    return TrainPipeline(
        wrapper if wrapper is not None else model,
        sparse_opt,
        dense_opt,
        features=lambda batch: [batch.sparse_features] * collections,
        loss=lambda m, batch: model.loss(
            m(batch.dense_features, batch.sparse_features), batch.labels
        ),
        prefetch=prefetch,
    )


class _Run:
    """One `train` call as it goes: the progress bar and the counters each step updates
    (`on_step`), the evaluations during the run, and the seconds they and ``on_best`` took,
    which the run's seconds and its samples/s leave out (as the cache stats leave out the
    evaluations' lookups).

    Opening one resets the collection's cache stats and the tier's traffic counters.
    """

    def __init__(
        self, model: Model, steps: int, progress: bool, stop: Callable[[], bool] | None
    ) -> None:
        from tqdm import tqdm

        self.model = model
        self.ebc = model.sparse_arch
        self.ebc.reset_stats()
        self.store = self.ebc.store
        self.store.reset_io_stats()
        self.device = model.device
        self.steps = steps
        self.progress = progress
        self.stop = stop
        self.losses: list[float] = []
        self.hit_rates: list[float] = []
        self.evals: list[dict[str, float]] = []
        self.bar = tqdm(
            total=steps, unit="step", disable=not progress, dynamic_ncols=True, leave=True
        )
        # Per-step hit rate: the lookups between two steps (with prefetch, the next batch's).
        self.before: dict[str, float] = {}  # the stats after the last step (`start` sets them)
        # The evaluations' lookups, which the result's stats leave out.
        self.outside = dict.fromkeys(("hits", "misses", "evictions", "writebacks"), 0)
        self.recent_losses: list[float] = []
        self.seen = 0  # samples taken from the batches
        self.paused = 0.0
        # When the first compilation started, then the first step's seconds.
        self.compiled: list[float] = []
        self.after_first = (0.0, 0)  # time and samples seen at the end of the run's first step
        self.started = 0.0
        self.stopped = [False]  # `_until` sets it when stop() ends the run
        self.stopped_early = False
        self.since_best = 0  # evaluations since the best one

    @property
    def interrupted(self) -> bool:
        """Whether ``stop()`` ended the run."""
        return self.stopped[0]

    def start(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """The clock started and the stats taken; returns the batches as the steps take them
        (on the model's device, until ``stop()`` says so)."""
        self.before = self.ebc.cache_stats()
        self.started = time.perf_counter()
        return self._to_device(batches)

    def _to_device(self, source: Iterable[Batch]) -> Iterator[Batch]:
        for batch in _until(source, self.stop, self.stopped):
            self.seen += batch.labels.numel()
            yield batch.to(self.device)

    def compiling(self) -> None:
        """numba starts compiling a kernel (on any thread)."""
        if not self.compiled:
            self.compiled.append(0.0)
            if self.progress:
                self.bar.write("compiling CPU kernels (once, cached)...", file=sys.stderr)

    def train_until_pause(
        self,
        pipe: TrainPipeline,
        stream: Iterator[Batch],
        evaluate_every: int,
        checkpoint_every: int,
    ) -> bool:
        """Train up to the next evaluation or checkpoint (or the last step): the pipeline stops
        without a prefetch in flight, so the evaluation's lookups are its own (and each batch
        is still resolved once). Returns False when ``stop()`` ended the run.

        Raises:
            ValueError: the batches ran out first.
        """
        steps = self.steps
        run = min(evaluate_every or steps, steps - len(self.losses))
        if checkpoint_every:
            run = min(run, checkpoint_every - len(self.losses) % checkpoint_every)
        done = pipe.run(stream, max_steps=run, on_step=self.on_step)
        self.losses += done
        if self.interrupted:
            return False
        if len(done) < run:
            raise ValueError(
                f"train: the batches ran out after {len(self.losses)} of {steps} steps"
            )
        return True

    def on_step(self, step_in_run: int, loss: torch.Tensor) -> None:
        """After each step: its hit rate and loss recorded, the bar moved on."""
        i = len(self.losses) + step_in_run
        after = self.ebc.cache_stats()
        if after["hits"] + after["misses"] > self.before["hits"] + self.before["misses"]:
            self.hit_rates.append(_hit_rate(self.before, after))  # the last step has no prefetch
        self.before = after
        self.recent_losses.append(float(loss))
        if i == 1:  # the rate and ETA start after the first step (compilation, warm-up)
            now = time.perf_counter()
            self.after_first = (now, self.seen)
            if self.compiled:
                self.compiled[0] = now - self.started
                if self.progress:
                    self.bar.write(
                        f"compiled CPU kernels: the first step took {self.compiled[0]:.1f} s",
                        file=sys.stderr,
                    )
            self.bar.reset()
            self.bar.initial = self.bar.n = self.bar.last_print_n = 1
            self.bar.refresh()
        else:
            self.bar.update(1)
        if self.progress and i > 1 and (i % 10 == 0 or i == self.steps):
            self._show_rates()

    def _show_rates(self) -> None:
        """The bar's loss (last 10 steps), samples/s, hit rate (last 50) and latest AUC."""
        elapsed = time.perf_counter() - self.after_first[0] - self.paused
        recent = self.hit_rates[-50:] or [0.0]
        recent_losses = self.recent_losses[-10:]
        self.bar.set_postfix(
            loss=f"{sum(recent_losses) / len(recent_losses):.4f}",
            samples_s=f"{(self.seen - self.after_first[1]) / elapsed:,.0f}",
            hit_rate=f"{sum(recent) / len(recent):.3f}",
            **({"auc": f"{self.evals[-1]['auc']:.4f}"} if self.evals else {}),
            refresh=False,
        )

    def evaluate_during_run(
        self,
        held_out: Callable[[], Iterable[Batch]],
        on_best: Callable[[int], None] | None,
        early_stop: int,
    ) -> bool:
        """An evaluation between two steps, its lookups and its time left out of the run's;
        ``on_best`` called when it is the best so far. Returns True when it is the
        ``early_stop``-th in a row without a better AUC: the run stops early."""
        steps_done = len(self.losses)
        t0 = time.perf_counter()
        self.evals.append({"step": float(steps_done), **evaluate(self.model, held_out())})
        now = self.ebc.cache_stats()
        for k, v in _stat_delta(now, self.before).items():
            self.outside[k] += v
        self.before = now
        self.paused += time.perf_counter() - t0
        best = max(self.evals, key=_score)
        self.since_best = 0 if best is self.evals[-1] else self.since_best + 1
        if best is self.evals[-1] and on_best is not None:
            t0 = time.perf_counter()
            on_best(steps_done)
            self.paused += time.perf_counter() - t0
        if early_stop and self.since_best >= early_stop:
            self.stopped_early = True
            if self.progress:
                self.bar.write(
                    f"early stop at step {steps_done}: {early_stop} evaluations "
                    f"without a better AUC than step {int(best['step'])}'s "
                    f"{best['auc']:.4f}"
                )
            return True
        return False

    def result(self) -> TrainResult:
        """What the run measured, its bar closed."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self.started - self.paused
        self.bar.close()
        stats = self.ebc.cache_stats()
        for k, v in self.outside.items():
            stats[k] -= v
        looked_up = stats["hits"] + stats["misses"]
        stats["hit_rate"] = stats["hits"] / looked_up if looked_up else 0.0
        return TrainResult(
            losses=self.losses,
            hit_rates=self.hit_rates,
            seconds=seconds,
            samples=self.seen,
            cache_stats=stats,
            io_stats=self.store.io_stats() or None,
            evals=self.evals,
            stopped_early=self.stopped_early,
            compile_seconds=self.compiled[0] if self.compiled else None,
            interrupted=self.interrupted,
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
