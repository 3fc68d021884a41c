"""Does ``embcache train --data movielens:DIR`` with its defaults reach a plain-torch matrix
factorisation trained to its best on the same split? (issue 48)

Data: MovieLens-100K as GroupLens distributes it (``u.data``, ``u.user``, ``u.item``, unzipped),
given as ``--data DIR``. Its licence forbids redistribution: nothing here ships it, no test
needs it, and its results are not committed (an ``--out`` under ``benchmarks/results/`` is
refused).

embcache: ``embcache train --data movielens:DIR --seed S --no-progress`` with every other option
at its default, once per ``--seeds``, in this process; ``--embcache-args "..."`` adds options,
to measure a variant (``--embcache-args "--batch-size 256 --epochs 2"``). Its summary gives the
held-out AUC, the steps and the epochs; the seconds are the whole call's (reading the files,
training, evaluating).

Baseline: matrix factorisation with biases in plain torch, on the CLI's split (`MovieLens`:
ratings in time order, the latest 10% held out; the training split's full batches of 1024, and
every held-out sample), label ``rating >= 4``. (On ml-100k the CLI now trains in batches of 256,
a small split's default, whose full batches hold 768 more of the 90,000 training ratings; the
baseline keeps 1024's, so that its figure stays comparable with earlier runs.)::

    logit(u, i) = <p_u, q_i> + b_u + b_i + b        loss: binary cross-entropy

dim 16, factors drawn from ``N(0, 0.1)``, biases zero, Adam (lr 0.01, L2 1e-4 on the factors,
none on the biases), shuffled batches of 512, ``--mf-epochs`` epochs (default 25) with the
held-out AUC after each; its figure is its best epoch's, chosen on the held-out split itself (a
baseline's best case). These settings were the best of a small search (benchmarks/README.md,
"MovieLens-100K"); without the L2 it peaks at 0.715 in epoch 2.

Prints one row per seed (embcache's AUC, epochs, steps and seconds; the baseline's best AUC and
its epoch; ``embcache - MF``) and their means, and writes ``movielens_defaults.csv`` (those
rows) and ``movielens_defaults.png`` (the baseline's held-out AUC by epoch, embcache's as
lines) into ``--out DIR`` (default ``./embcache-bench/<timestamp>/``).

    python benchmarks/movielens_defaults.py --data ~/ml-100k [--seeds 0,1,2] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import re
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import output_csv, pyplot, run_header, set_threads, write_csv

from embcache.cli import main as embcache_main
from embcache.cli.bench import RESULTS_DIR
from embcache.data.movielens import MovieLens, rating_columns
from embcache.train.metrics import binary_metrics

CSV_NAME = "movielens_defaults.csv"
CLI_BATCH = 1024  # the baseline's training samples: the full batches of 1024 (docstring)
SET_BY_SCRIPT = ("--data", "--seed")  # options --embcache-args may not repeat


@dataclass(frozen=True)
class MFConfig:
    """The baseline's settings (see the module docstring)."""

    dim: int = 16
    init_std: float = 0.1
    lr: float = 0.01
    factor_l2: float = 1e-4
    batch_size: int = 512


@dataclass
class Row:
    """One seed: embcache's run and the baseline's."""

    seed: int
    embcache_auc: float
    embcache_epochs: str
    embcache_steps: int
    embcache_seconds: float
    mf_best_auc: float
    mf_best_epoch: int
    mf_aucs: str  # held-out AUC after each epoch, space-separated

    @property
    def auc_vs_mf(self) -> float:
        return self.embcache_auc - self.mf_best_auc


def check_data(path: Path) -> Path:
    """``path``, refused unless it holds ``u.data`` (an ml-100k directory).

    Raises:
        ValueError: naming the path and what it lacks.
    """
    if not (path / "u.data").is_file():
        raise ValueError(
            f"{path}: no u.data there; --data takes the ml-100k directory as GroupLens "
            "distributes it (u.data, u.user, u.item)"
        )
    return path


