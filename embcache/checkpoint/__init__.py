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
                                  DistEmbedding: its tensor in its KV client), rows as the tier
                                  stores them (half-precision weights stay half), with a bounded
                                  table's eviction scores
        caches/<m>-<c>.safetensors       cache c of module m: which row each slot holds, its
                                  scores, LFU/admission counts (and the sightings since the
                                  admission sketch was halved) and clocks (`HotCache.
                                  policy_state`), so a resumed run makes the same choices

Every file holds data only (safetensors and JSON; `embcache.checkpoint.files`). `save` flushes
the caches, streams each table from its tier chunk by chunk (so a table larger than free memory
can be saved), fsyncs every file and the snapshot directory, then points CURRENT at the new
snapshot with an atomic rename and removes older snapshots. A crash at any point leaves CURRENT
naming a complete snapshot.

`load` first reads and verifies everything (checksums, shapes, ids, that the checkpoint fits
the model and optimizers), keeping only what it needs; any problem is a `CheckpointError`
naming the file, with the model, optimizers and tier untouched. Only then does it apply: table
rows into the tier (re-reading each chunk and checking its checksum again), then the dense state
and optimizers. A tier that fails while rows are being written leaves the tables partly loaded:
load again once it is back (a load is idempotent).

Rows never touched are not stored (their value is their initialiser's, a function of the id).
`load` therefore also resets rows that the live tier holds but the checkpoint does not (and
removes them from a bounded table, so it holds exactly the rows saved). With the tier's scores
and the caches' states restored, training resumed from a checkpoint is bit-exact with training
that went on, bounded tiers included (a cache of another size starts empty instead).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
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
    decode_tree,
    encode_tree,
    fsync_dir,
    read_tensors,
    sha256_of,
    write_bytes,
    write_tensors,
)
from embcache.engine.interface import CachedCollectionInterface
from embcache.kv.base import Store
from embcache.optim.sparse import SparseOptimizer
from embcache.recstore.dist_embedding import DistEmbedding

__all__ = ["CheckpointError", "latest_snapshot", "load", "read_extra", "save"]


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


def _row_modules(model: nn.Module) -> list[tuple[str, _Rows]]:
    found = []
    for name, m in model.named_modules():
        if isinstance(m, CachedCollectionInterface):
            tables = [t.name for t in m.tables]
            rows = _Rows(m.store, tables, m.flush, m.invalidate_caches, m.caches, m.fusion_k)
            found.append((name, rows))
        elif isinstance(m, DistEmbedding):
            client = m.weight.client
            rows = _Rows(client.store, [m.name], client.flush, client.flush, list)
            found.append((name, rows))
    return found


