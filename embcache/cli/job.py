"""One training job of ``embcache train``, the same flow for one process, each of ``--nproc N``
local ranks and each rank torchrun started (`run_job`): the tier opened, a DLRM built (tables
sharded by row over the ranks, MLPs under DistributedDataParallel, when there are several) or,
with ``--model seq``, a `SequenceRecommender` over MovieLens histories (likewise), trained
on the data, evaluated on its held-out split, flushed, saved, summarised.

A job stops early and cleanly on SIGTERM or SIGINT (`GracefulStop`), whether the signal reaches
the one process, the ``--nproc`` launcher or any single rank: the step in flight (and one
already prefetched) finishes, the ranks agree on the step to stop after and on the signal, the
rows are flushed, the checkpoint written, the tier closed (its leases released), rank 0 says
"stopped by SIGNAL after step N of TOTAL" on one line; there is no final evaluation, and the
exit status is 128 + the signal's number. A signal that comes after the last step (during the
evaluation or the final save) stops nothing: the run finishes, saves and exits 0. A second
signal exits at once. ``--checkpoint-every`` also saves
every N steps and keeps the last ``--keep-checkpoints`` of them under ``DIR/steps/``. Each
checkpoint records the step its run is to end at and where and how often it saves
(`run_facts`), so that ``--resume DIR`` alone finishes the run, saving as it did; a save that
fails (a full disk) ends the run with one line (`SaveError`). With ``--early-stop`` the model
kept, evaluated and saved is the best evaluation's (`BestModel`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from embcache.cache.config import CacheConfig
from embcache.checkpoint import CheckpointError, check_checkpoint_dir, read_extra
from embcache.checkpoint import load as embcache_load
from embcache.checkpoint import save as embcache_save
from embcache.cli.report import print_summary, write_plot
from embcache.cli.saving import BestModel, SaveError, keep_history, rank_dir, run_facts, save_failed
from embcache.cli.settings import default_cache, eval_batches, open_data, run_settings
from embcache.cli.tier_record import TierRecord
from embcache.data import Batch, ClickDataset, MovieLens, SyntheticCriteo
from embcache.data.movielens import DEFAULT_HISTORY
from embcache.devices import resolve_device
from embcache.engine.interface import FUSION_K
from embcache.kv.base import Store
from embcache.kv.errors import TierDataLossError, TierError, TierFullError
from embcache.kv.redact import redact_text, redact_url
from embcache.kv.tier_state import TierState
from embcache.kv.url import open_store
from embcache.models.dlrm import DLRM
from embcache.models.sequence_model import SequenceRecommender
from embcache.train.loop import (
    Model,
    TrainResult,
    binary_metrics,
    evaluate,
    make_dense_optimizer,
    make_sparse_optimizer,
    train,
)


class DataError(ValueError):
    """The data stream failed (a bad line, a truncated file) during the run."""


MODELS = ("dlrm", "seq")  # --model
SEQUENCE_DATA = ("movielens",)  # the --data kinds whose samples have a history (--model seq)


def model_data(args: argparse.Namespace, data: ClickDataset) -> ClickDataset:
    """The data as the model reads it: with ``--model seq``, MovieLens whose batches carry
    each rating's history (`MovieLens.with_history`: the last ``--history`` movies, default
    `DEFAULT_HISTORY`).

    Raises:
        ValueError: ``--model seq`` on data without per-user histories.
    """
    if args.model == "dlrm":
        return data
    if not isinstance(data, MovieLens):
        raise ValueError(
            f"--model seq reads each user's rating history, which only {', '.join(SEQUENCE_DATA)} "
            "data has: give --data movielens:PATH (an ml-100k or ml-1m directory)"
        )
    return data.with_history(getattr(args, "history", None) or DEFAULT_HISTORY)


# What a reader raises on a damaged file: a bad line (ValueError), a number too wide for int64
# (OverflowError), a truncated or corrupt gzip stream (EOFError, zlib.error, OSError).
DATA_ERRORS = (ValueError, OverflowError, EOFError, zlib.error, OSError)


class GracefulStop:
    """SIGTERM / SIGINT during a job, as a context manager that installs the handlers (in the
    main thread only) and restores the previous ones.

    The first signal sets `signum` (the training loop asks `requested` before each batch and
    stops after the steps begun); a second exits at once with status 128 + its number, without
    flushing (the tier's leases then lapse after their TTL). With several ranks, a signal that
    reached another rank is recorded by `agreed_stop` as `peer_signum`: it names the stop
    (`stop_signum`, `name`) but does not count as this process's first signal.

    Args:
        signals: the signals handled.
        announce: print one line on stderr when the first signal comes (rank 0).
    """

    def __init__(
        self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT), announce: bool = True
    ) -> None:
        self.signals = tuple(signals)
        self.announce = announce
        self.signum: int | None = None
        self.peer_signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def stop_signum(self) -> int | None:
        """The signal that stops the job: this process's, else another rank's."""
        return self.signum if self.signum is not None else self.peer_signum

    @property
    def name(self) -> str:
        """The stopping signal's name ("SIGTERM"), or "" before any."""
        signum = self.stop_signum
        return signal.Signals(signum).name if signum is not None else ""

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"embcache train: {name} again: exiting at once, unflushed\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        if self.announce:
            os.write(
                2,
                f"embcache train: {name}: stopping after the step in flight, then flushing "
                f"and checkpointing ({name} again exits at once)\n".encode(),
            )


def agreed_stop(stopper: GracefulStop, world: int, device: torch.device) -> Callable[[], bool]:
    """``stop()`` for the training loop: the local flag, or with several ranks the flag of any
    rank (an all-reduce per batch taken, so that every rank stops after the same step); a rank
    that was not signalled learns the signal (the highest number, when ranks got different
    ones) as ``stopper.peer_signum``, to name it and to exit with its status."""
    if world == 1:
        return lambda: stopper.requested

    import torch.distributed as dist

    where = device if dist.get_backend() == "nccl" else torch.device("cpu")

    def stop() -> bool:
        flag = torch.tensor([stopper.signum or 0], device=where)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        if signum and stopper.signum is None:
            stopper.peer_signum = signum
        return signum != 0

    return stop


def one_line(err: BaseException) -> str:
    """An error as one line of text, any URL in it without its password."""
    return redact_text(" ".join(str(err).split()) or type(err).__name__)


def ended_by(err: BaseException, checkpoint: Path | None) -> BaseException:
    """The error that ended a run, as the CLI reports it. A full tier's "nothing was lost"
    holds for a caller that can repeat the call; this process exits and its cache's unwritten
    rows go with it, so the message says what was lost and where to resume."""
    if not isinstance(err, TierFullError):
        return err
    refused = str(err).partition(" Nothing was lost")[0]
    resume = f"--resume {checkpoint}" if checkpoint is not None else "a new run"
    return TierFullError(
        f"{refused} The rows this run updated since its last checkpoint and not yet written "
        f"to the tier are lost with this process; raise the server's maxmemory (or bound the "
        f"tables: a tier capacity), then continue with {resume}"
    )


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


def _tier_owner(args: argparse.Namespace, rank: int, world: int) -> tuple[str | None, str | None]:
    """``(owner, takeover)``: this job's tier owner token (with several ranks one token for
    all of them, they are one job, sent from rank 0) and the one ``--resume``'s checkpoint
    recorded, whose tables this job takes over once that job is dead, never while it runs
    (`embcache.kv.redis_lease`)."""
    takeover = None
    if args.resume is not None and rank == 0:
        takeover = read_extra(rank_dir(args.resume, 0, world)).get("tier_owner")
    takeover = takeover if isinstance(takeover, str) else None
    if world == 1:
        return None, takeover
    import uuid

    import torch.distributed as dist

    shared = [uuid.uuid4().hex, takeover]
    dist.broadcast_object_list(shared, src=0)
    return str(shared[0]), shared[1]


def _tier_record(args: argparse.Namespace, rank: int, world: int) -> TierRecord:
    """The run record of this job's tier (`embcache.cli.tier_record`): the state the last run
    on it left, to check unless ``--resume`` restores the rows or ``--fresh-tier`` starts over.

    Raises:
        ValueError: the run record is damaged.
    """
    resume_extra = None
    if args.resume is not None:
        resume_extra = read_extra(rank_dir(args.resume, rank, world))
    fresh = bool(getattr(args, "fresh_tier", False))
    return TierRecord.for_job(args.store, rank, world, resume_extra, fresh, args.checkpoint)


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
        except DATA_ERRORS as err:
            kind = (
                ""
                if type(err) is ValueError or isinstance(err, DataError)
                else f"{type(err).__name__}: "
            )
            if isinstance(err, OverflowError):
                kind = "a number wider than 64 bits: "
            raise DataError(f"--data: {kind}{err}") from None
        count += 1
        if world > 1:
            per_rank = batch.batch_size // world
            batch = batch.samples(rank * per_rank, (rank + 1) * per_rank)
        yield batch


@dataclass
class _Job:
    """What the phases of `run_job` share: the options, this rank, the data, the model with its
    two optimizers, and the tier with its run record."""

    args: argparse.Namespace
    rank: int
    world: int
    parser: argparse.ArgumentParser | None
    local_rank: int
    device: torch.device
    data: ClickDataset
    store: Store
    record: TierRecord
    model: Model
    sparse_opt: Any
    dense_opt: Any


def run_job(
    args: argparse.Namespace,
    rank: int = 0,
    world: int = 1,
    parser: argparse.ArgumentParser | None = None,
    data: ClickDataset | None = None,
    stopper: GracefulStop | None = None,
) -> int:
    """One training job as rank ``rank`` of ``world`` (one process: 0 of 1): the tier opened,
    a DLRM built (tables sharded by row over the ranks and the MLPs under
    DistributedDataParallel when ``world > 1``) or a `SequenceRecommender` (``--model seq``,
    likewise), trained, evaluated, flushed, saved; rank 0
    writes the plot and prints the summary. With ``parser`` (one process) a bad checkpoint or
    a tier error ends the process with a one-line message; ranks raise them.

    Returns:
        The exit status: 0 when the run trained all its steps (a signal that came after the
        last one included), or 128 + the signal's number when SIGTERM/SIGINT stopped it early
        (after the step in flight, flushed and checkpointed; on every rank, whichever rank
        the signal reached).
    """
    t_start = time.perf_counter()
    stopper = stopper or GracefulStop(signals=())
    local_rank, device = _job_device(args, rank, world)
    lr, dense_lr, cache = run_settings(args)
    if data is None:
        data = open_data(args, progress=rank == 0 and not args.no_progress)
    data = model_data(args, data)
    record, store = _open_tier(args, rank, world, parser)
    model, sparse_opt, dense_opt = _build_on_tier(
        args, data, cache, store, record, device, lr, dense_lr, world, parser
    )
    job = _Job(
        args, rank, world, parser, local_rank, device, data, store, record, model, sparse_opt,
        dense_opt,
    )  # fmt: skip
    first_step, result = _train_and_save(job, stopper)
    steps_done = first_step + len(result.losses)
    end = first_step + args.steps  # where this run was to end
    if rank == 0:
        _print_report(job, result, stopper, first_step, steps_done, end, lr, dense_lr, t_start)
    return _exit_status(job, result, stopper, steps_done, end)


def _job_device(args: argparse.Namespace, rank: int, world: int) -> tuple[int, torch.device]:
    """``(local_rank, device)``: this rank's place on its node, and the device it trains on
    (with several ranks on CUDA, the GPU of its local rank, made the current one)."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # torchrun sets it on every node
    device = torch.device(args.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    device = resolve_device(device)  # `--device cuda`: the current device, with its index
    return local_rank, device


def _open_tier(
    args: argparse.Namespace, rank: int, world: int, parser: argparse.ArgumentParser | None
) -> tuple[TierRecord, Store]:
    """``(record, store)``: the run record of ``--store`` and the tier opened under this job's
    owner token. A damaged record, a bad URL or an unreachable server ends the job (exit 2)."""
    owner, takeover = _tier_owner(args, rank, world)  # (the checkpoint was checked before)
    try:
        record = _tier_record(args, rank, world)
    except ValueError as err:
        _fail(parser, 2, err)
    try:
        store = open_store(args.store, owner=owner, takeover=takeover)
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
    return record, store


def _build_on_tier(
    args: argparse.Namespace,
    data: ClickDataset,
    cache: CacheConfig,
    store: Store,
    record: TierRecord,
    device: torch.device,
    lr: float,
    dense_lr: float,
    world: int,
    parser: argparse.ArgumentParser | None,
) -> tuple[Model, Any, Any]:
    """The model and its two optimizers (`_build`) on the opened tier, its run record checked
    before the tables are declared and marked started after. A refusal (rows lost, a table held
    with another shape, the tier down, memory short) closes the tier, so that the leases taken
    go back, and ends the job."""
    try:
        record.expect(store)  # before the tables are declared: each is checked as it is
        model, sparse_opt, dense_opt = _build(args, data, cache, store, device, lr, dense_lr, world)
        record.started(store)
    except TierDataLossError as err:
        close_store(store, parser, failed=True)
        _fail(parser, 1, record.refusal(err))
    except (ConnectionError, OSError, TierError) as err:
        close_store(store, parser, failed=True)  # leases taken before the refusal go back
        _fail(parser, 2, err)
    except ValueError as err:  # a table the tier holds with another dim, dtype or state
        close_store(store, parser, failed=True)
        _fail(parser, 2, ValueError(f"--store {redact_url(args.store)}: {one_line(err)}"))
    except (MemoryError, RuntimeError) as err:
        close_store(store, parser, failed=True)
        _fail(parser, 1, _resource_error(err))
    return model, sparse_opt, dense_opt


def _train_and_save(job: _Job, stopper: GracefulStop) -> tuple[int, TrainResult]:
    """``(first_step, result)``: the model (``--resume``'s, when given) trained from its step,
    evaluated, flushed and saved (or its tier's state recorded), the plot written; the tier is
    closed at the end whatever happened. A tier, data, divergence, memory or save error ends
    the job with its own one line (`ended_by`)."""
    args, model = job.args, job.model
    failed = True
    first_step = 0
    best: BestModel | None = None
    try:
        wrapper = _data_parallel(job)
        if args.resume is not None:
            first_step = _load_resume(job)
        limit = eval_batches(args)

        def held_out() -> Iterator[Batch]:  # every rank evaluates the same batches (collective)
            return _rank_batches(job.data.eval_batches(limit), 0, 1)

        target = [first_step + args.steps]  # the step this run is to end at
        save = _saver(job, target)
        best = BestModel(args, job.rank) if args.early_stop and limit != 0 else None
        result = _train_steps(job, stopper, wrapper, first_step, limit, held_out, save, best)
        result.samples *= job.world
        if limit != 0 and not result.interrupted:
            _final_evaluation(job, result, held_out, best, limit, first_step, target)
        model.sparse_arch.flush()
        kept = len(result.losses) if result.kept_step is None else result.kept_step
        if args.checkpoint is not None:
            save(first_step + kept)  # fewer than --steps after an early stop
        else:
            job.record.save(job.store, first_step + kept)
        if args.plot is not None and job.rank == 0 and result.losses:
            write_plot(result, args.plot)
        failed = False
    except (ConnectionError, TierError, DataError, DivergedError, ResourceError, SaveError) as err:
        # The tier went away, lost writes or was taken over mid-run, the data stream broke,
        # the loss diverged or memory ran out: its own one-line message (the tier's names the
        # URL, table and what to do).
        _fail(job.parser, 1, ended_by(err, args.checkpoint))
    finally:
        if best is not None:
            best.close()
        close_store(job.store, job.parser, failed)
    return first_step, result


def _data_parallel(job: _Job) -> torch.nn.Module | None:
    """With several ranks, the model under DistributedDataParallel (the forwards go through
    it); else None."""
    if job.world == 1:
        return None
    from torch.nn.parallel import DistributedDataParallel

    ids = [job.local_rank] if job.device.type == "cuda" else None
    return DistributedDataParallel(job.model, device_ids=ids)


def _load_resume(job: _Job) -> int:
    """``--resume``'s checkpoint (this rank's) loaded into the model and both optimizers;
    returns the step it was saved at. A checkpoint that does not load ends the job (exit 2)."""
    where = rank_dir(job.args.resume, job.rank, job.world)
    try:
        extra = embcache_load(where, job.model, [job.sparse_opt, job.dense_opt])
    except (FileNotFoundError, ValueError) as err:
        _fail(job.parser, 2, ValueError(f"--resume {job.args.resume}: {one_line(err)}"))
    return int(extra.get("steps_done", 0))


def _saver(job: _Job, target: list[int]) -> Callable[[int], None]:
    """``save(steps_done)``: the rows flushed, the tier's state recorded, then this rank's
    checkpoint written with the run's facts (``target[0]``: the step the run is to end at, as
    it is at each save) and, with ``--checkpoint-every``, the history kept; a write that fails
    is a `SaveError`."""
    args, model, rank, world = job.args, job.model, job.rank, job.world

    def save(steps_done: int) -> None:
        where = rank_dir(args.checkpoint, rank, world)
        model.sparse_arch.flush()  # the tier's state is recorded with the rows on it
        state = job.record.save(job.store, steps_done)
        run = run_facts(args, target[0])
        try:
            save_checkpoint(
                where, model, job.dense_opt, job.sparse_opt, steps_done, world, args.store, state,
                run=run,
            )  # fmt: skip
            if args.checkpoint_every:
                keep_history(args.checkpoint, rank, world, steps_done, args.keep_checkpoints)
        except OSError as err:
            if isinstance(err, ConnectionError):
                raise
            raise SaveError(save_failed(args, where, steps_done, err)) from None

    return save


def _train_steps(
    job: _Job,
    stopper: GracefulStop,
    wrapper: torch.nn.Module | None,
    first_step: int,
    limit: int | None,
    held_out: Callable[[], Iterator[Batch]],
    save: Callable[[int], None],
    best: BestModel | None,
) -> TrainResult:
    """`train` on this rank's share of the batches from ``first_step`` on: evaluating every
    ``--eval-every`` steps (unless ``limit`` is 0), stopping when any rank got a signal,
    saving every ``--checkpoint-every`` steps, keeping the best model in ``best``. Memory
    running out is a `ResourceError`, a NaN or Inf a `DivergedError`."""
    args, model, rank = job.args, job.model, job.rank

    def periodic(step_in_run: int) -> None:
        save(first_step + step_in_run)
        if rank == 0:
            from tqdm import tqdm

            tqdm.write(
                f"embcache train: checkpoint at step {first_step + step_in_run} "
                f"in {args.checkpoint}",
                file=sys.stderr,
            )

    try:
        return train(
            model,
            _rank_batches(job.data.train_batches(first_step), rank, job.world),
            job.sparse_opt,
            job.dense_opt,
            args.steps,
            args.prefetch,
            rank == 0 and not args.no_progress,
            wrapper=wrapper,
            evaluate_every=args.eval_every if limit != 0 else 0,
            held_out=held_out,
            early_stop=args.early_stop if limit != 0 else 0,
            stop=agreed_stop(stopper, job.world, job.device),
            checkpoint_every=args.checkpoint_every if args.checkpoint is not None else 0,
            on_checkpoint=periodic,
            on_best=(
                (lambda step: best.keep(step, model, job.dense_opt, job.sparse_opt))
                if best is not None
                else None
            ),
        )
    except (MemoryError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and not _out_of_memory(err):
            raise
        raise _resource_error(err) from None
    except ValueError as err:
        if isinstance(err, DataError) or not _non_finite(err):
            raise
        raise DivergedError(
            f"training diverged (a NaN or Inf gradient): {one_line(err)}; "
            "try a lower --lr / --dense-lr"
        ) from None


def _final_evaluation(
    job: _Job,
    result: TrainResult,
    held_out: Callable[[], Iterator[Batch]],
    best: BestModel | None,
    limit: int | None,
    first_step: int,
    target: list[int],
) -> None:
    """``result.eval``: the held-out metrics of the model kept, the last one or early
    stopping's best (which moves the run's end, ``target[0]``, to its step), and on synthetic
    data the AUC of the labels' own model, the ceiling."""
    model = job.model
    result.eval = evaluate(model, held_out())
    if best is not None and best.restore(result, model, job.dense_opt, job.sparse_opt):
        result.eval = evaluate(model, held_out())  # the kept model's, as saved
        target[0] = first_step + (result.kept_step or 0)  # the run ends there
    if isinstance(job.data, SyntheticCriteo):  # the ceiling: the labels' own model
        hidden = binary_metrics(*_hidden(job.data, limit))
        result.eval["hidden_auc"] = hidden["auc"]


