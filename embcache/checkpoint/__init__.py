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

`load` opens the one snapshot CURRENT names (share-locked, so a concurrent save leaves it in
place) and first reads and verifies everything: only regular files inside it (no link, FIFO or
device; sizes checked before reading), checksums, ids, shapes and dtypes, finite values, the
types of hyper-parameters, cache states, and that the checkpoint fits the model (tables matched
by name) and optimizers. Any problem is a `CheckpointError` naming the file (or a ValueError
saying what does not fit), with the model, optimizers and tier untouched. Only then does it
apply: table rows into the tier (re-reading each chunk and checking its checksum again), then
the caches, optimizers and dense state. A tier that fails while rows are being written leaves
the tables partly loaded: load again once it is back (a load is idempotent).

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

import copy
import dataclasses
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from embcache.checkpoint.verify import (
    check_finite,
    dense_state,
    verify_caches,
    verify_dense,
    verify_optimizers,
)
from embcache.engine.interface import CachedCollectionInterface
from embcache.engine.row_init import DrawnInit
from embcache.kv.base import HashedInit, RowInit, Store, TableSpec
from embcache.optim.sparse import SparseOptimizer
from embcache.recstore.dist_embedding import DistEmbedding
from embcache.recstore.kv_client import KVClient

__all__ = [
    "CheckpointError",
    "check_checkpoint_dir",
    "latest_snapshot",
    "load",
    "read_extra",
    "save",
]


@dataclass
class _Rows:
    """A module whose table rows live in a tier: a cached collection (its tables behind its
    caches) or a `DistEmbedding` (one tensor of its KV client)."""

    store: Store
    tables: list[str]
    settle: Callable[[], None]  # before reading the tier: write everything pending to it
    reset: Callable[[], None]  # before writing the tier: drop what the module holds of it
    caches: Callable[[], list]  # its device caches (their policy state is saved too)
    fusion_k: int | None = None  # a collection's: raw ids of unbounded tables fold to it
    specs: dict[str, TableSpec] | None = None  # a collection's own specs (init kept in step)


KV_CLIENT_MODULE = "<kv_client>"
"""The module name under which the tensors of `save`'s ``kv_client`` are recorded."""


def _row_modules(model: nn.Module, kv_client: KVClient | None = None) -> list[tuple[str, _Rows]]:
    found, dist_names = [], set()
    for name, m in model.named_modules():
        if isinstance(m, CachedCollectionInterface):
            tables = [t.name for t in m.tables]
            rows = _Rows(
                m.store, tables, m.flush, m.invalidate_caches, m.caches, m.fusion_k, m.specs
            )
            found.append((name, rows))
        elif isinstance(m, DistEmbedding):
            client = m.weight.client
            rows = _Rows(client.store, [m.name], client.flush, client.flush, list)
            found.append((name, rows))
            if client is kv_client:
                dist_names.add(m.name)
    if kv_client is not None:
        # Its own tensors (`init_data`, DistTensor) that no DistEmbedding above holds; a
        # collection's tables registered on it are saved with the collection.
        names = [n for n in kv_client.tier_names() if n not in dist_names]
        found.append(
            (
                KV_CLIENT_MODULE,
                _Rows(kv_client.store, names, kv_client.flush, kv_client.flush, list),
            )
        )
    return found


