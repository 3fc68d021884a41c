"""``embcache train --nproc N``: N local ranks, each running the one training job
(`embcache.cli.job.run_job`) as its rank of the group.

SIGTERM or SIGINT to this process is sent on to the ranks, which stop together after the step
in flight, flush and checkpoint (`embcache.cli.job.GracefulStop`); the command then exits with
128 + the signal's number. A second signal kills the ranks at once. A rank that fails ends the
command with its exception's type and message on one line."""

from __future__ import annotations

import argparse
import signal
from typing import Any

from embcache.cli.job import GracefulStop, run_job
from embcache.cli.settings import plain_options


def spawn_ranks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Start ``args.nproc`` ranks (gloo on CPU, NCCL on CUDA); returns the exit status."""
    from embcache.distributed.launch import SpawnError, SpawnInterruptedError, spawn

    backend = "nccl" if args.device == "cuda" else "gloo"
    signals: list[int] = []
    try:
        spawn(
            run_rank,
            args.nproc,
            backend=backend,
            args=(plain_options(args),),
            timeout=120.0,
            threads_per_rank=args.threads or None,
            on_signal=signals.append,
        )
    except SpawnInterruptedError as err:
        parser.exit(128 + err.signum, f"{parser.prog}: {err} (nothing flushed)\n")
    except SpawnError as err:
        parser.exit(1, f"{parser.prog}: error: rank {err.rank} failed: {err.headline}\n")
    return 128 + signals[0] if signals else 0


def run_rank(rank: int, options: dict[str, Any]) -> int:
    """A spawned rank: the job, as rank ``rank`` of the default process group; returns its
    exit status."""
    import torch.distributed as dist

    with GracefulStop((signal.SIGTERM, signal.SIGINT), announce=rank == 0) as stopper:
        return run_job(argparse.Namespace(**options), rank, dist.get_world_size(), stopper=stopper)
