"""The ``embcache`` command: ``embcache train`` (DLRM through the cache, on synthetic Criteo-like
data or on Criteo and MovieLens files) and ``embcache bench`` (the scripts in ``benchmarks/``).

    embcache train                                  # ~1 minute on a 2-core CPU
    embcache train --data criteo:train.txt.gz --buckets 1000000 --eval-every 500
    embcache train --data criteo:day_0.gz --buckets 0 --fusion-k 32 --cache-capacity 500000 \
        --tier-capacity 5000000 --admit-after 2 --weight-dtype bf16
    embcache train --data movielens:ml-1m           # one epoch: the default with --data
    embcache train --data movielens:ml-1m --model seq --batch-size 512 --steps 2000
    embcache train --load-factor 0.05 --policy lfu --optimizer rowwise_adagrad --plot run.png
    embcache train --store redis://127.0.0.1:6379/0 --checkpoint ckpt/
    embcache train --resume ckpt/                   # finish the run ckpt/ was saved from
    embcache train --resume ckpt/ --steps 200       # or 200 steps more
    embcache bench --list
    embcache bench e2e --quick
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from embcache.cache.policy_registry import policy_names
from embcache.cli.bench import available_benchmarks, cmd_bench
from embcache.kernels.optim_rules import CLI_NAMES as SPARSE_OPTIMIZERS
from embcache.kernels.optim_rules import DEFAULT_DENSE_LR, DEFAULT_LR, RULES

__all__ = [
    "available_benchmarks",
    "build_parser",
    "data_problem",
    "main",
    "save_checkpoint",
    "write_plot",
]

# The facts the parser shows, copied from their homes, which import torch and triton (seconds,
# tens of seconds on a busy machine): parsing and --help import neither, a command imports them
# when it runs. tests/test_cli_help.py checks each copy against its home.
DEFAULT_SCALE = 0.01  # embcache.cli.settings, as the six below
DEFAULT_ZIPF = 1.05
DEFAULT_DIM = 16
DEFAULT_STEPS = 800
DEFAULT_EPOCHS = 1
DEFAULT_MIN_STEPS = 20
DEFAULT_MAX_EPOCHS = 5
DEFAULT_BATCH = 1024
SMALL_SPLIT_BATCHES = 100
SMALL_BATCH = 256
SMALL_BATCH_EPOCHS = 5
SMALL_EPOCHS = 2
DEFAULT_LOAD_FACTOR = 0.1
DEFAULT_EVAL_BATCHES = 20
DEFAULT_BUCKETS = 100_000  # embcache.data
KINDS = ("criteo", "criteo-npy", "movielens")  # embcache.data
MODELS = ("dlrm", "seq")  # embcache.cli.job
DEFAULT_HISTORY = 20  # embcache.data.movielens
FUSION_K = 30  # embcache.engine.interface
MAX_FUSION_K = 56  # embcache.engine.interface
TIER_POLICIES = ("lru", "lfu")  # embcache.kv.base.ScorePolicy, the bounded tier's scores
# SPARSE_OPTIMIZERS, DEFAULT_LR, DEFAULT_DENSE_LR: from the optimizer rules' specs
# (`embcache.kernels.optim_rules`, which imports neither torch nor triton); --policy's choices:
# the registered eviction policies (`embcache.cache.policy_registry`, which imports neither).


def __getattr__(name: str) -> Any:
    # Re-exported on first use: both import torch.
    if name == "save_checkpoint":
        from embcache.cli.job import save_checkpoint

        return save_checkpoint
    if name == "write_plot":
        from embcache.cli.report import write_plot

        return write_plot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``embcache train``: torch, triton and the package are imported here, after parsing."""
    from embcache.cli.train import cmd_train

    return cmd_train(args, parser)


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
    """The ``embcache`` parser: ``train`` and ``bench``, each with its options in the order
    ``--help`` lists them."""
    parser = argparse.ArgumentParser(
        prog="embcache",
        description="embcache: a GPU embedding cache for training recommendation models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,bench}")
    _add_train_parser(sub)
    _add_bench_parser(sub)
    return parser


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    """``embcache train`` and its four argument groups."""
    train = sub.add_parser(
        "train",
        help="train DLRM through the embedding cache, on synthetic or real click data",
        description=(
            "Train DLRM on click data: by default a synthetic Criteo-like dataset (13 dense and "
            "26 categorical features with the Criteo Kaggle table sizes times --scale, "
            "Zipf-distributed ids, labels from a hidden model); with --data KIND:PATH, Criteo "
            "text logs, torchrec's preprocessed Criteo npy day files or MovieLens, with the "
            "last day (or the last --eval-fraction by time) held out. The tables live in the "
            "tier (--store); the device cache holds --cache-capacity rows (or --load-factor of "
            "all rows). Prints a progress bar and a summary: loss, held-out AUC and log loss, "
            "throughput, hit rate, evictions and the bytes moved between cache and tier."
        ),
        formatter_class=_HelpFormatter,
    )
    data = train.add_argument_group("data")
    _add_data_options(data)
    _add_length_options(data)
    _add_evaluation_options(data)
    data.add_argument("--seed", type=int, default=0, help="seeds the data, the MLPs and the rows")
    _add_model_options(train.add_argument_group("model and optimizer"))
    cache = train.add_argument_group("cache and tier")
    _add_cache_options(cache)
    _add_tier_options(cache)
    _add_run_options(train.add_argument_group("run"))
    train.set_defaults(func=_train, parser=train)