def _dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return dense_state(model, CachedCollectionInterface)


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
    for m_index, (m_name, holder) in enumerate(_row_modules(model, kv_client)):
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
    manifest["dense"] = write_tensors(tmp, "dense.safetensors", _dense_state(model))
    for i, (kind, opt) in enumerate(zip(kinds, optimizers, strict=True)):
        state = opt.hyper_state_dict() if kind == "sparse" else opt.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        tree = encode_tree(state, tensors, f"optimizers[{i}]")
        entry = write_tensors(tmp, f"optim-{i}.safetensors", tensors, meta=tree)
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


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The ``extra`` dict saved with the checkpoint in ``path`` (manifest verified), without
    loading anything: e.g. to reopen a tier as the job that saved it before `load`."""
    with Snapshot(Path(path)) as snap:
        return dict(_manifest(snap)["extra"])


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
                _manifest(snap)
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


def _manifest(snap: Snapshot) -> dict[str, Any]:
    """The snapshot's manifest, checked against CURRENT's checksum and for shape."""
    where = snap.path / "manifest.json"
    text = snap.manifest_bytes()
    if snap.digest is not None and sha256_of(text) != snap.digest:
        raise CheckpointError(
            f"{where} does not match the sha256 that {snap.root / CURRENT} records"
        )
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{where} is not valid JSON: {err}") from None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: checkpoint format {version!r}; this embcache loads format "
            f"{FORMAT_VERSION} only (data-only safetensors files with checksums). Format 1 "
            f"checkpoints hold pickled .pt files, which can run code when loaded, so they are "
            f"refused: save a new checkpoint from a model restored with the embcache that "
            f"wrote it, if you trust its files"
        )
    if snap.digest is None:
        raise CheckpointError(f"{snap.root / CURRENT} lacks the sha256 of {where}")
    _check_manifest(manifest, where)
    return manifest


def _check_manifest(manifest: dict[str, Any], where: Path) -> None:
    def fail(what: str) -> None:
        raise CheckpointError(f"{where}: malformed manifest: {what}")

    if not isinstance(manifest.get("tables"), list):
        fail("'tables' is not a list")
    for entry in manifest["tables"]:
        if not isinstance(entry, dict):
            fail(f"table entry {entry!r}")
        for key, kind in (
            ("module", str),
            ("table", str),
            ("dim", int),
            ("state_dim", int),
            ("rows", int),
            ("files", list),
        ):
            if not isinstance(entry.get(key), kind):
                fail(f"table entry {entry.get('table')!r} has no valid {key!r}")
        counted = sum(f.get("rows", -1) if isinstance(f, dict) else -1 for f in entry["files"])
        if counted != entry["rows"] or any(
            not isinstance(f, dict) or not isinstance(f.get("rows"), int) or f["rows"] < 0
            for f in entry["files"]
        ):
            fail(
                f"table {entry['table']!r} has {entry['rows']} rows but its files list "
                f"{counted} (a file entry missing or damaged)"
            )
        init = entry.get("init")
        if init is not None and not (
            isinstance(init, dict)
            and (
                init.get("kind") == "hashed"
                or (init.get("kind") == "drawn" and isinstance(init.get("files"), list))
            )
        ):
            fail(f"table {entry['table']!r} has an invalid 'init' record {init!r}")
    if not isinstance(manifest.get("optimizers"), list) or not all(
        isinstance(o, dict) and o.get("kind") in ("sparse", "torch") for o in manifest["optimizers"]
    ):
        fail("'optimizers' is not a list of {kind: sparse|torch, ...}")
    if not isinstance(manifest.get("dense"), dict):
        fail("'dense' is missing")
    if not isinstance(manifest.get("caches", []), list):
        fail("'caches' is not a list")
    if not isinstance(manifest.get("extra"), dict):
        fail("'extra' is not an object")


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Sequence[Any] = (),
    allow_nonfinite: bool = False,
    kv_client: KVClient | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint written by `save` into ``model`` and ``optimizers``; returns the
    ``extra`` dict given to `save`.

    The optimizers must be constructed (attached to the model) before loading, in the order
    given to `save`. Tables are matched by module path and name (not position) and must have
    the same dims. Everything is read and verified before anything changes: every file's size
    and checksum, table ids, rows, dense and optimizer tensors (shapes, dtypes, finite values),
    hyper-parameters (types) and cache states. Only regular files inside the one snapshot that
    CURRENT named when the load began are read, while a concurrent `save` keeps it in place.

    Args:
        path: the checkpoint directory given to `save`.
        model: the model to restore (the same tables and dense parameters).
        optimizers: the optimizers given to `save`, in the same order.
        allow_nonfinite: accept NaN or Inf in rows, dense tensors, optimizer state and
            hyper-parameters (refused by default: such a checkpoint would fail the first step).
        kv_client: the KV client whose tensors the checkpoint holds (the one given to `save`,
            or a fresh one declaring the same tensors with the same shapes and optimizers).

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint.
        CheckpointError: a file is missing, damaged, malformed, not a regular file, holds
            NaN/Inf, is of format 1, or lies outside the checkpoint; the message names it.
            Nothing was changed.
        ValueError: the checkpoint does not fit this model or these optimizers. Nothing was
            changed.
    """
    with Snapshot(Path(path)) as snap:
        return _load(snap, model, optimizers, allow_nonfinite, kv_client)