def _print_report(
    job: _Job,
    result: TrainResult,
    stopper: GracefulStop,
    first_step: int,
    steps_done: int,
    end: int,
    lr: float,
    dense_lr: float,
    t_start: float,
) -> None:
    """Rank 0's summary of a run that took a step (`print_summary`), with its notes."""
    args, world = job.args, job.world
    shown_store = args.store if world == 1 else f"{args.store} (per rank), {world} ranks"
    notes = _summary_notes(job, result, stopper, first_step, steps_done, end)
    if result.losses:  # a stop before the first step has nothing to summarise
        print_summary(
            args, job.data, job.model, result, lr, dense_lr, time.perf_counter() - t_start,
            store=shown_store, prefetch=args.prefetch, notes=notes,
        )  # fmt: skip


def _summary_notes(
    job: _Job,
    result: TrainResult,
    stopper: GracefulStop,
    first_step: int,
    steps_done: int,
    end: int,
) -> list[tuple[str, str]]:
    """The summary's last rows: where a resumed run started, the rows the tier held, the
    sequence model, and the signal that stopped the run."""
    args, model, record = job.args, job.model, job.record
    notes = []
    if args.resume is not None:
        tier = getattr(args, "store_source", "--store")
        notes.append(
            (
                "resumed",
                f"from {args.resume} at step {first_step} (this run: steps "
                f"{first_step + 1}-{steps_done}), tier {redact_url(args.store)} ({tier})",
            )
        )
    tier_line = record.summary(args.resume)
    if tier_line is not None and args.resume is None and _rows_continued(record):
        tier_line += (
            "; only the rows continue: the MLPs, the dense optimizer and the data start "
            "over (--checkpoint DIR, then --resume DIR, continues the whole model)"
        )
    if tier_line is not None:
        notes.append(("tier rows", tier_line))
    if isinstance(model, SequenceRecommender):
        notes.append(
            (
                "sequences",
                f"--model seq: {type(model).__name__}, each rating's movie attending over "
                f"its user's last {model.history_length} rated movies (rows of the "
                f"{model.target} table, unpooled) beside {model.num_bags} pooled bags, "
                "then an MLP",
            )
        )
    if result.interrupted:
        notes.append(("stopped", f"by {stopper.name} after step {steps_done} of {end}"))
    return notes


