"""What ``embcache train`` shows at the end: the summary table and the loss/hit-rate plot."""

from __future__ import annotations

from pathlib import Path

from embcache.kv.redact import redact_url
from embcache.train.loop import TrainResult


def write_plot(result: TrainResult, path: Path) -> None:
    """Loss and per-step hit rate against the step, raw and smoothed, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, len(result.losses) // 50)
    fig, (ax_loss, ax_hit) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for ax, values, name in (
        (ax_loss, result.losses, "training loss (BCE)"),
        (ax_hit, result.hit_rates, "cache hit rate"),  # steps that looked rows up
    ):
        steps = range(1, len(values) + 1)
        ax.plot(steps, values, alpha=0.3, linewidth=0.8, label="per step")
        ax.plot(steps, _moving_average(values, window), linewidth=1.5, label=f"mean of {window}")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    ax_hit.set_ylim(0, 1)
    ax_hit.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def print_summary(args, data, model, result, lr, dense_lr, total_s) -> None:
    ebc = model.sparse_arch
    total_rows = sum(data.rows)
    slots = sum(c.num_slots for c in ebc.caches())
    stats = result.cache_stats
    cached = min(slots, total_rows)
    rows: list[tuple[str, str]] = [
        (
            "data",
            f"synthetic Criteo, scale {args.scale:g}: {total_rows:,} rows in {len(data.rows)} "
            f"tables, zipf {args.zipf:g}, batch {args.batch_size}",
        ),
        (
            "model",
            f"DLRM dim {args.dim}, {sum(p.numel() for p in model.dense_parameters()):,} dense "
            f"params, device {args.device}",
        ),
        (
            "cache",
            f"{cached:,} rows ({cached / total_rows:.1%} of all), {args.policy.upper()}, "
            f"store {redact_url(args.store)}, prefetch {'on' if args.prefetch else 'off'}",
        ),
        ("optimizer", f"{args.optimizer}, lr {lr:g} (sparse), {dense_lr:g} (dense)"),
        (
            "training",
            f"{len(result.losses)} steps in {result.seconds:.1f} s: "
            f"{result.samples / result.seconds:,.0f} samples/s ({total_s:.1f} s with set-up, "
            "evaluation and saving)",
        ),
        (
            "loss",
            f"{result.loss_window(last=False):.4f} (first 10% of steps) -> "
            f"{result.loss_window(last=True):.4f} (last 10%)",
        ),
    ]
    if result.eval:
        e = result.eval
        rows.append(
            (
                "held-out",
                f"AUC {e['auc']:.4f} (hidden model {e['hidden_auc']:.4f}), logloss "
                f"{e['logloss']:.4f} on {int(e['samples']):,} samples",
            )
        )
    rows.append(
        (
            "hit rate",
            f"{stats['hit_rate']:.3f} ({stats['hits']:,} hits, {stats['misses']:,} misses of "
            "unique ids per batch)",
        )
    )
    rows.append(
        ("evictions", f"{stats['evictions']:,} ({stats['writebacks']:,} dirty rows written back)")
    )
    io = result.io_stats
    if io is not None and "bytes_read" in io:
        rows.append(
            (
                "tier traffic",
                f"tier -> cache {_mib(io['bytes_read'])} ({io['rows_read']:,} rows), "
                f"cache -> tier {_mib(io['bytes_written'])} ({io['rows_written']:,} rows)",
            )
        )
    if args.checkpoint is not None:
        rows.append(("checkpoint", str(args.checkpoint)))
    if args.plot is not None:
        rows.append(("plot", str(args.plot)))
    width = max(len(k) for k, _ in rows)
    print("\nembcache train: summary")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


# ----------------------------------------------------------------------------------------------
# embcache bench