def _load(
    snap: Snapshot,
    model: nn.Module,
    optimizers: Sequence[Any],
    allow_nonfinite: bool,
    kv_client: KVClient | None,
) -> dict[str, Any]:
    manifest = _manifest(snap)
    if len(manifest["optimizers"]) != len(optimizers):
        raise ValueError(
            f"checkpoint holds {len(manifest['optimizers'])} optimizers, "
            f"{len(optimizers)} were given"
        )
    if kv_client is not None and not isinstance(kv_client, KVClient):
        raise TypeError(f"kv_client must be a KVClient, got {type(kv_client).__name__}")
    holders = dict(_row_modules(model, kv_client))
    tables = _verify_tables(snap, manifest, holders, allow_nonfinite)
    dense = verify_dense(snap, manifest["dense"], _dense_state(model), allow_nonfinite)
    states = verify_optimizers(snap, manifest["optimizers"], optimizers, allow_nonfinite)
    caches = verify_caches(snap, manifest, holders)

    # Everything checked: apply. Only the tier can fail from here on (then load again).
    for holder in holders.values():
        holder.reset()
    for holder, entry, saved, init in tables:
        table, store = entry["table"], holder.store
        if init is not None:  # before the stale rows are reset: they too start from it
            _adopt_init(holder, table, init)
        spec = store.table_spec(table)
        bounded = store.keeps_scores(table)
        for chunk in list(store.export_rows(table)):
            stale = chunk[0][~torch.isin(chunk[0], saved)]
            if stale.numel() and bounded:  # a bounded table holds exactly the rows saved
                store.remove(table, stale)
            elif stale.numel():
                store.put(table, stale, spec.initial_rows(stale))
        for k, f in enumerate(entry["files"]):
            chunk, _ = snap.tensors(f, f"table {table!r} chunk {k}")  # checksum checked again
            scores = chunk.get("scores") if bounded else None
            store.import_rows(table, chunk["ids"], chunk["rows"], scores)
    for cache, tensors, meta in caches:
        cache.load_policy_state(tensors, meta)
    backups = []
    try:
        for opt, state in zip(optimizers, states, strict=True):
            if isinstance(opt, SparseOptimizer):
                opt.load_hyper_state_dict(state)
            else:
                backups.append((opt, copy.deepcopy(opt.state_dict())))
                opt.load_state_dict(state)
    except BaseException:
        for opt, backup in backups:
            opt.load_state_dict(backup)
        raise
    with torch.no_grad():
        targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for k, v in dense.items():
            targets[k].copy_(v)
    return dict(manifest["extra"])


def _adopt_init(holder: _Rows, table: str, init: RowInit) -> None:
    """Make ``table`` create its rows with ``init`` from now on, in the tier (re-declared with
    it) and in the collection's own spec."""
    holder.store.init_table(dataclasses.replace(holder.store.table_spec(table), init=init))
    if holder.specs is not None and table in holder.specs:
        holder.specs[table].init = init


def _verify_init(
    snap: Snapshot, entry: dict[str, Any], spec: TableSpec, allow_nonfinite: bool
) -> RowInit | None:
    """The initialiser a table entry records (None: no record), checked: a recipe that
    `HashedInit.from_recipe` takes, or drawn weights ``[num_embeddings, dim]`` float32."""
    recipe, table = entry.get("init"), entry["table"]
    if recipe is None:
        return None
    where = f"{snap.path / 'manifest.json'}: table {table!r}"
    if recipe["kind"] == "hashed":
        try:
            return HashedInit.from_recipe(table, recipe)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{where}: invalid init recipe: {err}") from None
    parts = []
    for k, f in enumerate(recipe["files"]):
        what = f"table {table!r} initial weights {k}"
        chunk, _ = snap.tensors(f, what)
        weights = chunk.get("weights")
        if (
            set(chunk) != {"weights"}
            or weights.dtype != torch.float32
            or weights.dim() != 2
            or weights.shape[1] != spec.dim
            or not isinstance(f, dict)
            or weights.shape[0] != f.get("rows")
        ):
            raise CheckpointError(
                f"{snap.path / str(f['name'])} ({what}): expected float32 'weights' of "
                f"{f.get('rows') if isinstance(f, dict) else '?'} rows x {spec.dim}"
            )
        check_finite(weights, f"{snap.path / str(f['name'])} ({what})", allow_nonfinite)
        parts.append(weights)
    total = sum(p.shape[0] for p in parts)
    if spec.num_embeddings is None or total != spec.num_embeddings:
        raise CheckpointError(
            f"{where}: {total} initial rows recorded, the table has {spec.num_embeddings}"
        )
    return DrawnInit(torch.cat(parts) if len(parts) > 1 else parts[0])


