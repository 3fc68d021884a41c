"""Checkpoints of models with cached collections (and RecStore `DistEmbedding` modules): the
rows that exist in each table (weights and optimizer state; a row exists once a batch looked
it up or it was written), the optimizers' state, and the model's dense state,
written so that a crash never loses the previous checkpoint and loaded so that a damaged or
crafted one can neither run code nor be half-applied.

    embcache.save("ckpt/", model, [sparse_opt, dense_opt])
    ...
    embcache.load("ckpt/", model, [sparse_opt, dense_opt])

Layout of a checkpoint directory (format 2)::

    ckpt/
      CURRENT                     name of the complete snapshot and the sha256 of its manifest
                                  (replaced atomically)
      snap-000003/
        manifest.json             format version, tables, files with their size and sha256,
                                  optimizer kinds, extra
        dense.safetensors         the model's state_dict without the cached tables' weights
        optim-0.safetensors ...   optimizer state: tensors, and its structure as JSON metadata
        tables/<m>-<t>-<k>.safetensors   (ids, rows[, scores]) chunks of at most ``chunk_rows``
                                  rows of table t of module m (a cached collection, or a
                                  DistEmbedding: its tensor in its KV client; or the tensors
                                  of the ``kv_client`` given), rows as the tier stores them
                                  (half-precision weights stay half), with a bounded table's
                                  eviction scores
        inits/<m>-<t>-<k>.safetensors    the initial weights of a table drawn whole (torchrec's
                                  draws from torch's generator), in chunks of ``chunk_rows``
        caches/<m>-<c>.safetensors       cache c of module m: which row each slot holds, its
                                  scores, LFU/admission counts (and the sightings since the
                                  admission sketch was halved) and clocks (`HotCache.
                                  policy_state`), so a resumed run makes the same choices

Every file holds data only (safetensors and JSON; `embcache.checkpoint.files`). `save` flushes
the caches, streams each table from its tier chunk by chunk (so a table larger than free memory
can be saved), fsyncs every file and the snapshot directory, then points CURRENT at the new
snapshot with an atomic rename and removes older snapshots (not one a load is reading). A crash
at any point leaves CURRENT naming a complete snapshot; a save that fails (a full disk) removes
what it wrote and says so, and what a killed save left is removed by the next one.

`load` (`embcache.checkpoint.restore`) opens the one snapshot CURRENT names (share-locked, so
a concurrent save leaves it in place) and first reads and verifies everything: only regular
files inside it (no link, FIFO or device; sizes checked before reading), checksums, ids, shapes
and dtypes, finite values, the types of hyper-parameters, cache states, and that the checkpoint
fits the model (tables matched by name) and optimizers. Any problem is a `CheckpointError`
naming the file (or a ValueError saying what does not fit), with the model, optimizers and tier
untouched. Only then does it apply: table rows into the tier (re-reading each chunk and checking
its checksum again), then the caches, optimizers and dense state. A tier that fails while rows
are being written leaves the tables partly loaded: load again once it is back (a load is
idempotent).

Rows never touched are not stored: their value is their initialiser's, a function of the id,
and the manifest records that initialiser per table (``"init"``): a hashed one by its recipe
(seed, distribution and parameters: `kv.base.HashedInit`), one drawn whole by its draws
(`engine.row_init.DrawnInit`, in ``inits/``). `load` makes the model's tables adopt the
checkpoint's initialiser before it applies the rows, so every row, touched or not, is the
saved model's, whatever seed the loading model was built with (a checkpoint without the record,
from an older embcache, or of a table whose initialiser has no recipe, leaves the model's own).
`load` also resets rows that the live tier holds but the checkpoint does not (and removes them
from a bounded table, so it holds exactly the rows saved). With the tier's scores
and the caches' states restored, training resumed from a checkpoint is bit-exact with training
that went on, bounded tiers included (a cache of another size, or of a collection declaring its
tables in another order, starts empty instead).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from embcache.checkpoint.files import (
    CURRENT,
    FORMAT_VERSION,
    SNAPSHOT_RE,
    CheckpointError,
    Snapshot,
    encode_tree,
    fsync_dir,
    remove_snapshot,
    sha256_of,
    write_bytes,
    write_tensors,
)
from embcache.checkpoint.holders import KV_CLIENT_MODULE as KV_CLIENT_MODULE
from embcache.checkpoint.holders import model_dense_state, row_holders
from embcache.checkpoint.restore import load, read_extra, read_manifest
from embcache.engine.row_init import DrawnInit
from embcache.kv.base import HashedInit, TableSpec
from embcache.optim.sparse import SparseOptimizer
from embcache.recstore.kv_client import KVClient

__all__ = [
    "CheckpointError",
    "check_checkpoint_dir",
    "latest_snapshot",
    "load",
    "read_extra",
    "save",
]


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Sequence[Any] = (),
    chunk_rows: int = 1 << 16,
    extra: dict[str, Any] | None = None,
    kv_client: KVClient | None = None,
) -> Path:
    """Write a checkpoint of ``model`` (and ``optimizers``) into directory ``path``.

    Args:
        path: checkpoint directory (created if missing); earlier snapshots in it are replaced.
        model: a model holding cached collections (or one itself).
        optimizers: embcache sparse optimizers and/or torch optimizers, in a fixed order that
            `load` receives again.
        chunk_rows: rows per table chunk file (bounds the memory a save needs).
        extra: JSON-serialisable facts to keep with the checkpoint (e.g. steps done); `load`
            and `read_extra` return them.
        kv_client: a RecStore KV client (`embcache.get_kv_client()`) whose tensors
            (`init_data`, `DistTensor`: rows and their backend optimizer's state) are saved
            too; `load` must then be given a client declaring the same tensors.

    Returns:
        The snapshot directory written.
    """
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    if kv_client is not None and not isinstance(kv_client, KVClient):
        raise TypeError(f"kv_client must be a KVClient, got {type(kv_client).__name__}")
    extra = dict(extra or {})
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise TypeError(f"extra must be JSON-serialisable: {err}") from None
    kinds = []
    for i, opt in enumerate(optimizers):
        if isinstance(opt, SparseOptimizer):
            kinds.append("sparse")
        elif isinstance(opt, torch.optim.Optimizer):
            kinds.append("torch")
        else:
            raise TypeError(f"optimizers[{i}]: cannot checkpoint a {type(opt).__name__}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    number = 1 + max(
        (int(p.name[5:]) for p in root.glob("snap-*") if SNAPSHOT_RE.fullmatch(p.name)), default=0
    )
    snap = root / f"snap-{number:06d}"
    tmp = root / f".tmp-{snap.name}-{os.getpid()}"
    pointer = root / f".{CURRENT}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    written = None  # the snapshot directory once renamed, until CURRENT names it
    try:
        (tmp / "tables").mkdir(parents=True)
        (tmp / "caches").mkdir()
        (tmp / "inits").mkdir()
        text = _write_snapshot(tmp, model, kinds, optimizers, chunk_rows, extra, kv_client)
        os.rename(tmp, snap)
        written = snap
        fsync_dir(root)
        write_bytes(pointer, f"{snap.name}\nsha256 {sha256_of(text)}\n".encode())
        os.replace(pointer, root / CURRENT)
    except BaseException as err:
        # Nothing of a failed save stays behind (a full disk must not stay full): the
        # previous snapshot, which CURRENT still names, is the checkpoint.
        shutil.rmtree(written or tmp, ignore_errors=True)
        pointer.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(
                err.errno,
                f"no space left on the device of {root} (writing {err.filename or root}): "
                f"the checkpoint was not saved and its partial files were removed; the "
                f"previous checkpoint there is intact",
                err.filename,
            ) from err
        raise
    fsync_dir(root)
    for old in root.iterdir():
        if old != snap and SNAPSHOT_RE.fullmatch(old.name):
            remove_snapshot(old)  # one a concurrent load is reading stays for the next save
    return snap


def _write_snapshot(
    tmp: Path,
    model: nn.Module,
    kinds: list[str],
    optimizers: Sequence[Any],
    chunk_rows: int,
    extra: dict[str, Any],
    kv_client: KVClient | None,
) -> bytes:
    """Write every file of a snapshot into ``tmp`` (fsynced); returns the manifest's bytes."""
    manifest: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "tables": [],
        "optimizers": [],
        "caches": [],
    }
    for m_index, (m_name, holder) in enumerate(row_holders(model, kv_client)):
        holder.settle()
        for t_index, table in enumerate(holder.tables):
            spec = holder.store.table_spec(table)
            scored = holder.store.keeps_scores(table)
            files, rows_total = [], 0
            chunks = holder.store.export_rows(table, chunk_rows, scores=scored)
            for k, chunk in enumerate(chunks):
                name = f"tables/{m_index}-{t_index}-{k:06d}.safetensors"
                tensors = dict(zip(("ids", "rows", "scores"), chunk, strict=False))
                entry = write_tensors(tmp, name, tensors)
                files.append({**entry, "rows": chunk[0].numel()})
                rows_total += chunk[0].numel()
            entry = {
                "module": m_name,
                "table": table,
                "dim": spec.dim,
                "num_embeddings": spec.num_embeddings,
                "state_dim": spec.state_dim,
                "dtype": str(spec.dtype).removeprefix("torch."),
                "fusion_k": holder.fusion_k,
                "scores": scored,
                "rows": rows_total,
                "files": files,
            }
            recipe = _write_init(tmp, f"inits/{m_index}-{t_index}", spec, chunk_rows)
            if recipe is not None:
                entry["init"] = recipe
            manifest["tables"].append(entry)
        for c_index, cache in enumerate(holder.caches()):
            tensors, meta = cache.policy_state()
            name = f"caches/{m_index}-{c_index}.safetensors"
            entry = write_tensors(tmp, name, tensors, meta=meta)
            manifest["caches"].append({"module": m_name, "cache": c_index, **entry})
    manifest["dense"] = write_tensors(tmp, "dense.safetensors", model_dense_state(model))
    for i, (kind, opt) in enumerate(zip(kinds, optimizers, strict=True)):
        state = opt.hyper_state_dict() if kind == "sparse" else opt.state_dict()
        optim_tensors: dict[str, torch.Tensor] = {}
        tree = encode_tree(state, optim_tensors, f"optimizers[{i}]")
        entry = write_tensors(tmp, f"optim-{i}.safetensors", optim_tensors, meta=tree)
        manifest["optimizers"].append({"kind": kind, **entry})
    manifest["extra"] = extra
    text = json.dumps(manifest, indent=1).encode()
    write_bytes(tmp / "manifest.json", text)
    fsync_dir(tmp / "tables")
    fsync_dir(tmp / "caches")
    fsync_dir(tmp / "inits")
    fsync_dir(tmp)
    return text


