"""What a training job keeps on disk besides its final checkpoint, and what its checkpoints
record of the run: each rank's directory (`rank_dir`), the periodic history under
``DIR/steps/`` (`keep_history`), the facts ``--resume`` needs to finish a run the same way
(`run_facts`), early stopping's best model (`BestModel`), and a save that fails as one line
(`SaveError`, `save_failed`)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from embcache.checkpoint import load as embcache_load
from embcache.checkpoint import read_extra
from embcache.checkpoint import save as embcache_save
from embcache.train.loop import Model, TrainResult


def rank_dir(path: Path, rank: int, world: int) -> Path:
    """Where a rank checkpoints: ``path`` itself for one process, ``path/rank-<r>`` for each
    of several ranks (the rows it owns, and the replicated MLPs)."""
    return Path(path) if world == 1 else Path(path) / f"rank-{rank}"


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk): the run ends, the last good one kept."""


def save_failed(args: argparse.Namespace, where: Path, steps: int, err: OSError) -> str:
    """One line for a save into ``where`` (a rank's directory of ``--checkpoint``) that
    failed: the path, why, and what the directory still holds (`embcache.save` removed what
    it wrote; the previous snapshot stays)."""
    ckpt = args.checkpoint
    try:
        last = read_extra(where).get("steps_done")
    except (OSError, ValueError):
        last = None
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        why = "no space left on its device; the partial files were removed"
    else:
        why = f"{err.strerror or type(err).__name__}: {err.filename or ckpt}"
    if last is None:
        kept = f"{ckpt} holds no checkpoint of this run"
    else:
        kept = (
            f"the last good checkpoint, of step {last}, is kept in {ckpt} (continue with "
            f"--resume {ckpt} once there is room)"
        )
    return f"--checkpoint {ckpt}: saving step {steps} failed ({why}); {kept}"


class BestModel:
    """Early stopping's best model so far (``--early-stop``): saved (`embcache.save`) at each
    evaluation better than all before it, into a directory of its own (inside ``--checkpoint``
    when given, on its disk; else a temporary one), and loaded back at the end in place of the
    last model when that one is worse, so that the model kept, evaluated and checkpointed is
    the best one."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        parent = Path(args.checkpoint) if args.checkpoint is not None else None
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".best-rank{rank}-", dir=parent))
        self.step: int | None = None  # the step (of this run) of the model saved

    def keep(self, step: int, model: Model, dense_opt: Any, sparse_opt: Any) -> None:
        try:
            embcache_save(self.path, model, [sparse_opt, dense_opt])
        except OSError as err:
            if isinstance(err, ConnectionError):
                raise
            why = err.strerror or type(err).__name__
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                why = "no space left on its device"
            raise SaveError(
                f"--early-stop: saving the best model so far (step {step} of this run) into "
                f"{self.path} failed ({why})"
            ) from None
        self.step = step

    def restore(self, result: TrainResult, model: Model, dense_opt: Any, sparse_opt: Any) -> bool:
        """Load the best model saved when it beats ``result.eval`` (the last model's); sets
        ``result.kept_step``. Returns whether it did."""
        found = result.best_eval()
        if self.step is None or found is None or int(found["step"]) != self.step:
            return False
        if self.step == len(result.losses):
            return False
        embcache_load(self.path, model, [sparse_opt, dense_opt])
        result.kept_step = self.step
        return True

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def keep_history(root: Path, rank: int, world: int, steps_done: int, keep: int) -> None:
    """Keep the checkpoint just saved as ``root/steps/step-<steps_done>`` (hard links to the
    snapshot's files: no copy) and remove all but the ``keep`` newest such directories. Each
    is a checkpoint directory that ``--resume`` takes (with its ``rank-<r>`` inside for
    several ranks)."""
    from embcache.checkpoint import latest_snapshot

    source = rank_dir(root, rank, world)
    history = Path(root) / "steps"
    target = rank_dir(history / f"step-{steps_done:09d}", rank, world)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    snap = latest_snapshot(source)
    tmp.mkdir(parents=True)
    try:
        shutil.copytree(snap, tmp / snap.name, copy_function=os.link)
    except OSError:  # a file system without hard links
        shutil.rmtree(tmp / snap.name, ignore_errors=True)
        shutil.copytree(snap, tmp / snap.name)
    shutil.copy2(source / "CURRENT", tmp / "CURRENT")
    os.rename(tmp, target)
    steps = sorted(p for p in history.glob("step-*") if p.name[5:].isdigit())
    for old in steps[: max(0, len(steps) - keep)]:
        shutil.rmtree(rank_dir(old, rank, world), ignore_errors=True)
        if world > 1:
            with contextlib.suppress(OSError):
                old.rmdir()  # the last rank to prune it removes it


def run_facts(args: argparse.Namespace, target: int) -> dict[str, Any]:
    """What a checkpoint records of its run for ``--resume`` to carry on alike: the step it
    is to end at (``target_steps``), its ``--checkpoint`` directory (absolute: a run resumed
    from ``DIR/steps/step-N`` or from another directory keeps saving into ``DIR``), its
    ``--checkpoint-every`` and ``--keep-checkpoints``."""
    facts: dict[str, Any] = {"target_steps": int(target)}
    if args.checkpoint is not None:
        facts["checkpoint"] = str(Path(args.checkpoint).resolve())
        facts["checkpoint_every"] = int(args.checkpoint_every or 0)
        facts["keep_checkpoints"] = int(args.keep_checkpoints or 3)
    return facts
