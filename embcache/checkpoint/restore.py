"""Loading a checkpoint (`load`, `read_extra`): the manifest checked against CURRENT's
checksum and for shape, every table chunk, initialiser, dense tensor, optimizer and cache
state verified against the model before anything changes, then applied (table rows into the
tier, then the caches, optimizers and dense state). The format and its guarantees:
`embcache.checkpoint`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from embcache.checkpoint.files import CURRENT, FORMAT_VERSION, CheckpointError, Snapshot, sha256_of
from embcache.checkpoint.holders import (
    KV_CLIENT_MODULE,
    RowHolder,
    model_dense_state,
    row_holders,
)
from embcache.checkpoint.verify import (
    check_finite,
    verify_caches,
    verify_dense,
    verify_optimizers,
)
from embcache.engine.row_init import DrawnInit
from embcache.kv.base import HashedInit, RowInit, TableSpec
from embcache.kv.bucket_index import check_scores
from embcache.optim.sparse import SparseOptimizer
from embcache.recstore.kv_client import KVClient


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


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The ``extra`` dict saved with the checkpoint in ``path`` (manifest verified), without
    loading anything: e.g. to reopen a tier as the job that saved it before `load`."""
    with Snapshot(Path(path)) as snap:
        return dict(read_manifest(snap)["extra"])


def read_manifest(snap: Snapshot) -> dict[str, Any]:
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


def _load(
    snap: Snapshot,
    model: nn.Module,
    optimizers: Sequence[Any],
    allow_nonfinite: bool,
    kv_client: KVClient | None,
) -> dict[str, Any]:
    manifest = read_manifest(snap)
    if len(manifest["optimizers"]) != len(optimizers):
        raise ValueError(
            f"checkpoint holds {len(manifest['optimizers'])} optimizers, "
            f"{len(optimizers)} were given"
        )
    if kv_client is not None and not isinstance(kv_client, KVClient):
        raise TypeError(f"kv_client must be a KVClient, got {type(kv_client).__name__}")
    holders = dict(row_holders(model, kv_client))
    tables = _verify_tables(snap, manifest, holders, allow_nonfinite)
    dense = verify_dense(snap, manifest["dense"], model_dense_state(model), allow_nonfinite)
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
            part, _ = snap.tensors(f, f"table {table!r} chunk {k}")  # checksum checked again
            scores = part.get("scores") if bounded else None
            store.import_rows(table, part["ids"], part["rows"], scores)
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
        for name, value in dense.items():
            targets[name].copy_(value)
    return dict(manifest["extra"])


def _adopt_init(holder: RowHolder, table: str, init: RowInit) -> None:
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
    parts: list[torch.Tensor] = []
    for k, f in enumerate(recipe["files"]):
        what = f"table {table!r} initial weights {k}"
        chunk, _ = snap.tensors(f, what)
        weights = chunk.get("weights")
        if (
            weights is None
            or set(chunk) != {"weights"}
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
    snap: Snapshot, manifest: dict[str, Any], holders: dict[str, RowHolder], allow_nonfinite: bool
) -> list[tuple[RowHolder, dict[str, Any], torch.Tensor, RowInit | None]]:
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
        saved: list[torch.Tensor] = []
        last = -1
        for k, f in enumerate(entry["files"]):
            what = f"table {table!r} chunk {k}"
            chunk, _ = snap.tensors(f, what)
            where = f"{snap.path / str(f['name'])} ({what})"
            ids, rows = chunk.get("ids"), chunk.get("rows")
            if (
                ids is None
                or rows is None
                or set(chunk) != keys
                or ids.dtype != torch.int64
                or ids.dim() != 1
            ):
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
            if "scores" in keys:
                try:
                    check_scores(chunk["scores"])
                except ValueError as err:
                    raise CheckpointError(f"{where}: eviction {err}") from None
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
