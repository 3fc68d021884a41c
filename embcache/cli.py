"""The ``embcache`` command: ``embcache train`` (DLRM on synthetic Criteo-like data through the
cache) and ``embcache bench`` (the scripts in ``benchmarks/``).

    embcache train                                  # ~1 minute on a 2-core CPU
    embcache train --load-factor 0.05 --policy lfu --optimizer rowwise_adagrad --plot run.png
    embcache train --store redis://127.0.0.1:6379/0 --checkpoint ckpt/
    embcache train --resume ckpt/ --steps 200
    embcache bench --list
    embcache bench e2e --quick
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from embcache.cache.config import CacheConfig
from embcache.checkpoint import load as embcache_load
from embcache.checkpoint import save as embcache_save
from embcache.kv.base import Store
from embcache.kv.url import open_store
from embcache.models.dlrm import (
    DLRM,
    SPARSE_OPTIMIZERS,
    TrainResult,
    evaluate,
    make_dense_optimizer,
    make_sparse_optimizer,
    train,
)
from embcache.models.synthetic import SyntheticConfig, SyntheticCriteo

BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"

# Defaults sized so that `embcache train` (what `make demo` runs) ends in about a minute on a
# 2-core CPU, start-up included, with a cache that has to evict.
DEFAULT_SCALE = 0.01
DEFAULT_DIM = 16
DEFAULT_STEPS = 800
DEFAULT_BATCH = 1024
DEFAULT_LOAD_FACTOR = 0.1
DEFAULT_LR = {"sgd": 5.0, "adagrad": 0.05, "rowwise_adagrad": 0.05, "adam": 0.005}
DEFAULT_DENSE_LR = {"sgd": 0.1, "adagrad": 0.01, "rowwise_adagrad": 0.01, "adam": 0.001}


# ----------------------------------------------------------------------------------------------
# argument parsing


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless X is None/False or the text already
    says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.default is not None
            and action.default is not False
            and action.default != argparse.SUPPRESS
            and "default" not in text
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embcache",
        description="embcache: a GPU embedding cache for training recommendation models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,bench}")

    train = sub.add_parser(
        "train",
        help="train DLRM on synthetic Criteo-like data through the embedding cache",
        description=(
            "Train DLRM on a synthetic Criteo-like click dataset (13 dense and 26 categorical "
            "features with the Criteo Kaggle table sizes times --scale, Zipf-distributed ids, "
            "labels from a hidden model). The 26 tables live in the tier (--store); the device "
            "cache holds --cache-capacity rows (or --load-factor of all rows). Prints a progress "
            "bar and a summary: loss, held-out AUC, throughput, hit rate, evictions and the "
            "bytes moved between cache and tier."
        ),
        formatter_class=_HelpFormatter,
    )
    data = train.add_argument_group("data")
    data.add_argument(
        "--scale",
        type=float,
        default=DEFAULT_SCALE,
        help="table sizes as a fraction of Criteo Kaggle's (33.8M rows at 1.0), in (0, 1]",
    )
    data.add_argument(
        "--zipf", type=float, default=1.05, help="Zipf exponent of the ids (0: uniform)"
    )
    data.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help="samples per step")
    data.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    data.add_argument(
        "--eval-batches",
        type=int,
        default=20,
        help="held-out batches (a separate seed stream) for AUC and logloss; 0 skips evaluation",
    )
    data.add_argument("--seed", type=int, default=0, help="seeds the data, the MLPs and the rows")

    model = train.add_argument_group("model and optimizer")
    model.add_argument(
        "--dim", type=int, default=DEFAULT_DIM, help="embedding dim (also the bottom MLP's output)"
    )
    model.add_argument(
        "--optimizer",
        choices=list(SPARSE_OPTIMIZERS),
        default="adagrad",
        help="sparse rule for the embedding rows; the MLPs get the matching torch.optim "
        "(SGD, Adagrad, Adagrad, Adam)",
    )
    model.add_argument(
        "--lr",
        type=float,
        default=None,
        help="sparse learning rate (default per optimizer: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_LR.items())
        + ")",
    )
    model.add_argument(
        "--dense-lr",
        type=float,
        default=None,
        help="MLP learning rate (default per optimizer: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_DENSE_LR.items())
        + ")",
    )

    cache = train.add_argument_group("cache and tier")
    size = cache.add_mutually_exclusive_group()
    size.add_argument(
        "--cache-capacity",
        type=int,
        default=None,
        help="rows held in the device cache, across all 26 tables (one cache: they share a dim)",
    )
    size.add_argument(
        "--load-factor",
        type=float,
        default=None,
        help=f"cache capacity as a fraction of all rows, in (0, 1] (default {DEFAULT_LOAD_FACTOR} "
        "when --cache-capacity is not given either)",
    )
    cache.add_argument("--policy", choices=["lru", "lfu"], default="lru", help="eviction policy")
    cache.add_argument(
        "--store",
        default="host",
        help="the tier: 'host' (in-process memory) or a Redis URL such as "
        "redis://127.0.0.1:6379/0 (rows persist there under ?namespace=..., default 'embcache', "
        "and a later run with the same namespace continues from them)",
    )
    cache.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="resolve batch i+1 into the cache (tier reads, copies into slots) on a worker "
        "thread while batch i trains (embcache.TrainPipeline); numbers are identical either way",
    )

    run = train.add_argument_group("run")
    run.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the MLPs and the cache live",
    )
    run.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        metavar="DIR",
        help="at the end, save every table row (weights and optimizer state), both optimizers "
        "and the MLPs into this directory with embcache.save: streamed, fsynced and switched "
        "atomically, so a crash mid-save keeps the previous checkpoint",
    )
    run.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="DIR",
        help="before training, load a checkpoint written by --checkpoint with the same model "
        "options (tables, dim, optimizer)",
    )
    run.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="train on N local processes (gloo on CPU, NCCL with --device cuda): tables "
        "sharded by row over the ranks, MLPs data-parallel (DistributedDataParallel), each rank "
        "a slice of every global batch. Under torchrun (WORLD_SIZE set) the ranks come from it",
    )
    run.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="write loss and hit-rate curves to this PNG",
    )
    run.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads; 0 keeps torch's default. The per-step tensors are small, and "
        "on a busy machine OpenMP threads spin-waiting for each other cost far more than they "
        "give (several times slower measured on 2 shared cores)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=_cmd_train, parser=train)

    bench = sub.add_parser(
        "bench",
        help="run the benchmark scripts in benchmarks/",
        description=(
            "Run benchmarks/bench_NAME.py scripts, each in its own process. Each prints a table "
            "and writes a CSV and a PNG (to benchmarks/results/ unless --out is given)."
        ),
    )
    bench.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("--quick", action="store_true", help="pass --quick: small sizes, seconds")
    bench.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write each benchmark's results to DIR/NAME.csv (and .png), for the scripts that "
        "take an --out option",
    )
    bench.set_defaults(func=_cmd_bench, parser=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``embcache`` console script; returns the exit status.

    Bad options exit through ``SystemExit(2)`` with a one-line message on stderr.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args, args.parser)


# ----------------------------------------------------------------------------------------------
# embcache train


def _check_train_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    fail = parser.error
    if not (math.isfinite(args.scale) and 0.0 < args.scale <= 1.0):
        fail(f"--scale must be in (0, 1], got {args.scale}")
    if args.cache_capacity is not None and args.cache_capacity < 1:
        fail(f"--cache-capacity must be >= 1, got {args.cache_capacity}")
    if args.load_factor is not None and not (0.0 < args.load_factor <= 1.0):
        fail(f"--load-factor must be in (0, 1], got {args.load_factor}")
    for flag, value in (
        ("--dim", args.dim),
        ("--steps", args.steps),
        ("--batch-size", args.batch_size),
    ):
        if value < 1:
            fail(f"{flag} must be >= 1, got {value}")
    if args.threads < 0:
        fail(f"--threads must be >= 0, got {args.threads}")
    if args.nproc < 1:
        fail(f"--nproc must be >= 1, got {args.nproc}")
    distributed = args.nproc > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed and (args.checkpoint is not None or args.resume is not None):
        fail("--checkpoint and --resume are single-process for now (each rank holds its rows)")
    if distributed and args.batch_size % max(args.nproc, int(os.environ.get("WORLD_SIZE", "1"))):
        fail(f"--batch-size {args.batch_size} must be a multiple of the number of ranks")
    if args.eval_batches < 0:
        fail(f"--eval-batches must be >= 0, got {args.eval_batches}")
    if args.seed < 0:
        fail(f"--seed must be >= 0, got {args.seed}")
    if not (math.isfinite(args.zipf) and args.zipf >= 0):
        fail(f"--zipf must be >= 0, got {args.zipf}")
    for flag, value in (("--lr", args.lr), ("--dense-lr", args.dense_lr)):
        if value is not None and not (math.isfinite(value) and value > 0):
            fail(f"{flag} must be > 0, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device here; use --device cpu")
    for flag, path in (("--checkpoint", args.checkpoint), ("--plot", args.plot)):
        # --checkpoint is a directory created if missing; its parent must exist.
        if path is not None and not path.resolve().parent.is_dir():
            fail(f"{flag} {path}: directory {path.resolve().parent} does not exist")


def _open_store(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Store:
    try:
        return open_store(args.store)
    except ValueError as err:
        parser.error(f"--store: {str(err).splitlines()[0]} (use 'host' or redis://host:port/db)")
    except (ConnectionError, OSError) as err:
        # TierUnavailableError is a ConnectionError; its message names the URL. One line, no
        # traceback: an unreachable server is a configuration error, not a bug.
        message = " ".join(str(err).split())
        if args.store not in message:
            message = f"{args.store}: {message}"
        parser.exit(2, f"{parser.prog}: error: {message}\n")


def _cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_train_args(args, parser)
    if args.nproc > 1:
        return _spawn_ranks(args, parser)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun
        import torch.distributed as dist

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            _train_rank(dist.get_rank(), _plain(args))
        finally:
            dist.destroy_process_group()
        return 0
    t_start = time.perf_counter()
    device = torch.device(args.device)
    lr, dense_lr, cache, data = _settings(args)
    store = _open_store(args, parser)
    try:
        model = DLRM(
            data.tables(args.dim),
            cache=cache,
            store=store,
            device=device,
            bottom_mlp=(64, args.dim),
            top_mlp=(64, 32),
            seed=args.seed,
        )
    except (ConnectionError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(err).split())}\n")
    try:
        sparse_opt = make_sparse_optimizer(args.optimizer, model.sparse_arch, lr)
        dense_opt = make_dense_optimizer(args.optimizer, model.dense_parameters(), dense_lr)
        first_step = 0
        if args.resume is not None:
            try:
                extra = embcache_load(args.resume, model, [sparse_opt, dense_opt])
            except (FileNotFoundError, ValueError) as err:
                parser.exit(2, f"{parser.prog}: error: --resume {args.resume}: {err}\n")
            first_step = int(extra.get("steps_done", 0))
        result = train(
            model,
            data,
            sparse_opt,
            dense_opt,
            args.steps,
            args.prefetch,
            not args.no_progress,
            first_step=first_step,
        )
        if args.eval_batches:
            result.eval = evaluate(model, data, args.eval_batches)
        model.sparse_arch.flush()
        if args.checkpoint is not None:
            save_checkpoint(args.checkpoint, model, dense_opt, sparse_opt, first_step + args.steps)
        if args.plot is not None:
            write_plot(result, args.plot)
    except ConnectionError as err:  # the tier went away mid-run (TierUnavailableError)
        parser.exit(1, f"{parser.prog}: error: {' '.join(str(err).split())}\n")
    finally:
        if hasattr(store, "close"):
            store.close()
    _print_summary(args, data, model, result, lr, dense_lr, time.perf_counter() - t_start)
    return 0


def _settings(
    args: argparse.Namespace,
) -> tuple[float, float, CacheConfig, SyntheticCriteo]:
    """Learning rates, cache config and data set of a run (and torch's thread count)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    dense_lr = args.dense_lr if args.dense_lr is not None else DEFAULT_DENSE_LR[args.optimizer]
    if args.cache_capacity is not None:
        cache = CacheConfig(capacity=args.cache_capacity, policy=args.policy)
    else:
        cache = CacheConfig(load_factor=args.load_factor or DEFAULT_LOAD_FACTOR, policy=args.policy)
    config = SyntheticConfig(
        scale=args.scale, batch_size=args.batch_size, zipf=args.zipf, seed=args.seed
    )
    return lr, dense_lr, cache, SyntheticCriteo(config)


def _plain(args: argparse.Namespace) -> dict[str, Any]:
    """The options without the parser objects, to send to other processes."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "parser")}


def _spawn_ranks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from embcache.distributed.launch import SpawnError, spawn

    backend = "nccl" if args.device == "cuda" else "gloo"
    try:
        spawn(
            _train_rank,
            args.nproc,
            backend=backend,
            args=(_plain(args),),
            timeout=120.0,
            threads_per_rank=args.threads or None,
        )
    except SpawnError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        parser.exit(1, f"{parser.prog}: error: rank {err.rank} failed: {first}\n")
    return 0


class _RankData:
    """Rank r of W reads rows ``[r*B/W, (r+1)*B/W)`` of every global batch of B samples."""

    def __init__(self, data: SyntheticCriteo, rank: int, world: int) -> None:
        self.data, self.rank, self.world = data, rank, world
        self.config = data.config
        self.rows = data.rows

    def batch(self, i: int, split: str = "train") -> Batch:
        full = self.data.batch(i, split=split)
        per_rank = full.labels.numel() // self.world
        lo, hi = self.rank * per_rank, (self.rank + 1) * per_rank
        return Batch(
            dense_features=full.dense_features[lo:hi],
            sparse_features=_slice_kjt(full.sparse_features, lo, hi),
            labels=full.labels[lo:hi],
        )


def _slice_kjt(kjt: KeyedJaggedTensor, lo: int, hi: int) -> KeyedJaggedTensor:
    """Samples ``[lo, hi)`` of every feature of a KJT."""
    keys, batch = kjt.keys(), kjt.stride()
    offsets = kjt.offsets().view(-1)
    starts = offsets[:-1].view(len(keys), batch)[:, lo].tolist()
    ends = offsets[1:].view(len(keys), batch)[:, hi - 1].tolist()
    pieces = list(zip(starts, ends, strict=True))
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat([kjt.values()[a:b] for a, b in pieces]),
        lengths=kjt.lengths().view(len(keys), batch)[:, lo:hi].reshape(-1),
        weights=None if weights is None else torch.cat([weights[a:b] for a, b in pieces]),
    )


def _train_rank(rank: int, options: dict[str, Any]) -> None:
    """One rank of a distributed run: sharded tables, DistributedDataParallel MLPs.

    Embedding gradients are summed over ranks by their owners and dense ones averaged by DDP,
    as torchrec's DistributedModelParallel does.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from embcache.distributed.sharded import ShardedEmbeddingBagCollection

    args = argparse.Namespace(**options)
    t_start = time.perf_counter()
    world = dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # torchrun sets it on every node
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    lr, dense_lr, cache, data = _settings(args)
    model = DLRM(
        data.tables(args.dim),
        cache=cache,
        store=None if args.store == "host" else args.store,
        device=device,
        bottom_mlp=(64, args.dim),
        top_mlp=(64, 32),
        seed=args.seed,
        collection_cls=ShardedEmbeddingBagCollection,
    )
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    sparse_opt = make_sparse_optimizer(args.optimizer, model.sparse_arch, lr)
    dense_opt = make_dense_optimizer(args.optimizer, model.dense_parameters(), dense_lr)
    rank_data = _RankData(data, rank, world)
    progress = rank == 0 and not args.no_progress
    # Prefetch is not sharded yet: every rank resolves in its forward.
    result = train(
        model, rank_data, sparse_opt, dense_opt, args.steps, False, progress, wrapper=ddp
    )
    result.samples *= world
    if args.eval_batches:
        result.eval = evaluate(model, data, args.eval_batches)  # collective: same batches
    model.sparse_arch.flush()
    if args.plot is not None and rank == 0:
        write_plot(result, args.plot)
    if rank == 0:
        args.prefetch = False
        args.store = f"{args.store} (per rank), {world} ranks"
        _print_summary(args, data, model, result, lr, dense_lr, time.perf_counter() - t_start)


def save_checkpoint(
    path: Path, model: DLRM, dense_opt: Any, sparse_opt: Any, steps_done: int
) -> None:
    """`embcache.save` of the model with both optimizers (sparse first) and the number of
    training batches consumed, so `--resume` continues with the next one."""
    embcache_save(path, model, [sparse_opt, dense_opt], extra={"steps_done": steps_done})


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


def _print_summary(args, data, model, result, lr, dense_lr, total_s) -> None:
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
            f"store {args.store}, prefetch {'on' if args.prefetch else 'off'}",
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


def available_benchmarks(directory: Path = BENCHMARKS_DIR) -> dict[str, Path]:
    """``{name: path}`` of the ``bench_NAME.py`` scripts in ``directory``."""
    if not directory.is_dir():
        return {}
    return {p.stem.removeprefix("bench_"): p for p in sorted(directory.glob("bench_*.py"))}


def _summary_line(path: Path) -> str:
    """First line of a script's module docstring (read without importing it)."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (OSError, SyntaxError):
        return ""
    return doc.strip().splitlines()[0] if doc else ""


def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    found = available_benchmarks()
    if not found:
        parser.exit(
            2,
            f"{parser.prog}: error: no benchmarks found in {BENCHMARKS_DIR} (they ship with a "
            "source checkout, not with an installed wheel)\n",
        )
    if args.list:
        width = max(len(n) for n in found)
        for name, path in found.items():
            print(f"{name:<{width}}  {_summary_line(path)}")
        return 0
    unknown = [n for n in args.names if n not in found]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {', '.join(found)}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for name in args.names or list(found):
        cmd = [sys.executable, str(found[name])]
        if args.quick:
            cmd.append("--quick")
        if args.out is not None:
            if '"--out"' in found[name].read_text():
                cmd += ["--out", str(args.out / f"{name}.csv")]
            else:
                print(f"== {name}: takes no --out; its results stay where it writes them")
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run(cmd, check=False).returncode
        print(f"== {name}: exit {rc} after {time.perf_counter() - start:.1f} s", flush=True)
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
