"""``embcache train``: the options checked, then one training job (`embcache.cli.job.run_job`)
run by this process, by each of ``--nproc N`` local ranks, or by each rank torchrun started."""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from embcache.cli.job import (
    DATA_ERRORS,
    SEQUENCE_DATA,
    GracefulStop,
    check_checkpoint_path,
    check_resume,
    one_line,
    run_job,
)
from embcache.cli.ranks import spawn_ranks
from embcache.cli.settings import (
    asked_batch,
    batches_per_epoch,
    check_memory,
    open_data,
    resolve_steps,
)
from embcache.data import ClickDataset
from embcache.engine.interface import MAX_FUSION_K

MAX_THREADS = max(64, 4 * (os.cpu_count() or 1))


def _check_train_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every ``embcache train`` option checked (each failure one line and exit 2, through
    ``parser.error``), and the ones a ``--resume`` checkpoint fills in resolved, in this order."""
    fail = parser.error
    _resolve_store(args, parser)
    _check_synthetic_data(args, fail)
    _check_sizes(args, fail)
    _check_counts(args, fail)
    _check_length_and_evaluation(args, fail)
    world = _check_ranks(args, fail)
    _check_model(args, fail)
    _check_device_and_plot(args, fail)
    _check_resume_and_checkpoints(args, world, fail)


def _check_synthetic_data(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> None:
    """--scale and --zipf: only without --data, each in its range."""
    if args.data is not None:
        for flag, value in (("--scale", args.scale), ("--zipf", args.zipf)):
            if value is not None:
                fail(f"{flag} describes the synthetic data; it does not apply with --data")
    if args.scale is not None and not (math.isfinite(args.scale) and 0.0 < args.scale <= 1.0):
        fail(f"--scale must be in (0, 1], got {args.scale}")
    if args.zipf is not None and not (math.isfinite(args.zipf) and args.zipf >= 0):
        fail(f"--zipf must be >= 0, got {args.zipf}")


def _check_sizes(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> None:
    """The cache's size, the sizes that must be positive, the tier's bound, the ids' width
    and the tables' rows (--buckets)."""
    if args.cache_capacity is not None and args.cache_capacity < 1:
        fail(f"--cache-capacity must be >= 1, got {args.cache_capacity}")
    if args.load_factor is not None and not (0.0 < args.load_factor <= 1.0):
        fail(f"--load-factor must be in (0, 1], got {args.load_factor}")
    for flag, value in (
        ("--dim", args.dim),
        ("--steps", 1 if args.steps is None else args.steps),
        ("--epochs", 1 if args.epochs is None else args.epochs),
        ("--batch-size", 1 if args.batch_size is None else args.batch_size),
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


def _check_counts(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> None:
    """The counts that may be 0, and --threads' bound."""
    for flag, value in (
        ("--threads", args.threads),
        ("--seed", args.seed),
        ("--eval-every", args.eval_every),
        ("--eval-batches", args.eval_batches or 0),
        ("--early-stop", args.early_stop),
    ):
        if value < 0:
            fail(f"{flag} must be >= 0, got {value}")
    if args.threads > MAX_THREADS:
        fail(f"--threads must be at most {MAX_THREADS} (4 per CPU), got {args.threads}")


def _check_length_and_evaluation(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> None:
    """The run's length (one of --steps, --epochs, --total-steps), what --early-stop needs,
    and --eval-fraction."""
    if args.steps is not None and args.epochs is not None:
        fail("--steps and --epochs: give one (--epochs N trains N passes over the training split)")
    if args.total_steps is not None:
        if args.total_steps < 1:
            fail(f"--total-steps must be >= 1, got {args.total_steps}")
        for flag, value in (("--steps", args.steps), ("--epochs", args.epochs)):
            if value is not None:
                fail(f"{flag} and --total-steps: give one (--total-steps N ends at step N, "
                     "counted from the first run's start; --steps N trains N more)")  # fmt: skip
    if args.early_stop and (not args.eval_every or args.eval_batches == 0):
        fail(
            f"--early-stop {args.early_stop} counts evaluations during the run: give "
            "--eval-every STEPS (and not --eval-batches 0)"
        )
    if not 0.0 < args.eval_fraction < 1.0:
        fail(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")


def _check_ranks(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> int:
    """--nproc, and a batch that the ranks (--nproc, or torchrun's WORLD_SIZE) split evenly;
    returns the number of ranks."""
    if args.nproc < 1:
        fail(f"--nproc must be >= 1, got {args.nproc}")
    world = max(args.nproc, int(os.environ.get("WORLD_SIZE", "1")))
    if world > 1 and asked_batch(args) % world:
        fail(f"--batch-size {asked_batch(args)} must be a multiple of the number of ranks")
    return world


def _check_model(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> None:
    """--model seq's data and --history; the learning rates."""
    if args.model == "seq":
        _check_sequence_data(args, fail)
    if args.history is not None and args.model != "seq":
        fail(f"--history applies to --model seq (its attention over past ratings), not --model "
             f"{args.model}")  # fmt: skip
    if args.history is not None and args.history < 1:
        fail(f"--history must be >= 1, got {args.history}")
    for flag, value in (("--lr", args.lr), ("--dense-lr", args.dense_lr)):
        if value is not None and not (math.isfinite(value) and value > 0):
            fail(f"{flag} must be > 0, got {value}")


def _check_device_and_plot(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> None:
    """A CUDA device for --device cuda; an existing directory for --plot."""
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device here; use --device cpu")
    if args.plot is not None and not args.plot.resolve().parent.is_dir():
        fail(f"--plot {args.plot}: directory {args.plot.resolve().parent} does not exist")


def _check_resume_and_checkpoints(
    args: argparse.Namespace, world: int, fail: Callable[[str], NoReturn]
) -> None:
    """--resume's checkpoint checked (``args.resumed_at``, ``args.resumed_target``: its step
    and the step its run was to end at), then the checkpointing options, resolved
    (`_resolve_checkpointing`) and checked."""
    args.resumed_at, args.resumed_target = 0, None
    resumed: dict = {}
    if args.resume is not None:
        try:
            resumed = check_resume(args.resume, world, args.fusion_k, args.model)
        except ValueError as err:
            fail(one_line(err))
        args.resumed_at = int(resumed.get("steps_done", 0))
        target = resumed.get("target_steps")
        args.resumed_target = target if isinstance(target, int) else None
    _resolve_checkpointing(args, resumed)
    if args.checkpoint_every < 0:
        fail(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.checkpoint_every and args.checkpoint is None:
        fail("--checkpoint-every needs --checkpoint DIR (where the checkpoints go)")
    if args.keep_checkpoints < 1:
        fail(f"--keep-checkpoints must be >= 1, got {args.keep_checkpoints}")
    if args.checkpoint is not None:
        try:
            check_checkpoint_path(args.checkpoint)
        except ValueError as err:
            fail(one_line(err))


def _resolve_checkpointing(args: argparse.Namespace, resumed: dict) -> None:
    """--checkpoint, --checkpoint-every and --keep-checkpoints: as given, else (with
    --resume) as the checkpoint's run had them, so a resumed run keeps saving where the
    original did and a second interruption loses nothing; else none, 0 and 3.
    ``args.checkpoint_source`` says which, for the summary."""
    args.checkpoint_source = "--checkpoint"
    saved = resumed.get("checkpoint")
    if args.checkpoint is None and isinstance(saved, str):
        args.checkpoint = Path(saved)
        args.checkpoint_source = "the checkpoint's run's; --checkpoint changes it"
    for option, default in (("checkpoint_every", 0), ("keep_checkpoints", 3)):
        if getattr(args, option) is None:
            value = resumed.get(option)
            setattr(args, option, value if isinstance(value, int) else default)


def _check_sequence_data(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> None:
    """``--model seq``: data with per-user histories."""
    kind = args.data.partition(":")[0] if args.data is not None else None
    if kind not in SEQUENCE_DATA:
        given = f"--data {kind}:..." if kind is not None else "the synthetic data (no --data)"
        fail(
            f"--model seq reads each user's rating history, which {given} does not have: it "
            f"trains on {', '.join(k + ':PATH' for k in SEQUENCE_DATA)} (an ml-100k or ml-1m "
            "directory)"
        )


def _resolve_store(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``args.store``: as given, else the tier of ``--resume``'s run (recorded without its
    password, so one that had a password must be given again), else 'host';
    ``args.store_source`` says which, for the summary."""
    if args.store is not None:
        args.store_source = "--store"
        return
    args.store, args.store_source = "host", "the default"
    if args.resume is None:
        return
    from embcache.checkpoint import read_extra

    world = max(args.nproc, int(os.environ.get("WORLD_SIZE", "1")))
    where = args.resume if world == 1 else args.resume / "rank-0"
    try:
        saved = read_extra(where).get("store")
    except (OSError, ValueError):
        return  # check_resume says what is wrong with it
    if not isinstance(saved, str):
        return  # written before checkpoints recorded their tier: the default
    if "***" in saved:
        parser.error(
            f"--resume {args.resume}: its run's tier {saved} needs a password: give --store with it"
        )
    args.store, args.store_source = saved, "the checkpoint's run's; --store changes it"


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as the CLI prints it: its kind and text, without the library line that
    raised it (the CLI's user wrote none of the code on the stack)."""
    return f"warning: {category.__name__}: {message}\n"


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``embcache train``; returns the exit status (128 + a signal's number when SIGTERM or
    SIGINT stopped it before its last step: see `embcache.cli.job.GracefulStop`).

    The signal handlers go in first, so that a signal during the checks, the data's opening
    or the model's building stops the run cleanly at its first step (with one line, no
    traceback); the ``--nproc`` launcher's own handlers take over while its ranks run."""
    shown = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    try:
        with GracefulStop(announce=os.environ.get("RANK", "0") == "0") as stopper:
            return _train(args, parser, stopper)
    finally:
        warnings.formatwarning = shown


def _steps_to_train(args: argparse.Namespace, data: ClickDataset) -> int | None:
    """This run's steps: --steps/--epochs (`resolve_steps`); what is left of --total-steps
    after the --resume checkpoint's step; with --resume alone, what is left of the steps its
    run was to end at (its ``target_steps``); else the default length. None when nothing is
    left."""
    args.epoch_batches = batches_per_epoch(data)
    if args.total_steps is not None:
        target = args.total_steps
    elif args.steps is None and args.epochs is None and args.resumed_target is not None:
        target = args.resumed_target
    else:
        return resolve_steps(args, data)
    left = target - args.resumed_at
    return left if left > 0 else None


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser, stopper: GracefulStop) -> int:
    _check_train_args(args, parser)
    try:
        data = open_data(args, progress=not args.no_progress)
    except DATA_ERRORS as err:  # one line, no usage: the options were fine, the files not
        parser.exit(2, f"{parser.prog}: error: --data {args.data}: {one_line(err)}\n")
    try:
        steps = _steps_to_train(args, data)
    except ValueError as err:
        parser.error(one_line(err))
    if steps is None:  # a requeued run that had already finished: nothing to do
        end = (
            f"--total-steps {args.total_steps}"
            if args.total_steps is not None
            else f"where its run was to end (step {args.resumed_target})"
        )
        print(
            f"embcache train: --resume {args.resume} is at step {args.resumed_at}, {end}: "
            "nothing left to train",
            file=sys.stderr,
        )
        return 0
    args.steps = steps  # the ranks are sent the number
    widest = max((rows for rows in data.rows if rows is not None), default=1)
    if widest > 1 << args.fusion_k:
        parser.error(
            f"--fusion-k {args.fusion_k}: a table of {widest:,} rows needs at least "
            f"{(widest - 1).bit_length()} bits"
        )
    try:
        check_memory(args, data)
    except ValueError as err:
        parser.error(one_line(err))
    if args.nproc > 1:
        if stopper.requested:  # before the ranks were started: nothing to stop but this
            print(f"embcache train: stopped by {stopper.name} before training began",
                  file=sys.stderr)  # fmt: skip
            return 128 + int(stopper.signum or 0)
        return spawn_ranks(args, parser)  # the parent forwards SIGTERM/SIGINT to the ranks
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # started by torchrun
        import torch.distributed as dist

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rank = dist.get_rank()
        try:
            return run_job(args, rank, world, data=data, stopper=stopper)
        finally:
            dist.destroy_process_group()
    return run_job(args, parser=parser, data=data, stopper=stopper)
