"""Do bf16 rows train a DLRM as well as fp32 rows while moving half the row bytes?

Setup: a `DLRM` (dim 16, bottom MLP 64-16, top MLP 64-32-1, row-wise AdaGrad on the rows at lr
0.05, Adagrad on the MLPs at 0.01) trained with fp32 rows, with bf16 rows
(`CacheConfig.weight_dtype="bf16"`: weights stored in bf16 in the cache and the tier, updates
rounded stochastically, the AdaGrad state in fp32) and, for comparison, with fp16 rows, from the
same seed on the same batches, on two data sets, one after the other in this run:

* ``synthetic``: `SyntheticCriteo` (26 tables of the Criteo Kaggle sizes x 0.01, 338,000 rows,
  Zipf 1.05), batches of 1,024, 800 steps, a cache of 10% of the rows; held out: 50 batches.
* ``criteo-text``: a file in Criteo's text format (label, 13 counts, 26 hexadecimal hashes per
  tab-separated line; some fields empty) written here from a hidden logistic model, read by
  `CriteoText` with ``buckets=0``: the raw hashes go into 26 unbounded tables, as they would
  from the real logs; batches of 512, 600 steps (one pass), a cache of 16,384 rows; held out:
  its last 20% (76,800 samples). ``--quick``: 25 steps of 256 samples on each, held out 8
  batches and 1,600 samples: a smoke test, too small for conclusions.

Measured for each: the held-out AUC (torchmetrics) and log loss, and the bytes of rows moved
between the tier and the cache (`Store.io_stats`: read on misses, written back on evictions and
the final flush). A bf16 row is 16 weights of 2 bytes and the row-wise state of 4 bytes (36
bytes, against 68 in fp32); the same ids miss in both runs, so the bytes moved fall by that
ratio (0.53; the weights' bytes alone by 0.50).

Prints a table and writes ``precision.csv`` and ``precision.png`` (each half-precision run's
AUC and bytes moved against the fp32 run's, the baseline).

    python benchmarks/bench_precision.py [--quick] [--threads N]
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _common import cpu_bench_parser, pyplot, quick_note, start_cpu_bench, write_csv

from embcache import DLRM, CacheConfig
from embcache.data import ClickDataset, CriteoText, SyntheticConfig, SyntheticCriteo
from embcache.data.synthetic import CRITEO_KAGGLE_CARDINALITIES
from embcache.train.loop import evaluate, make_dense_optimizer, make_sparse_optimizer, train

DIM = 16
DTYPES = ("fp32", "bf16", "fp16")
TOLERANCE = 0.002  # the most the AUC may lose with half-precision rows


@dataclass(frozen=True)
class Sizes:
    synthetic_steps: int
    synthetic_batch: int
    synthetic_eval: int  # held-out batches
    text_steps: int
    text_batch: int  # a fifth as many samples again are written and held out


FULL = Sizes(800, 1024, 50, 600, 512)
QUICK = Sizes(25, 256, 8, 25, 256)  # a smoke test of the script: too small for conclusions


@dataclass
class Row:
    dataset: str
    weight_dtype: str
    steps: int
    held_out_samples: int
    auc: float
    logloss: float
    row_bytes: int
    rows_moved: int
    bytes_moved: int
    seconds: float


# ----------------------------------------------------------------------------------------------
# a file in Criteo's text format


def write_criteo_text(path: Path, lines: int, seed: int = 0) -> Path:
    """``lines`` Criteo text lines with labels of a hidden logistic model.

    Each of the 26 categorical features draws Zipf(1.05) ranks from its own pool of values
    (the Criteo Kaggle cardinalities x 0.005: 170,000 values in all), written as 8-digit
    hexadecimal hashes; 8 of them carry a label effect per value (normal, std 1). The 13 counts
    are exponential with per-column scales and enter through ``log(1 + count)``. 5% of the
    categorical fields and 8% of the counts are left empty.
    """
    rng = np.random.default_rng(seed)
    pools = [max(3, round(c * 0.005)) for c in CRITEO_KAGGLE_CARDINALITIES]
    hashes = [rng.choice(2**32, size=n, replace=False) for n in pools]
    effects = {t: rng.normal(0.0, 1.0, size=pools[t]) for t in (0, 3, 6, 9, 10, 14, 19, 23)}
    scales = np.exp(rng.uniform(0.0, 4.0, size=13))
    dense_weight = rng.normal(0.0, 0.4, size=13)
    picks = np.empty((lines, len(pools)), dtype=np.int64)
    for t, n in enumerate(pools):
        mass = np.arange(1, n + 1, dtype=np.float64) ** -1.05
        ranks = np.searchsorted(np.cumsum(mass / mass.sum()), rng.random(lines))
        picks[:, t] = rng.permutation(n)[np.minimum(ranks, n - 1)]
    counts = np.floor(rng.exponential(scales, size=(lines, 13))).astype(np.int64)
    logged = np.log1p(counts)
    logit = ((logged - logged.mean(0)) / logged.std(0)) @ dense_weight - 1.2
    for t, effect in effects.items():
        logit += effect[picks[:, t]]
    labels = rng.random(lines) < 1.0 / (1.0 + np.exp(-logit))
    empty_cat = rng.random((lines, len(pools))) < 0.05
    empty_int = rng.random((lines, 13)) < 0.08
    text = [np.char.mod("%08x", h) for h in hashes]
    with path.open("w") as f:
        for i in range(lines):
            dense = ["" if empty_int[i, j] else str(counts[i, j]) for j in range(13)]
            cats = ["" if empty_cat[i, t] else text[t][picks[i, t]] for t in range(len(pools))]
            f.write("\t".join([str(int(labels[i])), *dense, *cats]) + "\n")
    return path


# ----------------------------------------------------------------------------------------------
# one run


@dataclass
class DataSet:
    name: str
    open: Callable[[], ClickDataset]
    steps: int
    eval_batches: int | None  # None: the whole held-out split
    cache: dict


def run(data_set: DataSet, weight_dtype: str) -> Row:
    """Train a fresh DLRM with rows of ``weight_dtype`` and evaluate it."""
    data = data_set.open()
    model = DLRM(
        data.tables(DIM),
        cache=CacheConfig(weight_dtype=weight_dtype, **data_set.cache),
        dense_in_features=data.num_dense,
        bottom_mlp=(64, DIM),
        top_mlp=(64, 32),
        seed=0,
    )
    sparse_opt = make_sparse_optimizer("rowwise_adagrad", model.sparse_arch, lr=0.05)
    dense_opt = make_dense_optimizer("rowwise_adagrad", model.dense_parameters(), lr=0.01)
    t0 = time.perf_counter()
    train(model, data.train_batches(), sparse_opt, dense_opt, data_set.steps, prefetch=False,
          progress=False)  # fmt: skip
    store = model.sparse_arch.store
    model.sparse_arch.flush()  # the dirty rows left in the cache go to the tier too
    io = store.io_stats()
    seconds = time.perf_counter() - t0
    metrics = evaluate(model, data.eval_batches(data_set.eval_batches))
    spec = store.table_spec(store.tables()[0])
    return Row(
        dataset=data_set.name,
        weight_dtype=weight_dtype,
        steps=data_set.steps,
        held_out_samples=int(metrics["samples"]),
        auc=metrics["auc"],
        logloss=metrics["logloss"],
        row_bytes=spec.row_bytes,
        rows_moved=io["rows_read"] + io["rows_written"],
        bytes_moved=io["bytes_read"] + io["bytes_written"],
        seconds=seconds,
    )


def main() -> None:
    args = start_cpu_bench(cpu_bench_parser(__doc__, "precision.csv"))
    note = quick_note(args.quick)
    sizes = QUICK if args.quick else FULL
    text_steps, text_batch = sizes.text_steps, sizes.text_batch
    with tempfile.TemporaryDirectory() as tmp:
        text_lines = text_steps * text_batch * 5 // 4  # a fifth held out
        path = write_criteo_text(Path(tmp) / "train.txt", text_lines)
        data_sets = [
            DataSet(
                "synthetic",
                lambda: SyntheticCriteo(
                    SyntheticConfig(scale=0.01, batch_size=sizes.synthetic_batch, seed=0)
                ),
                sizes.synthetic_steps,
                sizes.synthetic_eval,
                {"load_factor": 0.1},
            ),
            DataSet(
                "criteo-text",
                lambda: CriteoText(path, batch_size=text_batch, buckets=0, eval_fraction=0.2),
                text_steps,
                None,
                {"capacity": 16384},
            ),
        ]
        rows = []
        for data_set in data_sets:
            for dtype in DTYPES:
                rows.append(run(data_set, dtype))
                r = rows[-1]
                print(f"{r.dataset:12s} {r.weight_dtype}: AUC {r.auc:.4f}, logloss "
                      f"{r.logloss:.4f}, {r.bytes_moved / 2**20:7.1f} MiB of rows moved, "
                      f"{r.seconds:5.0f} s", flush=True)  # fmt: skip
    report(rows)
    write_csv(rows, args.out)
    write_plot(rows, args.out.with_suffix(".png"), note)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def write_plot(rows: list[Row], path: Path, note: str) -> None:
    """Per data set and half-precision dtype: the held-out AUC minus fp32's (the tolerance
    shaded) and the bytes of rows moved over fp32's (the 36/68 expected marked)."""
    plt = pyplot()
    data = list(dict.fromkeys(r.dataset for r in rows))
    half = [d for d in DTYPES if d != "fp32"]
    fig, (ax_auc, ax_bytes) = plt.subplots(1, 2, figsize=(9, 3.8))
    width = 0.8 / len(half)
    for j, dtype in enumerate(half):
        x = [k + (j - (len(half) - 1) / 2) * width for k in range(len(data))]
        found = [next(r for r in rows if r.dataset == d and r.weight_dtype == dtype) for d in data]
        fp32 = [next(r for r in rows if r.dataset == d and r.weight_dtype == "fp32") for d in data]
        ax_auc.bar(x, [r.auc - f.auc for r, f in zip(found, fp32, strict=True)], width,
                   label=dtype, color=f"C{j}")  # fmt: skip
        ax_bytes.bar(x, [r.bytes_moved / f.bytes_moved for r, f in zip(found, fp32, strict=True)],
                     width, label=dtype, color=f"C{j}")  # fmt: skip
    ax_auc.axhspan(-TOLERANCE, TOLERANCE, color="gray", alpha=0.2, label=f"±{TOLERANCE} (target)")
    ax_auc.axhline(0.0, color="black", linewidth=0.8)
    deltas = [abs(r.auc - f.auc) for r in rows for f in rows
              if f.dataset == r.dataset and f.weight_dtype == "fp32"]  # fmt: skip
    top = max(2 * TOLERANCE, 1.4 * max(deltas))  # room above the band for the legend
    ax_auc.set_ylim(-top, top)
    ax_auc.set_ylabel("held-out AUC - fp32's AUC")
    ax_auc.set_title("accuracy against fp32 rows")
    ax_bytes.axhline(1.0, color="black", linewidth=0.8)
    ax_bytes.axhline(36 / 68, color="gray", linestyle="--", linewidth=0.8, label="36/68 bytes")
    ax_bytes.set_ylim(0, 1.35)  # room above the fp32 line for the legend
    ax_bytes.set_ylabel("bytes of rows moved / fp32's")
    ax_bytes.set_title("tier <-> cache traffic against fp32 rows")
    for ax in (ax_auc, ax_bytes):
        ax.set_xticks(range(len(data)))
        ax.set_xticklabels(data)
        ax.set_xlabel("data set")
        ax.legend(fontsize=7, loc="upper right", ncol=3)
    fig.suptitle("DLRM with bf16 / fp16 rows against fp32 rows (baseline), same seed and batches"
                 + (f"\n{note}" if note else ""), fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows: list[Row]) -> None:
    print()
    print(f"{'data':12s} {'rows':5s} {'AUC':>7} {'vs fp32':>8} {'within':>7} {'logloss':>8} "
          f"{'bytes moved':>12} {'vs fp32':>8} {'same rows':>10}")  # fmt: skip
    for r in rows:
        fp32 = next(f for f in rows if f.dataset == r.dataset and f.weight_dtype == "fp32")
        delta = r.auc - fp32.auc
        print(f"{r.dataset:12s} {r.weight_dtype:5s} {r.auc:7.4f} {delta:+8.4f} "
              f"{'yes' if abs(delta) <= TOLERANCE else 'NO':>7} {r.logloss:8.4f} "
              f"{r.bytes_moved / 2**20:8.1f} MiB {r.bytes_moved / fp32.bytes_moved:8.3f} "
              f"{'yes' if r.rows_moved == fp32.rows_moved else 'no':>10}")  # fmt: skip
    sizes = ", ".join(f"{d} {next(r.row_bytes for r in rows if r.weight_dtype == d)}"
                      for d in DTYPES)  # fmt: skip
    print(f"(bytes of a stored row: {sizes}; AUC tolerance {TOLERANCE})")


if __name__ == "__main__":
    main()