def _exit_status(
    job: _Job, result: TrainResult, stopper: GracefulStop, steps_done: int, end: int
) -> int:
    """0 for a run that trained all its steps (rank 0 says so when a signal came after the
    last one); 128 + the signal's number for one a signal stopped (rank 0 says where)."""
    if not result.interrupted:
        if stopper.requested and job.rank == 0:
            print(
                f"embcache train: {stopper.name} came after the last step: the run finished "
                "and was saved",
                file=sys.stderr,
                flush=True,
            )
        return 0
    if job.rank == 0:
        print(f"embcache train: {_stop_line(job.args, stopper.name, steps_done, end)}",
              file=sys.stderr, flush=True)  # fmt: skip
    return 128 + int(stopper.stop_signum or 0)


def _rows_continued(record: TierRecord) -> bool:
    """Whether this run started on rows an earlier run left on its tier (not an empty one)."""
    start = record.start
    return start is not None and start.tier_id is not None and bool(start.generation or start.rows)


def _stop_line(args: argparse.Namespace, name: str, steps_done: int, target: int) -> str:
    """What a run stopped by a signal says: where it stopped, and how to finish it (the
    checkpoint records the end and where to save: ``--resume DIR`` alone finishes it)."""
    if args.checkpoint is None:
        saved = "no --checkpoint given"
    else:
        ckpt = args.checkpoint
        saved = (
            f"checkpoint in {ckpt} (continue with --resume {ckpt}: it ends at step {target}, "
            f"saving to {ckpt} as this run did)"
        )
    return (
        f"stopped by {name} after step {steps_done} of {target}: rows flushed to the tier, " + saved
    )