def check_out(csv_path: Path) -> Path:
    """``csv_path``, refused under the committed ``benchmarks/results/``: the data cannot be
    redistributed, so what is measured on it stays out of the checkout's tracked files."""
    results = RESULTS_DIR.resolve()
    target = csv_path.resolve()
    if target == results or results in target.parents:
        raise ValueError(
            f"--out {csv_path}: benchmarks/results/ holds committed results; this benchmark's "
            "are measured on data that cannot be redistributed: write them elsewhere"
        )
    return csv_path


# ----------------------------------------------------------------------------------------------
# embcache: the CLI with its defaults


def run_embcache(path: Path, seed: int, extra: Sequence[str]) -> dict[str, float | int | str]:
    """``embcache train --data movielens:PATH --seed SEED`` (and ``extra``) in this process:
    its held-out AUC, steps, epochs (as the summary says them) and wall seconds."""
    argv = ["train", "--data", f"movielens:{path}", "--seed", str(seed), "--no-progress", *extra]
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        status = embcache_main(argv)
    seconds = time.perf_counter() - start
    text = out.getvalue()
    auc = re.search(r"^  held-out\s+AUC ([\d.]+)", text, re.MULTILINE)
    training = re.search(r"^  training\s+(\d+) steps \(([\d.]+) epochs? of", text, re.MULTILINE)
    if status != 0 or auc is None or training is None:
        raise RuntimeError(f"embcache {shlex.join(argv)} exited {status}:\n{text}")
    return {
        "auc": float(auc[1]),
        "steps": int(training[1]),
        "epochs": training[2],
        "seconds": seconds,
    }


# ----------------------------------------------------------------------------------------------
# the baseline: matrix factorisation


Columns = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # users, items, labels, each [N]


