"""What ``embcache train`` shows at the end: the summary table and the loss/hit-rate plot."""

from __future__ import annotations

import math
from argparse import Namespace
from pathlib import Path
from typing import Any

from embcache.cli.settings import (
    DEFAULT_BATCH,
    SMALL_BATCH,
    SMALL_SPLIT_BATCHES,
    batch_rows,
    small_batch_lr,
)
from embcache.data import ClickDataset
from embcache.kv.redact import redact_url
from embcache.train.loop import Model, TrainResult


def write_plot(result: TrainResult, path: Path) -> None:
    """Loss and per-step hit rate against the step, raw and smoothed, and the held-out AUC and
    log loss of each evaluation (``--eval-every``, and the final one; each on a panel of its own,
    a few points labelled with their values), in one PNG."""
    import matplotlib.pyplot as plt

    fig = plot_figure(result)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_figure(result: TrainResult) -> Any:
    """The figure `write_plot` saves (a matplotlib ``Figure``, on the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = list(result.evals)
    if result.eval:
        evals.append({**result.eval, "step": float(len(result.losses))})
    panels = 4 if evals else 2
    window = max(1, len(result.losses) // 50)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.6 * panels), sharex=True)
    for ax, values, name in (
        (axes[0], result.losses, "training loss (BCE)"),
        (axes[1], result.hit_rates, "cache hit rate"),  # steps that looked rows up
    ):
        steps = range(1, len(values) + 1)
        smoothed = window > 1  # under 100 steps the raw curve is the only one, drawn solid
        ax.plot(steps, values, alpha=0.3 if smoothed else 1.0, linewidth=0.8, label="per step")
        if smoothed:
            ax.plot(
                steps,
                _moving_average(values, window),
                linewidth=1.5,
                label=f"mean of {window} steps",
            )
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    axes[1].set_ylim(0, 1.05)  # room above 1.0, where a warm cache's curve runs along the frame
    if evals:
        # Each metric on a panel of its own: on twin axes a single evaluation put both markers
        # at the same spot, one hiding the other. Few points are labelled with their values.
        eval_steps = [e["step"] for e in evals]
        for ax, key, style, color, name in (
            (axes[2], "auc", "o-", "C2", "held-out AUC"),
            (axes[3], "logloss", "s--", "C3", "held-out log loss"),
        ):
            values = [e[key] for e in evals]
            ax.plot(eval_steps, values, style, color=color, label=name)
            if len(evals) <= 12:
                for x, y in zip(eval_steps, values, strict=True):
                    ax.annotate(f"{y:.4f}", (x, y), textcoords="offset points", xytext=(0, 6),
                                ha="center", fontsize=8, color=color)  # fmt: skip
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            ax.margins(y=0.25)  # room for the labels
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    return fig


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def print_summary(
    args: Namespace,
    data: ClickDataset,
    model: Model,
    result: TrainResult,
    lr: float,
    dense_lr: float,
    total_s: float,
    store: str,
    prefetch: bool,
    notes: list[tuple[str, str]] | None = None,
) -> None:
    """The end-of-run table: data, model, cache, optimizer, speed, loss, held-out AUC and log
    loss, cache counters (defined in the README) and tier traffic, then ``notes`` (rows such
    as where a resumed run started and why it stopped)."""
    rows = _setup_rows(args, data, model, result, lr, dense_lr, total_s, store, prefetch)
    rows += _evaluation_rows(args, result)
    rows += _counter_rows(result)
    rows += notes or []
    rows += _output_rows(args)
    width = max(len(k) for k, _ in rows)
    print("\nembcache train: summary")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def _setup_rows(
    args: Namespace,
    data: ClickDataset,
    model: Model,
    result: TrainResult,
    lr: float,
    dense_lr: float,
    total_s: float,
    store: str,
    prefetch: bool,
) -> list[tuple[str, str]]:
    """The summary's first rows: data, the batch (when shrunk to fit), model, cache,
    optimizer, training time and speed, loss."""
    cache = _cache_row(args, data, model, store, prefetch)
    training = _training_time(args, result)
    rows: list[tuple[str, str]] = [
        ("data", data.describe()),
        (
            "model",
            f"{'sequence model' if getattr(args, 'model', 'dlrm') == 'seq' else 'DLRM'} dim "
            f"{args.dim}, {data.num_dense} dense and {len(data.rows)} sparse "
            f"features, {sum(p.numel() for p in model.dense_parameters()):,} dense params, "
            f"device {args.device}",
        ),
        ("cache", cache),
        ("optimizer", _optimizer_row(args, lr, dense_lr)),
        (
            "training",
            f"{training}: {result.samples / result.seconds:,.0f} samples/s ({total_s:.1f} s "
            "with set-up, evaluation and saving)",
        ),
        (
            "loss",
            f"{result.loss_window(last=False):.4f} (first 10% of steps) -> "
            f"{result.loss_window(last=True):.4f} (last 10%)",
        ),
    ]
    batch = _batch_row(args, data)
    if batch:
        rows.insert(1, ("batch", batch))
    return rows


def _optimizer_row(args: Namespace, lr: float, dense_lr: float) -> str:
    """The rule and its learning rates, and when defaults were scaled to a small split's batch
    (`small_batch_lr`), by how much."""
    row = f"{args.optimizer}, lr {lr:g} (sparse), {dense_lr:g} (dense)"
    scale = small_batch_lr(args)
    if scale != 1.0 and (args.lr is None or args.dense_lr is None):
        row += f", the defaults times {SMALL_BATCH}/{DEFAULT_BATCH} for the batch of {SMALL_BATCH}"
    return row


def _batch_row(args: Namespace, data: ClickDataset) -> str | None:
    """The batch's row when it is not --batch-size's default: a small training split's batch
    (`small_split`), or one shrunk to fit the training split; None otherwise."""
    default = getattr(args, "default_batch", data.batch_size)  # before a shrink
    samples = data.train_samples()
    small = (
        f"the default for a training split of fewer than {SMALL_SPLIT_BATCHES * DEFAULT_BATCH:,}"
    )
    if args.batch_size is not None:
        origin = f"--batch-size {default}"
    elif default != DEFAULT_BATCH:
        origin = f"{default}, {small} samples,"
    else:
        origin = f"the default {default}"
    if data.batch_size != default:
        return (
            f"{data.batch_size} samples, shrunk from {origin} to fit the training split "
            f"({samples:,} samples)"
        )
    if args.batch_size is None and default != DEFAULT_BATCH:
        return f"{default} samples, {small} samples (this one: {samples:,})"
    return None


def _cache_row(
    args: Namespace, data: ClickDataset, model: Model, store: str, prefetch: bool
) -> str:
    """The cache's row: its rows (and their share of all), policy, precision, the tier's
    bound, admission, the tier and prefetch."""
    ebc = model.sparse_arch
    unbounded = None in data.rows
    total_rows = 0 if unbounded else sum(data.rows)  # type: ignore[arg-type]
    slots = sum(c.num_slots for c in ebc.caches())
    cached = slots if unbounded else min(slots, total_rows)
    share = "of unbounded tables" if unbounded else f"{cached / total_rows:.1%} of all"
    precision = {"fp32": "", "fp16": ", fp16 weights", "bf16": ", bf16 weights"}
    memory = precision[args.weight_dtype]
    if args.tier_capacity is not None:
        memory += f", tier {args.tier_capacity:,} rows/table ({args.tier_policy.upper()})"
    if args.admit_after is not None:
        memory += f", admit after {args.admit_after}"
    if batch_rows(args, data) is not None:
        share += ", default sized to hold one batch's unique ids"
    return (
        f"{cached:,} rows ({share}), {args.policy.upper()}{memory}, "
        f"store {redact_url(store)}, prefetch {'on' if prefetch else 'off'}"
    )


def _training_time(args: Namespace, result: TrainResult) -> str:
    """The training row's start: steps (as epochs with ``--data``), seconds, compilation."""
    training = f"{len(result.losses)} steps"
    per_epoch = getattr(args, "epoch_batches", None)
    if per_epoch:
        batches = f"{per_epoch:,} batch{'es' if per_epoch != 1 else ''}"
        training += f" ({_epochs(len(result.losses), per_epoch)} of {batches})"
    training += f" in {result.seconds:.1f} s"
    if result.compile_seconds is not None:
        training += f" (the first {result.compile_seconds:.1f} s compiling CPU kernels, once)"
    return training