def _add_data_options(data: argparse._ArgumentGroup) -> None:
    """What ``train`` trains on: files (``--data``) or the synthetic data, and the ids' width."""
    data.add_argument(
        "--data",
        default=None,
        metavar="KIND:PATH",
        help=f"train on files instead of synthetic data; KIND is one of {', '.join(KINDS)}: "
        "criteo:FILE_OR_DIR (Kaggle train.txt or Terabyte day_N files, plain or gzip; lines "
        "of label, I1..I13 integers, C1..C26 hex values, tab-separated), "
        "criteo-npy:DIR (day_N_dense/sparse/labels.npy from torchrec's preprocessing), "
        "movielens:DIR (ml-100k: u.data, u.user, u.item; ml-1m: ratings.dat, users.dat, "
        "movies.dat), as the README's Real data section describes them",
    )
    data.add_argument(
        "--buckets",
        type=int,
        default=DEFAULT_BUCKETS,
        help="Criteo: rows of each categorical table; a categorical's hex value modulo this "
        "is its id. 0: the raw hashed values are the ids, in unbounded tables (give "
        "--cache-capacity, and --tier-capacity to bound the memory they take)",
    )
    data.add_argument(
        "--fusion-k",
        type=int,
        default=FUSION_K,
        metavar="BITS",
        help=f"bits of an id in the collection's fused key (id | table << BITS), in [1, "
        f"{MAX_FUSION_K}] (default {FUSION_K}); every table's rows must fit them. With "
        "--buckets 0, a raw id at or above 2**BITS is folded into BITS bits by a hash, so "
        "distinct ids may share a row: 32 or more keeps Criteo's 32-bit hashes exact; a "
        "--resume must use the width its checkpoint was written with",
    )
    data.add_argument(
        "--eval-fraction",
        type=float,
        default=0.1,
        help="--data without day files: the share held out, the latest samples",
    )
    data.add_argument(
        "--scale",
        type=float,
        default=None,
        help="synthetic data: table sizes as a fraction of Criteo Kaggle's (33.8M rows at 1.0), "
        f"in (0, 1] (default {DEFAULT_SCALE})",
    )
    data.add_argument(
        "--zipf",
        type=float,
        default=None,
        help=f"synthetic data: Zipf exponent of the ids, 0 for uniform (default {DEFAULT_ZIPF})",
    )