def cli_split(path: Path) -> tuple[MovieLens, Columns, Columns]:
    """The data, and the (user, item, label) columns of the samples the CLI trains on (the
    training split's full batches of `CLI_BATCH`) and of every held-out sample."""
    data = MovieLens(path, batch_size=CLI_BATCH)
    train = rating_columns(itertools.islice(data.train_batches(), data.cut // CLI_BATCH))
    return data, train, rating_columns(data.eval_batches())


def train_mf(
    train: Columns,
    held: Columns,
    n_users: int,
    n_items: int,
    epochs: int,
    seed: int,
    config: MFConfig = MFConfig(),
) -> list[float]:
    """Held-out AUC after each of ``epochs`` epochs of the baseline (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n_users, config.dim, generator=gen) * config.init_std
    q = torch.randn(n_items, config.dim, generator=gen) * config.init_std
    factors = [p.requires_grad_(), q.requires_grad_()]
    biases = [torch.zeros(n_users, requires_grad=True), torch.zeros(n_items, requires_grad=True)]
    mean = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam(
        [
            {"params": factors, "weight_decay": config.factor_l2},
            {"params": [*biases, mean], "weight_decay": 0.0},
        ],
        lr=config.lr,
    )

    def logits(users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        dot = (p[users] * q[items]).sum(1)
        return dot + biases[0][users] + biases[1][items] + mean

    users, items, labels = train
    aucs = []
    for _ in range(epochs):
        order = torch.randperm(labels.numel(), generator=gen)
        for lo in range(0, order.numel(), config.batch_size):
            k = order[lo : lo + config.batch_size]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits(users[k], items[k]), labels[k]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            aucs.append(binary_metrics(logits(held[0], held[1]), held[2])["auc"])
    return aucs


# ----------------------------------------------------------------------------------------------
# the run


def measure(
    path: Path, seeds: Sequence[int], mf_epochs: int, extra: Sequence[str], threads: int
) -> list[Row]:
    """One `Row` per seed: embcache's run, then the baseline's (same seed)."""
    check_data(path)
    data, train, held = cli_split(path)
    print(f"# data: {data.describe()}")
    n_users, n_items = data.rows[0], data.rows[1]
    assert n_users is not None and n_items is not None  # MovieLens' tables are bounded
    rows = []
    for seed in seeds:
        ours = run_embcache(path, seed, extra)
        set_threads(threads)  # the CLI sets torch's threads (its --threads)
        aucs = train_mf(train, held, n_users, n_items, mf_epochs, seed)
        best = max(range(len(aucs)), key=aucs.__getitem__)
        rows.append(
            Row(
                seed=seed,
                embcache_auc=float(ours["auc"]),
                embcache_epochs=str(ours["epochs"]),
                embcache_steps=int(ours["steps"]),
                embcache_seconds=round(float(ours["seconds"]), 2),
                mf_best_auc=round(aucs[best], 4),
                mf_best_epoch=best + 1,
                mf_aucs=" ".join(f"{a:.4f}" for a in aucs),
            )
        )
    return rows


def print_table(rows: list[Row]) -> None:
    columns = ["seed", "embcache AUC", "epochs", "steps", "seconds", "MF best AUC", "MF epoch"]
    print("| " + " | ".join([*columns, "embcache - MF"]) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for r in rows:
        print(
            f"| {r.seed} | {r.embcache_auc:.4f} | {r.embcache_epochs} | {r.embcache_steps} | "
            f"{r.embcache_seconds:.1f} | {r.mf_best_auc:.4f} | {r.mf_best_epoch} | "
            f"{r.auc_vs_mf:+.4f} |"
        )
    ours = statistics.mean(r.embcache_auc for r in rows)
    theirs = statistics.mean(r.mf_best_auc for r in rows)
    print(f"| mean | {ours:.4f} | | | | {theirs:.4f} | | {ours - theirs:+.4f} |")


def plot(rows: list[Row], path: Path, title: str) -> None:
    """The baseline's held-out AUC by epoch, one line per seed; embcache's AUC per seed as a
    dashed horizontal line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(rows):
        color = f"C{i}"
        aucs = [float(a) for a in r.mf_aucs.split()]
        ax.plot(range(1, len(aucs) + 1), aucs, color=color, label=f"MF, seed {r.seed}")
        ax.axhline(
            r.embcache_auc,
            color=color,
            linestyle="--",
            label=f"embcache, seed {r.seed} ({r.embcache_epochs} epoch(s))",
        )
    ax.set_xlabel("MF epoch")
    ax.set_ylabel("held-out AUC")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """Measure, print, write the CSV and the PNG; returns the rows.

    Raises:
        ValueError: --data without u.data, --out under benchmarks/results/, or
            --embcache-args repeating --data or --seed.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, required=True, metavar="DIR")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated (default 0,1,2)")
    parser.add_argument("--mf-epochs", type=int, default=25, metavar="N")
    parser.add_argument("--embcache-args", default="", metavar="ARGS")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, metavar="DIR_OR_CSV")
    args = parser.parse_args(argv)
    check_data(args.data)
    extra = shlex.split(args.embcache_args)
    repeated = [a for a in extra if a.split("=")[0] in SET_BY_SCRIPT]
    if repeated:
        raise ValueError(f"--embcache-args: {repeated} is set by this script, once per seed")
    csv_path = check_out(output_csv(args.out, False, CSV_NAME))
    seeds = [int(s) for s in args.seeds.split(",") if s]
    set_threads(args.threads)
    print(run_header(torch.device("cpu")))
    variant = f" {shlex.join(extra)}" if extra else ""
    print(f"# embcache: embcache train --data movielens:{args.data} --seed S{variant}")
    print(
        f"# baseline: matrix factorisation {MFConfig()}, {args.mf_epochs} epochs, its best "
        "epoch on the held-out split"
    )
    rows = measure(args.data, seeds, args.mf_epochs, extra, args.threads)
    print_table(rows)
    write_csv(rows, csv_path, extra=["auc_vs_mf"])
    plot(
        rows,
        csv_path.with_suffix(".png"),
        f"MovieLens-100K: embcache train{variant} vs matrix factorisation",
    )
    print(f"# wrote {csv_path} and {csv_path.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        sys.exit(f"movielens_defaults.py: error: {err}")