def _verify_tables(
    snap: Snapshot, manifest: dict[str, Any], holders: dict[str, _Rows], allow_nonfinite: bool
) -> list[tuple[_Rows, dict[str, Any], torch.Tensor, RowInit | None]]:
    """Check every table entry against the model (by module and table name), every chunk
    file (checksum, ids, shapes, finite rows) and the initialiser recorded; returns
    ``(module's rows, entry, ids saved, initialiser or None)`` per table."""
    out, seen = [], set()
    for entry in manifest["tables"]:
        table, module = entry["table"], entry["module"]
        holder = holders.get(module)
        if holder is None and module == KV_CLIENT_MODULE:
            raise ValueError(
                f"checkpoint table {table!r} is a tensor of the KV client given to save: "
                "load it with kv_client= a client declaring the same tensors"
            )
        if holder is None:
            raise ValueError(
                f"checkpoint table {table!r} belongs to module {module!r}, which this model lacks"
            )
        if table not in holder.tables or (module, table) in seen:
            raise ValueError(
                f"checkpoint table {table!r} of module {module!r}: unknown or repeated"
            )
        seen.add((module, table))
        spec = holder.store.table_spec(table)
        got = (spec.dim, spec.num_embeddings, spec.state_dim)
        want = (entry["dim"], entry.get("num_embeddings"), entry["state_dim"])
        if got != want:
            raise ValueError(
                f"table {table!r}: checkpoint has (dim, rows, state) {want}, the model "
                f"{got}; attach the same optimizer before loading"
            )
        saved_k = entry.get("fusion_k")
        if spec.num_embeddings is None and saved_k is not None and saved_k != holder.fusion_k:
            raise ValueError(
                f"table {table!r}: its rows are keyed by raw ids folded to fusion_k={saved_k} "
                f"bits, the model folds them to {holder.fusion_k}; build it with "
                f"fusion_k={saved_k} to load this checkpoint"
            )
        dtype = str(spec.dtype).removeprefix("torch.")
        if entry.get("dtype", "float32") != dtype:
            raise ValueError(
                f"table {table!r}: checkpoint rows hold {entry.get('dtype')} weights, the model "
                f"{dtype}; load it into a model of the same data_type / weight_dtype"
            )
        keys = {"ids", "rows", "scores"} if entry.get("scores") else {"ids", "rows"}
        saved, last = [], -1
        for k, f in enumerate(entry["files"]):
            what = f"table {table!r} chunk {k}"
            chunk, _ = snap.tensors(f, what)
            where = f"{snap.path / str(f['name'])} ({what})"
            ids, rows = chunk.get("ids"), chunk.get("rows")
            if set(chunk) != keys or ids.dtype != torch.int64 or ids.dim() != 1:
                raise CheckpointError(f"{where}: expected {sorted(keys)}, got {list(chunk)}")
            if (
                ids.numel() != f["rows"]
                or rows.dtype != spec.dtype
                or tuple(rows.shape) != (ids.numel(), spec.stored_width)
                or ("scores" in keys and tuple(chunk["scores"].shape) != (ids.numel(),))
            ):
                raise CheckpointError(
                    f"{where}: {ids.numel()} ids and rows {tuple(rows.shape)} {rows.dtype}; "
                    f"expected {f['rows']} ids and {dtype} rows of width {spec.stored_width}"
                    + (" with a score each" if "scores" in keys else "")
                )
            if ids.numel():
                ascending = bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) > last
                limit = spec.num_embeddings
                if not ascending or (limit is not None and int(ids[-1]) >= limit):
                    raise CheckpointError(
                        f"{where}: ids must be ascending, distinct and in [0, {limit})"
                    )
                last = int(ids[-1])
            # Weights and state apart: half-precision rows carry the float32 state as its bits,
            # which read as 16-bit values may look like NaN or Inf.
            weights, state = spec.unpack(rows)
            check_finite(weights, f"{where}: weights", allow_nonfinite)
            check_finite(state, f"{where}: optimizer state", allow_nonfinite)
            saved.append(ids)
        ids = torch.cat(saved) if saved else torch.empty(0, dtype=torch.int64)
        out.append((holder, entry, ids, _verify_init(snap, entry, spec, allow_nonfinite)))
    missing = [(m, t) for m, h in holders.items() for t in h.tables if (m, t) not in seen]
    if missing:
        raise ValueError(f"the checkpoint holds no rows for tables {missing} of this model")
    return out