def _add_length_options(data: argparse._ArgumentGroup) -> None:
    """How much ``train`` trains: the batch, then steps, a total or epochs."""
    data.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"samples per step (default {DEFAULT_BATCH}, or {SMALL_BATCH} on a --data training "
        f"split of fewer than {SMALL_SPLIT_BATCHES} batches of {DEFAULT_BATCH}, with the default "
        f"--lr and --dense-lr scaled by {SMALL_BATCH}/{DEFAULT_BATCH})",
    )
    data.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps (default: the --epochs default with --data, {DEFAULT_STEPS} steps "
        "of the synthetic data; with --resume, the steps its run had left); files are read again "
        "from the start when they end",
    )
    data.add_argument(
        "--total-steps",
        type=int,
        default=None,
        metavar="N",
        help="train until step N, counted from the start of the first run: with --resume, "
        "the steps its checkpoint has not done yet (none: exit 0 at once), so a job requeued "
        "after a preemption with the same --resume DIR --checkpoint DIR --total-steps N "
        "ends at step N however often it was stopped (not with --steps or --epochs, which "
        "count from where this run starts)",
    )
    data.add_argument(
        "--epochs",
        type=int,
        default=None,
        metavar="N",
        help=f"--data: train N passes over the training split (its full batches; not with "
        f"--steps). Default {DEFAULT_EPOCHS} (more over-trains a CTR model's id rows), "
        f"{SMALL_BATCH_EPOCHS} on a split of fewer than {SMALL_SPLIT_BATCHES} batches of "
        f"{DEFAULT_BATCH} in its default batch of {SMALL_BATCH} at the scaled learning rates "
        f"(one pass under-trains it), {SMALL_EPOCHS} there with --batch-size; on a split of "
        f"fewer than "
        f"{DEFAULT_MIN_STEPS} batches the passes that make {DEFAULT_MIN_STEPS} steps, at most "
        f"{DEFAULT_MAX_EPOCHS}; the summary says how many epochs and steps ran",
    )


def _add_evaluation_options(data: argparse._ArgumentGroup) -> None:
    """The held-out evaluation: at the end, every N steps, and early stopping."""
    data.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        help="held-out batches for AUC and log loss; 0 skips evaluation (default: "
        f"{DEFAULT_EVAL_BATCHES} for synthetic data, a separate seed stream; the whole "
        "held-out split of files)",
    )
    data.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="also evaluate every N steps during training (0: only at the end); shown in the "
        "summary (with the best step) and the plot",
    )
    data.add_argument(
        "--early-stop",
        type=int,
        default=0,
        metavar="PATIENCE",
        help="with --eval-every: stop after PATIENCE evaluations in a row without a better "
        "held-out AUC (0: never); the model kept (and checkpointed) is the one of the best "
        "evaluation, not the last",
    )


def _add_model_options(model: argparse._ArgumentGroup) -> None:
    """The model, its embedding dim and its two optimizers."""
    model.add_argument(
        "--model",
        choices=list(MODELS),
        default="dlrm",
        help="dlrm: DLRM, every feature a pooled bag, their dot products into an MLP; seq "
        "(--data movielens only): a sequence model, each rating's movie attending over its "
        "user's last --history rated movies (unpooled rows of the item table) beside the "
        "pooled user and genre bags, then an MLP",
    )
    model.add_argument(
        "--history",
        type=int,
        default=None,
        metavar="N",
        help=f"--model seq: how many of its user's latest earlier ratings each rating attends "
        f"over (default {DEFAULT_HISTORY})",
    )
    model.add_argument(
        "--dim", type=int, default=DEFAULT_DIM, help="embedding dim (also the bottom MLP's output)"
    )
    model.add_argument(
        "--optimizer",
        choices=list(SPARSE_OPTIMIZERS),
        default="adagrad",
        help="sparse rule for the embedding rows; the MLPs get the matching torch.optim ("
        + ", ".join(s.dense_class.rpartition(".")[2] for s in RULES.values())
        + ")",
    )
    model.add_argument(
        "--lr",
        type=float,
        default=None,
        help="sparse learning rate (default per optimizer: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_LR.items())
        + f"; times {SMALL_BATCH}/{DEFAULT_BATCH} in a small split's default batch, as "
        "--batch-size says)",
    )
    model.add_argument(
        "--dense-lr",
        type=float,
        default=None,
        help="MLP learning rate (default per optimizer: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_DENSE_LR.items())
        + f"; times {SMALL_BATCH}/{DEFAULT_BATCH} as --lr's)",
    )


