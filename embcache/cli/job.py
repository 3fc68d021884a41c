"""One training job of ``embcache train``, the same flow for one process, each of ``--nproc N``
local ranks and each rank torchrun started (`run_job`): the tier opened, a DLRM built (tables
sharded by row over the ranks, MLPs under DistributedDataParallel, when there are several),
trained on the data, evaluated on its held-out split, flushed, saved, summarised."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch

from embcache.checkpoint import load as embcache_load
from embcache.checkpoint import read_extra
from embcache.checkpoint import save as embcache_save
from embcache.cli.report import print_summary, write_plot
from embcache.cli.settings import eval_batches, open_data, run_settings
from embcache.data import Batch, ClickDataset, SyntheticCriteo
from embcache.engine.interface import FUSION_K
from embcache.kv.base import Store
from embcache.kv.errors import TierError
from embcache.kv.redact import redact_text, redact_url
from embcache.kv.url import open_store
from embcache.models.dlrm import DLRM
from embcache.train.loop import (
    binary_metrics,
    evaluate,
    make_dense_optimizer,
    make_sparse_optimizer,
    train,
)


class DataError(ValueError):
    """The data stream failed (a bad line, a truncated file) during the run."""


def one_line(err: BaseException) -> str:
    """An error as one line of text, any URL in it without its password."""
    return redact_text(" ".join(str(err).split()) or type(err).__name__)


def _fail(parser: argparse.ArgumentParser | None, code: int, err: BaseException) -> NoReturn:
    """One process: the error as one line and exit ``code``. A rank: raise it (the launcher
    reports the rank that failed first)."""
    if parser is None:
        raise err
    parser.exit(code, f"{parser.prog}: error: {one_line(err)}\n")


def close_store(store: Store, parser: argparse.ArgumentParser | None, failed: bool) -> None:
    """Close the tier (a TieredKV writes its dirty rows back first). After a run that failed,
    a tier that is still down must not replace the run's own one-line error."""
    try:
        store.close()
    except (ConnectionError, TierError) as err:
        if not failed:
            _fail(parser, 1, err)


def rank_dir(path: Path, rank: int, world: int) -> Path:
    """Where a rank checkpoints: ``path`` itself for one process, ``path/rank-<r>`` for each
    of several ranks (the rows it owns, and the replicated MLPs)."""
    return Path(path) if world == 1 else Path(path) / f"rank-{rank}"


def _tier_owner(args: argparse.Namespace, rank: int, world: int) -> str | None:
    """The tier owner token: the one ``--resume``'s checkpoint recorded, so the resumed job
    reopens its tables at once even while the killed run's leases are live; with several
    ranks one token for all of them (they are one job), sent from rank 0."""
    owner = None
    if args.resume is not None and rank == 0:
        owner = read_extra(rank_dir(args.resume, 0, world)).get("tier_owner")
    if world == 1:
        return owner if isinstance(owner, str) else None
    import uuid

    import torch.distributed as dist

    shared = [owner or uuid.uuid4().hex]
    dist.broadcast_object_list(shared, src=0)
    return str(shared[0])


def _rank_batches(batches: Iterator[Batch], rank: int, world: int) -> Iterator[Batch]:
    """Rank r of W trains on samples ``[r*B/W, (r+1)*B/W)`` of every global batch of B; a
    reader's error, or a stream without a single batch, is a `DataError`."""
    count = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            if not count:
                raise DataError("--data: the held-out split is empty") from None
            return
        except ValueError as err:
            raise DataError(f"--data: {err}") from None
        count += 1
        if world > 1:
            per_rank = batch.batch_size // world
            batch = batch.samples(rank * per_rank, (rank + 1) * per_rank)
        yield batch