def _dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers outside the cached collections (whose
    tables are saved row by row, never materialised whole)."""
    state = {}
    for module_name, module in model.named_modules():
        if isinstance(module, CachedCollectionInterface):
            continue  # (a DistEmbedding has no parameters: its rows live in its KV client)
        prefix = f"{module_name}." if module_name else ""
        for k, v in module.named_parameters(recurse=False):
            state[prefix + k] = v.detach().cpu().clone()
        for k, v in module.named_buffers(recurse=False):
            if k not in module._non_persistent_buffers_set:
                state[prefix + k] = v.detach().cpu().clone()
    return state


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Sequence[Any] = (),
    chunk_rows: int = 1 << 16,
    extra: dict[str, Any] | None = None,
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

    Returns:
        The snapshot directory written.
    """
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
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
    number = 1 + max(
        (int(p.name[5:]) for p in root.glob("snap-*") if SNAPSHOT_RE.fullmatch(p.name)), default=0
    )
    snap = root / f"snap-{number:06d}"
    tmp = root / f".tmp-{snap.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "tables").mkdir(parents=True)
    (tmp / "caches").mkdir()

    manifest: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "tables": [],
        "optimizers": [],
        "caches": [],
    }
    for m_index, (m_name, holder) in enumerate(_row_modules(model)):
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
            manifest["tables"].append(
                {
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
            )
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
    fsync_dir(tmp)
    os.rename(tmp, snap)
    fsync_dir(root)

    pointer = root / f".{CURRENT}.tmp"
    write_bytes(pointer, f"{snap.name}\nsha256 {sha256_of(text)}\n".encode())
    os.replace(pointer, root / CURRENT)
    fsync_dir(root)
    for old in root.iterdir():
        if old != snap and (old.name.startswith("snap-") or old.name.startswith(".tmp-snap-")):
            shutil.rmtree(old, ignore_errors=True)
    return snap


def latest_snapshot(path: str | os.PathLike) -> Path:
    """The complete snapshot a checkpoint directory's CURRENT names (a directory inside it)."""
    return _pointer(Path(path))[0]


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The ``extra`` dict saved with the checkpoint in ``path`` (manifest verified), without
    loading anything: e.g. to reopen a tier as the job that saved it before `load`."""
    return dict(_manifest(Path(path))[1]["extra"])


def _pointer(root: Path) -> tuple[Path, str | None]:
    """The snapshot CURRENT names and the manifest checksum it records (None: format 1)."""
    current = root / CURRENT
    if not current.exists():
        raise FileNotFoundError(f"{root} holds no complete checkpoint (no {CURRENT} file)")
    try:
        lines = current.read_text().split("\n")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{current} cannot be read: {err}") from None
    name = lines[0].strip()
    if not SNAPSHOT_RE.fullmatch(name):
        raise CheckpointError(
            f"{current} names {name[:80]!r}, not a snapshot of this directory (snap-NNNNNN)"
        )
    snap = root / name
    if snap.is_symlink() or not snap.resolve().parent == root.resolve():
        raise CheckpointError(f"{current}: snapshot {snap} lies outside {root}")
    if not (snap / "manifest.json").exists():
        raise FileNotFoundError(f"checkpoint {snap} is incomplete (no manifest.json)")
    digest = lines[1].strip() if len(lines) > 1 and lines[1].strip() else None
    if digest is not None:
        if not digest.startswith("sha256 ") or len(digest) != 7 + 64:
            raise CheckpointError(f"{current}: malformed checksum line {digest[:80]!r}")
        digest = digest[7:]
    return snap, digest


def _manifest(root: Path) -> tuple[Path, dict[str, Any]]:
    """The snapshot and its manifest, checked against CURRENT's checksum and for shape."""
    snap, digest = _pointer(root)
    where = snap / "manifest.json"
    try:
        text = where.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{where} cannot be read: {err.strerror or err}") from None
    if digest is not None and sha256_of(text) != digest:
        raise CheckpointError(f"{where} does not match the sha256 that {root / CURRENT} records")
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
    if digest is None:
        raise CheckpointError(f"{root / CURRENT} lacks the sha256 of {where}")
    _check_manifest(manifest, where)
    return snap, manifest


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
    path: str | os.PathLike, model: nn.Module, optimizers: Sequence[Any] = ()
) -> dict[str, Any]:
    """Restore a checkpoint written by `save` into ``model`` and ``optimizers``; returns the
    ``extra`` dict given to `save`.

    The optimizers must be constructed (attached to the model) before loading, in the order
    given to `save`. Tables are matched by module path and name and must have the same dims.
    Everything is read and verified before anything changes.

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint.
        CheckpointError: a file is missing, damaged, malformed, of format 1, or outside the
            checkpoint; the message names it. Nothing was changed.
        ValueError: the checkpoint does not fit this model or these optimizers. Nothing was
            changed.
    """
    snap, manifest = _manifest(Path(path))
    if len(manifest["optimizers"]) != len(optimizers):
        raise ValueError(
            f"checkpoint holds {len(manifest['optimizers'])} optimizers, "
            f"{len(optimizers)} were given"
        )
    holders = dict(_row_modules(model))
    tables = _verify_tables(snap, manifest, holders)
    dense = _verify_dense(snap, manifest, model)
    states = _verify_optimizers(snap, manifest, optimizers)
    caches = _verify_caches(snap, manifest, holders)

    # Everything checked: apply. Only the tier can fail from here on (then load again).
    for holder in holders.values():
        holder.reset()
    for holder, entry, saved in tables:
        table, store = entry["table"], holder.store
        spec = store.table_spec(table)
        bounded = store.keeps_scores(table)
        for chunk in list(store.export_rows(table)):
            stale = chunk[0][~torch.isin(chunk[0], saved)]
            if stale.numel() and bounded:  # a bounded table holds exactly the rows saved
                store.remove(table, stale)
            elif stale.numel():
                store.put(table, stale, spec.initial_rows(stale))
        for k, f in enumerate(entry["files"]):
            chunk, _ = read_tensors(snap, f, f"table {table!r} chunk {k}")
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