class DivergedError(ValueError):
    """The loss or a gradient became NaN or Inf."""


class ResourceError(RuntimeError):
    """Memory ran out: the options ask for more than the machine has."""


def _non_finite(err: ValueError) -> bool:
    text = str(err).lower()
    return any(word in text for word in ("nan", "inf", "non-finite", "not finite"))


def _out_of_memory(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, MemoryError) or any(
        m in text
        for m in ("out of memory", "can't allocate", "cannot allocate", "not enough memory")
    )


def _resource_error(err: BaseException) -> BaseException:
    """An out-of-memory error as one line that says what to change; anything else as it is."""
    if not _out_of_memory(err):
        return err
    return ResourceError(
        f"out of memory ({one_line(err)[:200]}): lower --batch-size, --dim or the cache's size"
    )


def check_resume(path: Path, world: int, fusion_k: int, model: str = "dlrm") -> dict[str, Any]:
    """What ``--resume path`` recorded (rank 0's ``extra``), each rank's checkpoint checked
    first (its CURRENT and manifest, the ranks that wrote it, the ids' width, the model).

    Raises:
        ValueError: one line that says what is wrong.
    """
    if not path.is_dir():
        raise ValueError(f"--resume {path}: not a directory")
    extras = []
    for rank in range(world):
        where = rank_dir(path, rank, world)
        try:
            check_checkpoint_dir(where, for_resume=True)
            extras.append(read_extra(where))
        except (FileNotFoundError, CheckpointError, OSError, ValueError) as err:
            written = sorted(p.name for p in path.glob("rank-*"))
            hint = ""
            if world == 1 and written:
                hint = f" (it holds {len(written)} ranks' checkpoints: give --nproc {len(written)})"
            elif world > 1 and not written and (path / "CURRENT").exists():
                hint = " (written by one process: resume without --nproc)"
            raise ValueError(f"--resume {path}: {one_line(err)}{hint}") from None
    first = extras[0]
    saved_world = first.get("world_size", 1)
    if saved_world != world:
        raise ValueError(
            f"--resume {path}: written by {saved_world} rank(s), this run has {world}: each "
            "rank holds the rows it owns"
        )
    saved_k = first.get("fusion_k", FUSION_K)
    if saved_k != fusion_k:  # its rows are keyed by ids folded to saved_k bits
        raise ValueError(
            f"--resume {path}: written with --fusion-k {saved_k}, this run has {fusion_k}: "
            f"the ids of its rows are folded to {saved_k} bits"
        )
    saved_model = first.get("model", "dlrm")  # written before --model: a DLRM
    if saved_model != model:
        raise ValueError(
            f"--resume {path}: written by --model {saved_model}, this run has --model {model}: "
            "give the same --model"
        )
    return first


