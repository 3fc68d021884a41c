"""``embcache train``: options checked, the tier opened, a DLRM trained, evaluated, saved."""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from embcache.checkpoint import load as embcache_load
from embcache.checkpoint import read_extra
from embcache.checkpoint import save as embcache_save
from embcache.cli.report import print_summary, write_plot
from embcache.cli.settings import plain_options, run_settings
from embcache.kv.base import Store
from embcache.kv.errors import TierError
from embcache.kv.redact import redact_text, redact_url
from embcache.kv.url import open_store
from embcache.models.dlrm import DLRM
from embcache.train.loop import evaluate, make_dense_optimizer, make_sparse_optimizer, train


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


def one_line(err: BaseException) -> str:
    """An error as one line of text, any URL in it without its password."""
    return redact_text(" ".join(str(err).split()) or type(err).__name__)


def tier_owner(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The tier owner token that ``--resume``'s checkpoint recorded (None without one): the
    resumed job reopens its tables at once, even while the killed run's leases are live."""
    if args.resume is None:
        return None
    try:
        owner = read_extra(args.resume).get("tier_owner")
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: --resume {args.resume}: {one_line(err)}\n")
    return owner if isinstance(owner, str) else None


def _open_store(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Store:
    try:
        return open_store(args.store, owner=tier_owner(args, parser))
    except ValueError as err:
        first = redact_text(str(err).splitlines()[0])
        parser.error(f"--store: {first} (use 'host' or redis://host:port/db)")
    except (ConnectionError, OSError, TierError) as err:
        # TierUnavailableError is a ConnectionError; its message names the URL. One line, no
        # traceback: an unreachable server is a configuration error, not a bug.
        message = one_line(err)
        shown = redact_url(args.store)
        if shown not in message:
            message = f"{shown}: {message}"
        parser.exit(2, f"{parser.prog}: error: {message}\n")


def close_store(store: Store, parser: argparse.ArgumentParser, failed: bool) -> None:
    """Close the tier (a TieredKV writes its dirty rows back first). After a run that failed,
    a tier that is still down must not replace the run's own one-line error."""
    try:
        store.close()
    except (ConnectionError, TierError) as err:
        if not failed:
            parser.exit(1, f"{parser.prog}: error: {one_line(err)}\n")


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_train_args(args, parser)
    from embcache.cli.ranks import spawn_ranks, train_rank  # torch.distributed, when asked

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
    except (ConnectionError, OSError, TierError) as err:
        close_store(store, parser, failed=True)  # leases taken before the refusal go back
        parser.exit(2, f"{parser.prog}: error: {one_line(err)}\n")
    failed = True
    try:
        sparse_opt = make_sparse_optimizer(args.optimizer, model.sparse_arch, lr)
        dense_opt = make_dense_optimizer(args.optimizer, model.dense_parameters(), dense_lr)
        first_step = 0
        if args.resume is not None:
            try:
                extra = embcache_load(args.resume, model, [sparse_opt, dense_opt])
            except (FileNotFoundError, ValueError) as err:
                parser.exit(2, f"{parser.prog}: error: --resume {args.resume}: {one_line(err)}\n")
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
        failed = False
    except (ConnectionError, TierError) as err:
        # The tier went away, lost writes or was taken over mid-run: its own one-line message
        # (it names the URL, table and what to do), no traceback.
        parser.exit(1, f"{parser.prog}: error: {one_line(err)}\n")
    finally:
        close_store(store, parser, failed)
    print_summary(args, data, model, result, lr, dense_lr, time.perf_counter() - t_start)
    return 0


def save_checkpoint(
    path: Path, model: DLRM, dense_opt: Any, sparse_opt: Any, steps_done: int
) -> None:
    """`embcache.save` of the model with both optimizers (sparse first), the number of
    training batches consumed, so `--resume` continues with the next one, and the tier's owner
    token, so that a resumed run may reopen the tables its lease still holds."""
    extra: dict[str, Any] = {"steps_done": steps_done}
    owner = model.sparse_arch.store.lease_owner
    if owner is not None:
        extra["tier_owner"] = owner
    embcache_save(path, model, [sparse_opt, dense_opt], extra=extra)