def run_job(
    args: argparse.Namespace,
    rank: int = 0,
    world: int = 1,
    parser: argparse.ArgumentParser | None = None,
    data: ClickDataset | None = None,
) -> int:
    """One training job as rank ``rank`` of ``world`` (one process: 0 of 1): the tier opened,
    a DLRM built (tables sharded by row over the ranks and the MLPs under
    DistributedDataParallel when ``world > 1``), trained, evaluated, flushed, saved; rank 0
    writes the plot and prints the summary. With ``parser`` (one process) a bad checkpoint or
    a tier error ends the process with a one-line message; ranks raise them."""
    t_start = time.perf_counter()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # torchrun sets it on every node
    device = torch.device(args.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    lr, dense_lr, cache = run_settings(args)
    if data is None:
        data = open_data(args, progress=rank == 0 and not args.no_progress)
    try:
        store = open_store(args.store, owner=_tier_owner(args, rank, world))
    except ValueError as err:
        first = redact_text(str(err).splitlines()[0])
        if parser is None:
            raise
        parser.error(f"--store: {first} (use 'host' or redis://host:port/db)")
    except (ConnectionError, OSError, TierError) as err:
        # An unreachable server is a configuration error, not a bug: exit 2, no traceback.
        if parser is None:
            raise
        message, shown = one_line(err), redact_url(args.store)
        parser.exit(
            2, f"{parser.prog}: error: {message if shown in message else shown + ': ' + message}\n"
        )
    try:
        model, sparse_opt, dense_opt = _build(args, data, cache, store, device, lr, dense_lr, world)
    except (ConnectionError, OSError, TierError) as err:
        close_store(store, parser, failed=True)  # leases taken before the refusal go back
        _fail(parser, 2, err)
    extra: dict[str, Any] = {}
    failed = True
    try:
        wrapper = None
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [local_rank] if device.type == "cuda" else None
            wrapper = DistributedDataParallel(model, device_ids=ids)
        first_step = 0
        if args.resume is not None:
            where = rank_dir(args.resume, rank, world)
            try:
                saved_k = read_extra(where).get("fusion_k", FUSION_K)
                if saved_k != args.fusion_k:  # its rows are keyed by ids folded to saved_k bits
                    raise ValueError(
                        f"written with --fusion-k {saved_k}, this run has {args.fusion_k}: the "
                        f"ids of its rows are folded to {saved_k} bits"
                    )
                extra = embcache_load(where, model, [sparse_opt, dense_opt])
                if extra.get("world_size", 1) != world:
                    raise ValueError(
                        f"written by {extra.get('world_size', 1)} rank(s), this run has {world}: "
                        "each rank holds the rows it owns"
                    )
            except (FileNotFoundError, ValueError) as err:
                _fail(parser, 2, ValueError(f"--resume {args.resume}: {one_line(err)}"))
            first_step = int(extra.get("steps_done", 0))
        limit = eval_batches(args)

        def held_out() -> Iterator[Batch]:  # every rank evaluates the same batches (collective)
            return _rank_batches(data.eval_batches(limit), 0, 1)

        result = train(
            model,
            _rank_batches(data.train_batches(first_step), rank, world),
            sparse_opt,
            dense_opt,
            args.steps,
            args.prefetch,
            rank == 0 and not args.no_progress,
            wrapper=wrapper,
            evaluate_every=args.eval_every if limit != 0 else 0,
            held_out=held_out,
        )
        result.samples *= world
        if limit != 0:
            result.eval = evaluate(model, held_out())
            if isinstance(data, SyntheticCriteo):  # the ceiling: the labels' own model
                hidden = binary_metrics(*_hidden(data, limit))
                result.eval["hidden_auc"] = hidden["auc"]
        model.sparse_arch.flush()
        if args.checkpoint is not None:
            save_checkpoint(
                rank_dir(args.checkpoint, rank, world),
                model,
                dense_opt,
                sparse_opt,
                first_step + args.steps,
                world,
            )
        if args.plot is not None and rank == 0:
            write_plot(result, args.plot)
        failed = False
    except (ConnectionError, TierError, DataError) as err:
        # The tier went away, lost writes or was taken over mid-run, or the data stream broke:
        # its own one-line message (the tier's names the URL, table and what to do).
        _fail(parser, 1, err)
    finally:
        close_store(store, parser, failed)
    if rank == 0:
        shown_store = args.store if world == 1 else f"{args.store} (per rank), {world} ranks"
        print_summary(
            args, data, model, result, lr, dense_lr, time.perf_counter() - t_start,
            store=shown_store, prefetch=args.prefetch,
        )  # fmt: skip
    return 0


def _build(args, data, cache, store, device, lr, dense_lr, world) -> tuple:
    """The model (sharded over the ranks when ``world > 1``) and its two optimizers."""
    kwargs: dict[str, Any] = {}
    if world > 1:
        from embcache.distributed.sharded import ShardedEmbeddingBagCollection

        kwargs["collection_cls"] = ShardedEmbeddingBagCollection
    model = DLRM(
        data.tables(args.dim),
        cache=cache,
        store=store,
        device=device,
        dense_in_features=data.num_dense,
        bottom_mlp=(64, args.dim) if data.num_dense else (),
        top_mlp=(64, 32),
        seed=args.seed,
        fusion_k=args.fusion_k,
        **kwargs,
    )
    sparse_opt = make_sparse_optimizer(args.optimizer, model.sparse_arch, lr)
    dense_opt = make_dense_optimizer(args.optimizer, model.dense_parameters(), dense_lr)
    return model, sparse_opt, dense_opt


def _hidden(data: SyntheticCriteo, batches: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic data's hidden logits and labels of the held-out batches."""
    n = batches or 0
    logits = torch.cat([data.hidden_logits(i, split="eval") for i in range(n)])
    labels = torch.cat([b.labels for b in data.eval_batches(n)])
    return logits, labels


def save_checkpoint(
    path: Path,
    model: DLRM,
    dense_opt: Any,
    sparse_opt: Any,
    steps_done: int,
    world: int = 1,
) -> None:
    """`embcache.save` of the model with both optimizers (sparse first), the number of
    training batches consumed, so `--resume` continues with the next one, the number of ranks
    that wrote it, the ids' ``fusion_k`` (a resumed run must fold raw ids alike), and the
    tier's owner token, so that a resumed run may reopen the tables its
    lease still holds."""
    extra: dict[str, Any] = {
        "steps_done": steps_done,
        "world_size": world,
        "fusion_k": model.sparse_arch.fusion_k,
    }
    owner = model.sparse_arch.store.lease_owner
    if owner is not None:
        extra["tier_owner"] = owner
    embcache_save(path, model, [sparse_opt, dense_opt], extra=extra)