def _add_cache_options(cache: argparse._ArgumentGroup) -> None:
    """The device cache: its size (rows, or a share of all rows), policy and precision."""
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
    cache.add_argument(
        "--policy", choices=policy_names(), default="lru", help="the device cache's eviction policy"
    )
    cache.add_argument(
        "--weight-dtype",
        choices=["fp32", "fp16", "bf16"],
        default="fp32",
        help="precision of the embedding weights in the cache and the tier (optimizer state "
        "stays fp32; half-precision updates round stochastically)",
    )


def _add_tier_options(cache: argparse._ArgumentGroup) -> None:
    """The tier behind the cache (its bound, URL and run record), and what the cache asks of
    it: when an id gets a row (``--admit-after``), when a batch's rows are read
    (``--prefetch``)."""
    cache.add_argument(
        "--tier-capacity",
        type=int,
        default=None,
        metavar="ROWS",
        help="most rows the tier keeps per table (the host tier, or a tiered+redis:// store's "
        "host rows); a full table evicts rows the cache does not hold, lowest --tier-policy "
        "score first, and an evicted row comes back from its initial value (default: no bound)",
    )
    cache.add_argument(
        "--tier-policy", choices=TIER_POLICIES, default="lru", help="the tier's eviction score"
    )
    cache.add_argument(
        "--admit-after",
        type=int,
        default=None,
        metavar="N",
        help="an id gets its own row only from the N-th batch it appears in (counted in a "
        "count-min sketch, whose collisions admit some ids early); before, it reads zeros and "
        "its gradients are dropped (default: at once)",
    )
    cache.add_argument(
        "--store",
        default=None,
        help="the tier (default: 'host', or with --resume the tier of the checkpoint's run, "
        "given again when its URL holds a password): 'host' (in-process memory), a Redis URL "
        "such as redis://127.0.0.1:6379/0, or tiered+redis://... (a host row cache in front "
        "of Redis). Rows persist there under ?namespace=... (default 'embcache'), and a later "
        "run with the same namespace starts from them (the rows only: new MLPs, the data from "
        "its start; --resume DIR continues a whole run), checked against the run record "
        "this run leaves on the tier, in its checkpoint and in ~/.local/state/embcache/tiers/ "
        "(see --fresh-tier). While this run lives its "
        "tables are leased to it: another job on the same namespace is refused. ?shared=1 "
        "opens the tables read-only (no lease taken, every write refused), to read beside "
        "the job that trains them; it is not a way for two jobs to train one namespace. "
        "Passwords are never printed",
    )
    cache.add_argument(
        "--fresh-tier",
        action="store_true",
        help="a Redis tier: start over on what the namespace holds now. Without it, a run on "
        "a namespace an earlier run left (recorded after its flush and at each checkpoint on "
        "the tier, in $XDG_STATE_HOME/embcache/tiers/<key>.json, default ~/.local/state, or in "
        "$EMBCACHE_TIER_RECORDS, and in the checkpoint; the newest copy is checked, with "
        "--checkpoint DIR's too) is "
        "refused when the tier lost rows since (restarted empty, an older snapshot, rows "
        "deleted): resume from a checkpoint (--resume DIR), use a new ?namespace=NAME, or "
        "give this flag, and the lost rows start from their initial values",
    )
    cache.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="resolve batch i+1 into the cache (tier reads, copies into slots) on a worker "
        "thread while batch i trains (embcache.TrainPipeline); numbers are identical either way",
    )


