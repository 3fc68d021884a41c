"""``embcache train``: options checked, the tier opened, a DLRM trained, evaluated, saved."""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from embcache.cache.config import CacheConfig
from embcache.checkpoint import load as embcache_load
from embcache.checkpoint import save as embcache_save
from embcache.cli.report import print_summary, write_plot
from embcache.data.synthetic import SyntheticConfig, SyntheticCriteo
from embcache.kv.base import Store
from embcache.kv.url import open_store
from embcache.models.dlrm import (
    DLRM,
    evaluate,
    make_dense_optimizer,
    make_sparse_optimizer,
    train,
)

# Defaults sized so that `embcache train` (what `make demo` runs) ends in about a minute on a
# 2-core CPU, start-up included, with a cache that has to evict.
DEFAULT_SCALE = 0.01
DEFAULT_DIM = 16
DEFAULT_STEPS = 800
DEFAULT_BATCH = 1024
DEFAULT_LOAD_FACTOR = 0.1
DEFAULT_LR = {"sgd": 5.0, "adagrad": 0.05, "rowwise_adagrad": 0.05, "adam": 0.005}
DEFAULT_DENSE_LR = {"sgd": 0.1, "adagrad": 0.01, "rowwise_adagrad": 0.01, "adam": 0.001}


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


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_train_args(args, parser)
    from embcache.cli.ranks import spawn_ranks, train_rank  # it builds on this module

    if args.nproc > 1:
        return spawn_ranks(args, parser)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun
        import torch.distributed as dist

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            train_rank(dist.get_rank(), plain_options(args))
        finally:
            dist.destroy_process_group()
        return 0
    t_start = time.perf_counter()
    device = torch.device(args.device)
    lr, dense_lr, cache, data = run_settings(args)
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
    print_summary(args, data, model, result, lr, dense_lr, time.perf_counter() - t_start)
    return 0


def run_settings(
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


def plain_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options without the parser objects, to send to other processes."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "parser")}


def save_checkpoint(
    path: Path, model: DLRM, dense_opt: Any, sparse_opt: Any, steps_done: int
) -> None:
    """`embcache.save` of the model with both optimizers (sparse first) and the number of
    training batches consumed, so `--resume` continues with the next one."""
    embcache_save(path, model, [sparse_opt, dense_opt], extra={"steps_done": steps_done})