def _write_init(tmp: Path, stem: str, spec: TableSpec, chunk_rows: int) -> dict[str, Any] | None:
    """Record how a table's rows start: a hashed initialiser's recipe, or the weights of one
    drawn whole as chunk files ``{stem}-<k>.safetensors``. None for an initialiser with no
    record (a caller's own `RowInit`): its untouched rows are then the loading model's."""
    init = spec.init
    if isinstance(init, HashedInit):
        return init.recipe()
    if isinstance(init, DrawnInit):
        files = []
        for k, lo in enumerate(range(0, init.weights.shape[0], chunk_rows)):
            part = init.weights[lo : lo + chunk_rows]
            entry = write_tensors(tmp, f"{stem}-{k:06d}.safetensors", {"weights": part})
            files.append({**entry, "rows": part.shape[0]})
        return {"kind": "drawn", "files": files}
    return None


def _remove_stale_temporaries(root: Path) -> None:
    """Remove what saves killed mid-way left (``.tmp-snap-N-PID`` of a process that is gone):
    on a disk they filled, later saves would fail too."""
    for old in root.glob(".tmp-snap-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            remove_snapshot(old)
        except OSError:
            pass  # alive (another user's): maybe a save under way


def latest_snapshot(path: str | os.PathLike) -> Path:
    """The complete snapshot a checkpoint directory's CURRENT names (a directory inside it)."""
    with Snapshot(Path(path)) as snap:
        return snap.path


def check_checkpoint_dir(path: str | os.PathLike, for_resume: bool) -> None:
    """Find a checkpoint path that cannot work before a job spends time training: cheap (no
    table file is read), for a command line to call on ``--checkpoint`` (``for_resume``
    False: `save` must be able to write there) and ``--resume`` (True: a complete checkpoint
    must be there, CURRENT and manifest intact).

    Raises:
        CheckpointError: one line saying what is wrong with ``path``.
    """
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} is a file, not a directory")
    if for_resume:
        if not root.exists():
            raise CheckpointError(f"checkpoint path {root} does not exist: nothing to resume")
        try:
            with Snapshot(root) as snap:
                read_manifest(snap)
        except (FileNotFoundError, CheckpointError) as err:
            raise CheckpointError(" ".join(str(err).split())) from None
        return
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CheckpointError(f"checkpoint path {root}: {existing} is a file, not a directory")
    try:  # os.access says yes to root on a read-only mount: try a file
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise CheckpointError(
            f"checkpoint path {root} is not writable ({existing}: {err.strerror or err})"
        ) from None
