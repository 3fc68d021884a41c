"""The settings of an ``embcache train`` run, shared by the one-process and the N-rank flows:
defaults, learning rates, the cache config and the data set."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any

import torch

from embcache.cache.config import CacheConfig
from embcache.data import ClickDataset, SyntheticConfig, SyntheticCriteo, open_dataset
from embcache.kernels.optim_rules import DEFAULT_DENSE_LR, DEFAULT_LR

# Defaults sized so that `embcache train` (what `make demo` runs) ends in about a minute on a
# 2-core CPU, start-up included, with a cache that has to evict.
DEFAULT_SCALE = 0.01
DEFAULT_ZIPF = 1.05
DEFAULT_DIM = 16
DEFAULT_STEPS = 800  # synthetic data (endless)
# --data without --steps/--epochs: one pass over the training split (a CTR model's id rows
# memorise their samples from later passes on: held-out AUC falls), more on a small split
# (below), and on a split of fewer than DEFAULT_MIN_STEPS batches the passes that make that many
# steps, at most DEFAULT_MAX_EPOCHS (`default_epochs`).
DEFAULT_EPOCHS = 1
DEFAULT_MIN_STEPS = 20
DEFAULT_MAX_EPOCHS = 5
DEFAULT_BATCH = 1024
# A small training split: fewer than SMALL_SPLIT_BATCHES batches of DEFAULT_BATCH (102,400
# samples; MovieLens-100K's is 90,000). One pass of 1024 under-trains it (87 steps on ml-100k:
# held-out AUC 0.717). Without --batch-size it trains with SMALL_BATCH, at the default learning
# rates scaled by SMALL_BATCH / DEFAULT_BATCH (the linear scaling rule: each sample moves the
# model as far as in a batch of 1024), and without --steps/--epochs for SMALL_BATCH_EPOCHS
# passes; with --batch-size, at the rates as given, for SMALL_EPOCHS passes (`small_split`,
# `small_batch_lr`). On ml-100k, seeds 0-4: 0.7320 (five passes of 256 at a quarter of the
# rates), against 0.7296 (two passes of 256 at the full rates, which over-train from the third)
# and a matrix factorisation's best epoch, 0.7304 (benchmarks/README.md, "MovieLens-100K").
SMALL_SPLIT_BATCHES = 100
SMALL_BATCH = 256
SMALL_BATCH_EPOCHS = 5
SMALL_EPOCHS = 2
DEFAULT_LOAD_FACTOR = 0.1
DEFAULT_EVAL_BATCHES = 20  # synthetic data: held-out batches (files: the whole held-out split)
# DEFAULT_LR, DEFAULT_DENSE_LR: each optimizer's learning rates, from its rule's spec.


def run_settings(args: argparse.Namespace) -> tuple[float, float, CacheConfig]:
    """Learning rates and cache config of a run (and torch's thread count): the default rates
    scaled by `small_batch_lr`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    scale = small_batch_lr(args)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer] * scale
    dense_lr = (
        args.dense_lr if args.dense_lr is not None else DEFAULT_DENSE_LR[args.optimizer] * scale
    )
    memory = {
        "policy": args.policy,
        "weight_dtype": args.weight_dtype,
        "tier_capacity": args.tier_capacity,
        "tier_policy": args.tier_policy,
        "admit_after": args.admit_after,
    }
    if args.cache_capacity is not None:
        cache = CacheConfig(capacity=args.cache_capacity, **memory)
    else:
        cache = CacheConfig(load_factor=args.load_factor or DEFAULT_LOAD_FACTOR, **memory)
    return lr, dense_lr, cache


def small_batch_lr(args: argparse.Namespace) -> float:
    """What the default learning rates are multiplied by: ``SMALL_BATCH / DEFAULT_BATCH`` when
    `open_data` chose `SMALL_BATCH` for a small split (linear scaling: the same step per sample
    as in batches of 1024), else 1."""
    return SMALL_BATCH / DEFAULT_BATCH if getattr(args, "small_batch", False) else 1.0


def default_cache(args: argparse.Namespace, data: ClickDataset, cache: CacheConfig) -> CacheConfig:
    """``cache`` (from `run_settings`), its capacity raised to `batch_rows` when neither
    --cache-capacity nor --load-factor was given and the default load factor holds fewer."""
    rows = batch_rows(args, data)
    if rows is None:
        return cache
    return dataclasses.replace(cache, capacity=rows, load_factor=None)


def batch_rows(args: argparse.Namespace, data: ClickDataset) -> int | None:
    """The default cache's rows when the default load factor would hold fewer than one batch's
    unique rows at most (each table's rows, or one id per sample, whichever is fewer; a
    multi-hot feature's table here is small), capped at all the rows: None when the load
    factor's rows suffice, or when the user chose the size (or the tables are unbounded)."""
    if args.cache_capacity is not None or args.load_factor is not None or None in data.rows:
        return None
    total = sum(data.rows)  # type: ignore[arg-type]
    one_batch = min(total, sum(min(n, data.batch_size) for n in data.rows))  # type: ignore[type-var]
    return one_batch if one_batch > math.ceil(DEFAULT_LOAD_FACTOR * total) else None