def _add_run_options(run: argparse._ArgumentGroup) -> None:
    """Where the run goes: device, checkpoints, ranks, plot, threads, progress bar."""
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
        help="at the end, save every row the tables hold (weights in their precision and "
        "optimizer state; a bounded table's scores), each cache's state (rows held, LRU/LFU "
        "and admission counts), both optimizers "
        "and the MLPs into this directory with embcache.save: streamed, fsynced and switched "
        "atomically, so a crash mid-save keeps the previous checkpoint. With --nproc each rank "
        "writes the rows it owns to DIR/rank-<r>",
    )
    run.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="DIR",
        help="before training, load a checkpoint written by --checkpoint with the same model "
        "options (tables, dim, optimizer, --weight-dtype) and continue from its step to the "
        "step its run was to end at (unless --steps, --epochs or --total-steps say otherwise), "
        "on its run's tier unless --store is given, saving to its run's --checkpoint DIR with "
        "its --checkpoint-every and --keep-checkpoints unless given; DIR/steps/step-N "
        "(--checkpoint-every) works too. "
        "Its rows are written back into the tier, so a tier that lost rows since is not "
        "refused (the summary says what it held)",
    )
    run.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="with --checkpoint: also save every STEPS steps of this run (0: only at the end; "
        "default 0, or with --resume its run's); each is kept as DIR/steps/step-N (hard "
        "links, no copy), a directory --resume takes",
    )
    run.add_argument(
        "--keep-checkpoints",
        type=int,
        default=None,
        metavar="K",
        help="with --checkpoint-every: how many of the newest DIR/steps/step-N to keep "
        "(default 3, or with --resume its run's)",
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
        help="write loss, hit-rate and held-out AUC / log-loss curves to this PNG",
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


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """``embcache bench`` and its options."""
    bench = sub.add_parser(
        "bench",
        help="run the benchmark scripts in a checkout's benchmarks/",
        description=(
            "Run a checkout's benchmarks/bench_NAME.py scripts, each in its own process. Each "
            "prints a table and writes NAME.csv and a PNG into --out DIR, by default "
            "./embcache-bench/<timestamp>/ under the current directory. The committed results "
            "in benchmarks/results/ change only with --update-results."
        ),
    )
    bench.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("--quick", action="store_true", help="pass --quick: small sizes, seconds")
    where = bench.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write each benchmark's NAME.csv and PNG into DIR (default: "
        "./embcache-bench/<timestamp>/)",
    )
    where.add_argument(
        "--update-results",
        action="store_true",
        help="overwrite the committed results in benchmarks/results/; only from inside the "
        "checkout",
    )
    bench.set_defaults(func=cmd_bench, parser=bench)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``embcache`` console script; returns the exit status.

    Bad options exit through ``SystemExit(2)`` with a one-line message on stderr.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train" and args.data is not None:
        problem = data_problem(args.data)
        if problem is not None:  # before torch loads (tens of seconds on a busy machine)
            args.parser.exit(2, f"{args.parser.prog}: error: --data {args.data}: {problem}\n")
    return args.func(args, args.parser)


# The files each --data kind needs, as its reader (embcache.data, which imports torch) names them.
_CRITEO_DAY = re.compile(r"day_(\d+)(\.[A-Za-z0-9]+)*")  # embcache.data.criteo
_NPY_DAY = re.compile(r"day_(\d+)_dense\.npy")  # embcache.data.criteo_npy


def data_problem(spec: str) -> str | None:
    """What is wrong with ``--data spec`` that shows without reading a file (its kind, its
    path, the files its kind needs), as one line; None when nothing is. The readers check the
    rest (the files' contents) once torch is imported."""
    kind, sep, path = spec.partition(":")
    if not sep or not path or kind not in KINDS:
        return f"expected KIND:PATH with KIND one of {', '.join(KINDS)}"
    where = Path(path)
    try:
        if not where.exists():
            return f"{where}: no such file or directory"
        names = [p.name for p in where.iterdir()] if where.is_dir() else []
    except OSError as err:
        return f"{where}: {err.strerror or err}"
    if kind == "criteo":
        if where.is_dir() and not any(_CRITEO_DAY.fullmatch(n) for n in names):
            return f"{where}: no Criteo day files (day_0, day_1.gz, ...) in this directory"
    elif kind == "criteo-npy":
        if not where.is_dir():
            return f"{where}: not a directory of .npy day files"
        if not any(_NPY_DAY.fullmatch(n) for n in names):
            return f"{where}: no day_<d>_dense.npy files (torchrec's preprocessed Criteo)"
    elif "u.data" not in names and "ratings.dat" not in names:
        return (
            f"{where}: neither u.data (ml-100k) nor ratings.dat (ml-1m) is there (a MovieLens "
            "directory: ml-100k's u.data, u.user, u.item or ml-1m's ratings.dat, users.dat, "
            "movies.dat)"
        )
    return None
