"""``embcache train --nproc N`` and torchrun: one rank of a distributed DLRM run."""

from __future__ import annotations

import argparse
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from embcache.checkpoint import load as embcache_load
from embcache.checkpoint import read_extra
from embcache.checkpoint import save as embcache_save
from embcache.cli.report import print_summary, write_plot
from embcache.cli.settings import plain_options, run_settings
from embcache.data.batch import Batch
from embcache.data.synthetic import SyntheticCriteo
from embcache.engine.inputs import JaggedBatch
from embcache.kv.url import open_store
from embcache.models.dlrm import DLRM
from embcache.train.loop import evaluate, make_dense_optimizer, make_sparse_optimizer, train


def spawn_ranks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from embcache.distributed.launch import SpawnError, spawn

    backend = "nccl" if args.device == "cuda" else "gloo"
    try:
        spawn(
            train_rank,
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
            sparse_features=_slice_samples(full.sparse_features, lo, hi),
            labels=full.labels[lo:hi],
        )


def _slice_samples(kjt: JaggedBatch, lo: int, hi: int) -> JaggedBatch:
    """Samples ``[lo, hi)`` of every feature of a batch."""
    keys, batch = kjt.keys(), kjt.stride()
    offsets = kjt.offsets().view(-1)
    starts = offsets[:-1].view(len(keys), batch)[:, lo].tolist()
    ends = offsets[1:].view(len(keys), batch)[:, hi - 1].tolist()
    pieces = list(zip(starts, ends, strict=True))
    weights = kjt.weights_or_none()
    return JaggedBatch.from_lengths(
        keys=keys,
        values=torch.cat([kjt.values()[a:b] for a, b in pieces]),
        lengths=kjt.lengths().view(len(keys), batch)[:, lo:hi].reshape(-1),
        weights=None if weights is None else torch.cat([weights[a:b] for a, b in pieces]),
    )


def _job_owner(rank: int, args: argparse.Namespace) -> str:
    """One tier owner token for every rank (they are one job and share the tables on one
    Redis): the one ``--resume``'s checkpoint recorded, else a new one, sent from rank 0."""
    import torch.distributed as dist

    owner = [None]
    if rank == 0:
        extra = read_extra(_rank_dir(args.resume, 0)) if args.resume is not None else {}
        owner[0] = extra.get("tier_owner") or uuid.uuid4().hex
    dist.broadcast_object_list(owner, src=0)
    return str(owner[0])


def _rank_dir(path: Path, rank: int) -> Path:
    """Each rank checkpoints the rows it owns (and the replicated MLPs) in its own directory."""
    return Path(path) / f"rank-{rank}"


def train_rank(rank: int, options: dict[str, Any]) -> None:
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
    lr, dense_lr, cache, data = run_settings(args)
    store = open_store(args.store, owner=_job_owner(rank, args))
    model = DLRM(
        data.tables(args.dim),
        cache=cache,
        store=store,
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
    first_step = 0
    if args.resume is not None:
        extra = embcache_load(_rank_dir(args.resume, rank), model, [sparse_opt, dense_opt])
        if extra.get("world_size") != world:
            raise ValueError(
                f"--resume {args.resume} was written by {extra.get('world_size')} ranks, this "
                f"run has {world}: each rank holds the rows it owns"
            )
        first_step = int(extra.get("steps_done", 0))
    result = train(
        model,
        rank_data,
        sparse_opt,
        dense_opt,
        args.steps,
        args.prefetch,
        progress,
        first_step=first_step,
        wrapper=ddp,
    )
    result.samples *= world
    if args.eval_batches:
        result.eval = evaluate(model, data, args.eval_batches)  # collective: same batches
    model.sparse_arch.flush()
    if args.checkpoint is not None:
        embcache_save(
            _rank_dir(args.checkpoint, rank),
            model,
            [sparse_opt, dense_opt],
            extra={
                "steps_done": first_step + args.steps,
                "world_size": world,
                **({"tier_owner": store.lease_owner} if store.lease_owner else {}),
            },
        )
    store.close()
    if args.plot is not None and rank == 0:
        write_plot(result, args.plot)
    if rank == 0:
        args.store = f"{args.store} (per rank), {world} ranks"
        print_summary(args, data, model, result, lr, dense_lr, time.perf_counter() - t_start)
