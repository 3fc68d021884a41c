"""``embcache train --nproc N``: N local ranks, each running the one training job
(`embcache.cli.job.run_job`) as its rank of the group.

SIGTERM or SIGINT to this process, or to any one rank, stops the ranks together after the step
in flight; they flush and checkpoint (`embcache.cli.job.GracefulStop`), and the command exits
with the ranks' status: 128 + the signal's number, or 0 when the signal came after the last
step. A signal that reaches this process before the ranks can handle it (they are still
starting) kills them: one line, status 128 + its number, nothing trained or saved. A second
signal kills the ranks at once. A rank that fails ends the command with its exception's type
and message on one line. No rank outlives this process, however it dies
(`embcache.distributed.launch`)."""

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
        codes = spawn(
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
        if signals and _killed_by(err, signals[0]):
            name = signal.Signals(signals[0]).name
            parser.exit(
                128 + signals[0],
                f"{parser.prog}: stopped by {name} while the ranks were starting: nothing "
                "trained or saved\n",
            )
        parser.exit(1, f"{parser.prog}: error: rank {err.rank} failed: {err.headline}\n")
    # The ranks agree on whether the run stopped early and on the signal (`agreed_stop`).
    return next((code for code in codes if code), 0)


def _killed_by(err: Any, signum: int) -> bool:
    """Whether the rank that failed first was ended by ``signum``, the launcher's forward of
    it, before the rank's own handler was installed: killed by SIGTERM, or SIGINT's
    KeyboardInterrupt."""
    failure = err.failures[err.rank]
    if signum == signal.SIGINT and failure.headline.startswith("KeyboardInterrupt"):
        return True
    return failure.error.startswith(f"killed by signal {signum} ")


def run_rank(rank: int, options: dict[str, Any]) -> int:
    """A spawned rank: the job, as rank ``rank`` of the default process group; returns its
    exit status."""
    import torch.distributed as dist

    with GracefulStop((signal.SIGTERM, signal.SIGINT), announce=rank == 0) as stopper:
        return run_job(argparse.Namespace(**options), rank, dist.get_world_size(), stopper=stopper)