def _evaluation_rows(args: Namespace, result: TrainResult) -> list[tuple[str, str]]:
    """The held-out metrics, the evaluations during the run and an over-training warning."""
    rows: list[tuple[str, str]] = []
    if result.eval:
        e = result.eval
        auc = f"AUC {_auc(e['auc'])}"
        if "hidden_auc" in e:
            auc += f" (hidden model {_auc(e['hidden_auc'])})"
        of = "" if result.kept_step is None else f" (the model of step {result.kept_step})"
        rows.append(
            (
                "held-out",
                f"{auc}, logloss {e['logloss']:.4f} on {int(e['samples']):,} samples{of}",
            )
        )
    best = result.best_eval()
    if result.evals and best is not None:
        at = int(best["step"])
        during = (
            f"{len(result.evals)} evaluations (every {args.eval_every} steps); best AUC "
            f"{_auc(best['auc'])} at step {at}{' (the last)' if at == len(result.losses) else ''}"
        )
        if result.stopped_early:
            during += f"; stopped early: {args.early_stop} evaluations without a better AUC"
        if result.kept_step is not None:
            during += f"; kept the model of step {result.kept_step} (the best), not the last"
        rows.append(("during run", during))
    warning = overfit_warning(result)
    if warning is not None:
        rows.append(("warning", warning))
    return rows