def check_checkpoint_path(path: Path) -> None:
    """That ``--checkpoint path`` can be written, before training (`embcache.checkpoint.
    check_checkpoint_dir`: a directory, or missing under a writable one).

    Raises:
        ValueError: one line that says what is wrong.
    """
    try:
        check_checkpoint_dir(path, for_resume=False)
    except (CheckpointError, OSError) as err:
        raise ValueError(f"--checkpoint {path}: {one_line(err)}") from None


def _build(args, data, cache, store, device, lr, dense_lr, world) -> tuple:
    """The model (sharded over the ranks when ``world > 1``) and its two optimizers."""
    if args.model == "seq":
        return _build_sequence(args, data, cache, store, device, lr, dense_lr, world)
    kwargs: dict[str, Any] = {}
    if world > 1:
        from embcache.distributed.sharded import ShardedEmbeddingBagCollection

        kwargs["collection_cls"] = ShardedEmbeddingBagCollection
    model = DLRM(
        data.tables(args.dim),
        cache=default_cache(args, data, cache),
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


def _build_sequence(args, data, cache, store, device, lr, dense_lr, world) -> tuple:
    """``--model seq``: a `SequenceRecommender` over the data's bags and its one history
    (both collections sharded over the ranks when ``world > 1``)."""
    kwargs: dict[str, Any] = {}
    if world > 1:
        from embcache.distributed import ShardedEmbeddingBagCollection, ShardedEmbeddingCollection

        kwargs["bag_collection_cls"] = ShardedEmbeddingBagCollection
        kwargs["sequence_collection_cls"] = ShardedEmbeddingCollection
    ((history, target),) = data.sequence_features().items()
    model = SequenceRecommender(
        data.tables(args.dim),
        target=target,
        history=history,
        history_length=data.history_length,
        cache=default_cache(args, data, cache),
        store=store,
        device=device,
        mlp=(64, 32),
        seed=args.seed,
        fusion_k=args.fusion_k,
        **kwargs,
    )
    sparse_opt = make_sparse_optimizer(args.optimizer, model.sparse_arch.collections(), lr)
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
    model: Model,
    dense_opt: Any,
    sparse_opt: Any,
    steps_done: int,
    world: int = 1,
    store: str | None = None,
    tier_state: TierState | None = None,
    run: dict[str, Any] | None = None,
) -> None:
    """`embcache.save` of the model with both optimizers (sparse first), the number of
    training batches consumed, so `--resume` continues with the next one, the number of ranks
    that wrote it, the model's kind (``--model``), the ids' ``fusion_k`` (a resumed run must
    fold raw ids alike), the tier's
    URL without its password (a resumed run keeps the tier unless told otherwise) and the
    tier's owner token, so that a resumed run takes over this job's tables once it is dead, and
    the tier's state (`embcache.kv.tier_state`) the rows were saved from; ``run``
    (`run_facts`): the step the run is to end at and where and how often it saves, so that
    ``--resume`` alone finishes it the same way."""
    extra: dict[str, Any] = {
        "steps_done": steps_done,
        "world_size": world,
        "model": "seq" if isinstance(model, SequenceRecommender) else "dlrm",
        "fusion_k": model.sparse_arch.fusion_k,
    }
    if store is not None:
        extra["store"] = redact_url(store)
    owner = model.sparse_arch.store.lease_owner
    if owner is not None:
        extra["tier_owner"] = owner
    if tier_state is not None:
        extra["tier_state"] = tier_state.to_dict()
    extra.update(run or {})
    embcache_save(path, model, [sparse_opt, dense_opt], extra=extra)