def _verify_tables(
    snap: Path, manifest: dict[str, Any], holders: dict[str, _Rows]
) -> list[tuple[_Rows, dict[str, Any], torch.Tensor]]:
    """Check every table entry against the model and every chunk file (checksum, ids, shapes);
    returns ``(module's rows, entry, ids saved)`` per table."""
    out, seen = [], set()
    for entry in manifest["tables"]:
        table, module = entry["table"], entry["module"]
        holder = holders.get(module)
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
            chunk, _ = read_tensors(snap, f, what)
            where = f"{snap / str(f['name'])} ({what})"
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
            saved.append(ids)
        ids = torch.cat(saved) if saved else torch.empty(0, dtype=torch.int64)
        out.append((holder, entry, ids))
    missing = [(m, t) for m, h in holders.items() for t in h.tables if (m, t) not in seen]
    if missing:
        raise ValueError(f"the checkpoint holds no rows for tables {missing} of this model")
    return out


def _verify_caches(
    snap: Path, manifest: dict[str, Any], holders: dict[str, _Rows]
) -> list[tuple[Any, dict[str, torch.Tensor], dict[str, Any]]]:
    """The caches' saved states, checked, with the caches they belong to (a checkpoint of a
    model whose collections differ, or written before caches were saved, restores none)."""
    out = []
    for k, entry in enumerate(manifest.get("caches", [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("cache"), int):
            raise CheckpointError(f"{snap / 'manifest.json'}: malformed cache entry {k}")
        holder = holders.get(entry.get("module"))  # type: ignore[arg-type]
        caches = holder.caches() if holder is not None else []
        if not 0 <= entry["cache"] < len(caches):
            continue
        tensors, meta = read_tensors(snap, entry, f"cache {k}")
        if not isinstance(meta, dict) or not all(
            isinstance(meta.get(key), int) for key in ("tick", "lookups", "batch_seq")
        ):
            raise CheckpointError(f"{snap / str(entry['name'])}: malformed cache state")
        out.append((caches[entry["cache"]], tensors, meta))
    return out


def _verify_dense(
    snap: Path, manifest: dict[str, Any], model: nn.Module
) -> dict[str, torch.Tensor]:
    dense, _ = read_tensors(snap, manifest["dense"], "dense state")
    own = _dense_state(model)
    missing, unexpected = sorted(set(own) - set(dense)), sorted(set(dense) - set(own))
    if missing or unexpected:
        raise ValueError(f"dense state mismatch: missing {missing}, unexpected {unexpected}")
    for k, v in dense.items():
        if v.shape != own[k].shape or v.dtype != own[k].dtype:
            raise CheckpointError(
                f"{snap / manifest['dense']['name']}: {k} is {tuple(v.shape)} {v.dtype}, the "
                f"model's {tuple(own[k].shape)} {own[k].dtype}"
            )
    return dense


def _verify_optimizers(
    snap: Path, manifest: dict[str, Any], optimizers: Sequence[Any]
) -> list[Any]:
    states = []
    for i, (entry, opt) in enumerate(zip(manifest["optimizers"], optimizers, strict=True)):
        kind = entry["kind"]
        if (kind == "sparse") != isinstance(opt, SparseOptimizer):
            raise ValueError(f"optimizers[{i}]: checkpoint holds a {kind} optimizer")
        tensors, tree = read_tensors(snap, entry, f"optimizers[{i}]")
        where = f"{snap / str(entry['name'])} (optimizers[{i}])"
        state = decode_tree(tree, tensors, where)
        try:
            if kind == "sparse":
                _check_sparse_state(opt, state)
            else:
                _check_torch_state(opt, state)
        except (ValueError, TypeError, KeyError) as err:
            raise CheckpointError(f"{where}: {err}") from None
        states.append(state)
    return states


def _check_sparse_state(opt: SparseOptimizer, state: Any) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("steps"), list):
        raise ValueError("not the state of a sparse optimizer")
    opt.check_hyper_state_dict(state)
    for steps in state["steps"]:
        if not isinstance(steps, dict) or not all(
            isinstance(t, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for t, n in steps.items()
        ):
            raise ValueError(f"step counts {steps!r} are not table -> count")


def _check_torch_state(opt: torch.optim.Optimizer, state: Any) -> None:
    if not isinstance(state, dict) or set(state) != {"state", "param_groups"}:
        raise ValueError("not a torch optimizer state_dict")
    groups = state["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        raise ValueError(
            f"{len(groups)} parameter groups, the optimizer has {len(opt.param_groups)}"
        )
    for saved, own in zip(groups, opt.param_groups, strict=True):
        if not isinstance(saved, dict) or len(saved.get("params", ())) != len(own["params"]):
            raise ValueError("a parameter group holds another number of parameters")