def _counter_rows(result: TrainResult) -> list[tuple[str, str]]:
    """The cache's counters (hit rate, evictions, admission) and the tier's (evictions,
    traffic)."""
    stats = result.cache_stats
    rows: list[tuple[str, str]] = [
        (
            "hit rate",
            f"{stats['hit_rate']:.3f} ({stats['hits']:,} hits, {stats['misses']:,} misses of "
            "unique ids per batch)",
        ),
        (
            "evictions",
            f"{stats['evictions']:,} rows left the cache, {stats['writebacks']:,} of them dirty "
            "and written back",
        ),
    ]
    if "admissions_refused" in stats:
        rows.append(
            (
                "admission",
                f"{stats['admissions_refused']:,} lookups of ids not admitted yet (read zeros), "
                f"{stats['gradients_dropped']:,} of their gradient rows dropped",
            )
        )
    io = result.io_stats
    if io is not None and io.get("tier_evictions"):
        rows.append(("tier", f"{io['tier_evictions']:,} rows evicted from the bounded tables"))
    if io is not None and "bytes_read" in io:
        rows.append(
            (
                "tier traffic",
                f"tier -> cache {_mib(io['bytes_read'])} ({io['rows_read']:,} rows), "
                f"cache -> tier {_mib(io['bytes_written'])} ({io['rows_written']:,} rows)",
            )
        )
    return rows


def _output_rows(args: Namespace) -> list[tuple[str, str]]:
    """Where the run's checkpoint and plot went."""
    rows: list[tuple[str, str]] = []
    if args.checkpoint is not None:
        every = getattr(args, "checkpoint_every", 0)
        kept = (
            f" (every {every} steps, the last {args.keep_checkpoints} in steps/)" if every else ""
        )
        source = getattr(args, "checkpoint_source", "--checkpoint")
        if source != "--checkpoint":
            kept += f" ({source})"
        rows.append(("checkpoint", f"{args.checkpoint}{kept}"))
    if args.plot is not None:
        rows.append(("plot", str(args.plot)))
    return rows


def _epochs(steps: int, per_epoch: int) -> str:
    """``steps`` as passes over a training split of ``per_epoch`` batches: "2 epochs",
    "9.2 epochs"."""
    if steps % per_epoch == 0:
        n = steps // per_epoch
        return f"{n} epoch{'s' if n != 1 else ''}"
    return f"{steps / per_epoch:.1f} epochs"


def overfit_warning(result: TrainResult) -> str | None:
    """One line when the run over-trained: its training loss (the last 10% of steps) is
    less than half the held-out log loss, by more than 0.1, and the held-out log loss either
    rose above its lowest evaluation during the run or is worse than ln 2 (what predicting
    0.5 for every sample scores). None otherwise, and when early stopping kept an earlier
    model."""
    final = result.eval
    if not final or result.kept_step is not None or not result.losses:
        return None
    train, held = result.loss_window(last=True), final["logloss"]
    if not (train < 0.5 * held and held - train > 0.1):
        return None
    lowest = min(result.evals, key=lambda e: e["logloss"], default=None)
    rose = lowest is not None and lowest["logloss"] < 0.95 * held
    if not (rose or held > math.log(2)):
        return None
    since = (
        f", up from {lowest['logloss']:.4f} at step {int(lowest['step'])}"
        if rose and lowest is not None
        else ""
    )
    return (
        f"over-trained: training loss {train:.4f} (last 10% of steps), held-out log loss "
        f"{held:.4f}{since}: the model memorised the training split; train fewer epochs "
        "(--epochs) or keep the best model with --eval-every N --early-stop P"
    )


def _auc(value: float) -> str:
    """An AUC as the summary shows it; undefined (NaN) only on a held-out split of one class."""
    return "n/a (the held-out labels are all one class)" if math.isnan(value) else f"{value:.4f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


# ----------------------------------------------------------------------------------------------
# embcache bench