def open_data(args: argparse.Namespace, progress: bool = False) -> ClickDataset:
    """The run's data: ``--data KIND:PATH``, or the synthetic Criteo-like stream. Without
    --batch-size, a small training split (`small_split`) gets batches of `SMALL_BATCH` (and sets
    ``args.small_batch``: `small_batch_lr` scales the default learning rates to it). A training
    split smaller than one batch gets a batch shrunk to fit it (`ClickDataset.batch_size`, a
    multiple of the ranks; `print_summary` says so).

    Raises:
        ValueError, FileNotFoundError: a bad ``--data`` (the message says what and where).
    """
    if args.data is None:
        config = SyntheticConfig(
            scale=args.scale if args.scale is not None else DEFAULT_SCALE,
            batch_size=asked_batch(args),
            zipf=args.zipf if args.zipf is not None else DEFAULT_ZIPF,
            seed=args.seed,
        )
        return SyntheticCriteo(config)
    data = open_dataset(args.data, asked_batch(args), args.buckets, args.eval_fraction, progress)
    samples = data.train_samples()
    world = max(args.nproc, int(os.environ.get("WORLD_SIZE", "1")))
    args.small_split = small_split(samples)
    args.small_batch = args.batch_size is None and args.small_split and SMALL_BATCH % world == 0
    if args.small_batch:
        data.batch_size = SMALL_BATCH
    args.default_batch = data.batch_size  # before a shrink: what the summary's batch row names
    if samples is not None and world <= samples < data.batch_size:
        data.batch_size = samples - samples % world
    return data


def asked_batch(args: argparse.Namespace) -> int:
    """--batch-size, or `DEFAULT_BATCH` when not given."""
    return DEFAULT_BATCH if args.batch_size is None else args.batch_size


def small_split(samples: int | None) -> bool:
    """Whether a training split of ``samples`` is small (see `SMALL_SPLIT_BATCHES`): False when
    its size is unknown without reading it through (only large files' is)."""
    return samples is not None and samples < SMALL_SPLIT_BATCHES * DEFAULT_BATCH


def batches_per_epoch(data: ClickDataset, count: bool = False) -> int | None:
    """Full batches in one pass over the training split (at least 1); None for endless data,
    or for files whose size is unknown without reading them through (unless ``count``)."""
    samples = data.train_samples(count=count)
    if samples is None:
        return None
    return max(1, samples // data.batch_size)


def default_epochs(per_epoch: int, small: bool = False, small_batch: bool = False) -> int:
    """Passes over a training split of ``per_epoch`` batches when none is asked for:
    `DEFAULT_EPOCHS`; on a ``small`` split (`small_split`) `SMALL_BATCH_EPOCHS` in its
    ``small_batch`` (`SMALL_BATCH` at the scaled rates), `SMALL_EPOCHS` in a batch given; or on a
    split too small for that to make `DEFAULT_MIN_STEPS` steps, the passes that do, at most
    `DEFAULT_MAX_EPOCHS`."""
    wanted = -(-DEFAULT_MIN_STEPS // per_epoch)
    least = DEFAULT_EPOCHS
    if small:
        least = SMALL_BATCH_EPOCHS if small_batch else SMALL_EPOCHS
    return max(least, min(DEFAULT_MAX_EPOCHS, wanted))


def resolve_steps(args: argparse.Namespace, data: ClickDataset) -> int:
    """Training steps: --steps, or --epochs passes over the training split (its full batches);
    without either, `default_epochs` passes over ``--data`` (a length that fits the data: a
    fixed step count over-trains a small file hundreds of times) or `DEFAULT_STEPS` of the
    endless synthetic stream.

    Sets ``args.epoch_batches`` (`batches_per_epoch`, counted when the length needs it) for
    the summary's epoch count.

    Raises:
        ValueError: --epochs on endless (synthetic) data.
    """
    args.epoch_batches = batches_per_epoch(data)
    if args.steps is not None:
        return args.steps
    if args.epochs is None and args.data is None:
        return DEFAULT_STEPS
    per_epoch = batches_per_epoch(data, count=True)
    if per_epoch is None:
        raise ValueError("--epochs needs --data (the synthetic stream has no end; give --steps)")
    args.epoch_batches = per_epoch
    small, small_batch = getattr(args, "small_split", False), getattr(args, "small_batch", False)
    return (args.epochs or default_epochs(per_epoch, small, small_batch)) * per_epoch


def eval_batches(args: argparse.Namespace) -> int | None:
    """Held-out batches to evaluate on (None: the whole held-out split of a file)."""
    if args.eval_batches is not None:
        return args.eval_batches
    return DEFAULT_EVAL_BATCHES if args.data is None else None


def plain_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options without the parser objects, to send to other processes."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "parser")}


def check_memory(args: argparse.Namespace, data: ClickDataset) -> None:
    """Refuse, before anything is allocated, options whose device cache and per-batch tensors
    alone need more memory than the device (or the host) has free: a rough lower bound (the
    cache's rows with two optimizer states; a batch's pooled rows and their gradients many
    times over, and the feature interactions), so a run it passes may still need more.

    Raises:
        ValueError: what is asked for, what is free, and what to lower.
    """
    features = len(data.rows) + (1 if data.num_dense else 0)
    batch = data.batch_size * (features * args.dim * 4 * 8 + features * features * 4 * 4)
    known = [rows for rows in data.rows if rows is not None]
    if args.cache_capacity is not None:
        cached = args.cache_capacity
    else:
        cached = math.ceil((args.load_factor or DEFAULT_LOAD_FACTOR) * sum(known))
        cached = max(cached, batch_rows(args, data) or 0)
    need = batch + cached * args.dim * 4 * 3
    free = _free_bytes(args.device)
    if free is not None and need > free:
        raise ValueError(
            f"--batch-size {data.batch_size}, --dim {args.dim} and a cache of {cached:,} rows "
            f"need at least {need / 2**30:,.1f} GiB, and {args.device} memory has "
            f"{free / 2**30:,.1f} GiB free: lower them"
        )


def _free_bytes(device: str) -> int | None:
    """Free memory of the device (``cuda``: the current GPU's) or of the host; None when
    unknown."""
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
