"""``embcache train --nproc N``: N local ranks, each running the one training job
(`embcache.cli.job.run_job`) as its rank of the group."""

from __future__ import annotations

import argparse
from typing import Any

from embcache.cli.job import run_job
from embcache.cli.settings import plain_options


def spawn_ranks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Start ``args.nproc`` ranks (gloo on CPU, NCCL on CUDA); a rank that fails ends the
    command with its first line of error."""
    from embcache.distributed.launch import SpawnError, spawn

    backend = "nccl" if args.device == "cuda" else "gloo"
    try:
        spawn(
            run_rank,
            args.nproc,
            backend=backend,
            args=(plain_options(args),),
            timeout=120.0,
            threads_per_rank=args.threads or None,
        )
    except SpawnError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        parser.exit(1, f"{parser.prog}: error: rank {err.rank} failed: {first}\n")
    return 0


def run_rank(rank: int, options: dict[str, Any]) -> None:
    """A spawned rank: the job, as rank ``rank`` of the default process group."""
    import torch.distributed as dist

    run_job(argparse.Namespace(**options), rank, dist.get_world_size())
