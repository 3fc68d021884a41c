"""``embcache train``: the options checked, then one training job (`embcache.cli.job.run_job`)
run by this process, by each of ``--nproc N`` local ranks, or by each rank torchrun started."""

from __future__ import annotations

import argparse
import math
import os

import torch

from embcache.cli.job import one_line, run_job
from embcache.cli.ranks import spawn_ranks
from embcache.cli.settings import open_data
from embcache.engine.interface import MAX_FUSION_K


def _check_train_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    fail = parser.error
    if args.data is not None:
        for flag, value in (("--scale", args.scale), ("--zipf", args.zipf)):
            if value is not None:
                fail(f"{flag} describes the synthetic data; it does not apply with --data")
    if args.scale is not None and not (math.isfinite(args.scale) and 0.0 < args.scale <= 1.0):
        fail(f"--scale must be in (0, 1], got {args.scale}")
    if args.zipf is not None and not (math.isfinite(args.zipf) and args.zipf >= 0):
        fail(f"--zipf must be >= 0, got {args.zipf}")
    if args.cache_capacity is not None and args.cache_capacity < 1:
        fail(f"--cache-capacity must be >= 1, got {args.cache_capacity}")
    if args.load_factor is not None and not (0.0 < args.load_factor <= 1.0):
        fail(f"--load-factor must be in (0, 1], got {args.load_factor}")
    for flag, value in (
        ("--dim", args.dim),
        ("--steps", args.steps),
        ("--batch-size", args.batch_size),
        ("--tier-capacity", args.tier_capacity or 1),
        ("--admit-after", args.admit_after or 1),
    ):
        if value < 1:
            fail(f"{flag} must be >= 1, got {value}")
    scheme = args.store.split("://", 1)[0].lower() if "://" in args.store else ""
    if args.tier_capacity is not None and scheme and not scheme.startswith("tiered+"):
        fail(
            f"--tier-capacity with --store {scheme}://...: a Redis server is bounded by its "
            "maxmemory, not per table; bound the tables in front of it with "
            "--store tiered+redis://host:port/db"
        )
    if not 1 <= args.fusion_k <= MAX_FUSION_K:
        fail(f"--fusion-k must be in [1, {MAX_FUSION_K}] (bits of an id), got {args.fusion_k}")
    if args.buckets < 0:
        fail(f"--buckets must be >= 0 (0: raw ids, unbounded tables), got {args.buckets}")
    if args.buckets == 0 and args.cache_capacity is None:
        fail(
            "--buckets 0 makes unbounded tables (raw hashed ids): give --cache-capacity, the "
            "rows the device cache holds (a load factor needs a known row count)"
        )
    for flag, value in (
        ("--threads", args.threads),
        ("--seed", args.seed),
        ("--eval-every", args.eval_every),
        ("--eval-batches", args.eval_batches or 0),
    ):
        if value < 0:
            fail(f"{flag} must be >= 0, got {value}")
    if not 0.0 < args.eval_fraction < 1.0:
        fail(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if args.nproc < 1:
        fail(f"--nproc must be >= 1, got {args.nproc}")
    world = max(args.nproc, int(os.environ.get("WORLD_SIZE", "1")))
    if world > 1 and args.batch_size % world:
        fail(f"--batch-size {args.batch_size} must be a multiple of the number of ranks")
    for flag, value in (("--lr", args.lr), ("--dense-lr", args.dense_lr)):
        if value is not None and not (math.isfinite(value) and value > 0):
            fail(f"{flag} must be > 0, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device here; use --device cpu")
    for flag, path in (("--checkpoint", args.checkpoint), ("--plot", args.plot)):
        # --checkpoint is a directory created if missing; its parent must exist.
        if path is not None and not path.resolve().parent.is_dir():
            fail(f"{flag} {path}: directory {path.resolve().parent} does not exist")


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_train_args(args, parser)
    try:
        data = open_data(args, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as err:
        parser.error(f"--data {args.data}: {one_line(err)}")
    widest = max((rows for rows in data.rows if rows is not None), default=1)
    if widest > 1 << args.fusion_k:
        parser.error(
            f"--fusion-k {args.fusion_k}: a table of {widest:,} rows needs at least "
            f"{(widest - 1).bit_length()} bits"
        )
    if args.nproc > 1:
        return spawn_ranks(args, parser)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # started by torchrun
        import torch.distributed as dist

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            run_job(args, dist.get_rank(), world, data=data)
        finally:
            dist.destroy_process_group()
        return 0
    return run_job(args, parser=parser, data=data)
