"""Checkpoints of models with cached collections: every table row (weights and optimizer state),
the optimizers' step counts, and the model's dense state, written so a crash never loses the
previous checkpoint.

    embcache.save("ckpt/", model, [sparse_opt, dense_opt])
    ...
    embcache.load("ckpt/", model, [sparse_opt, dense_opt])

Layout of a checkpoint directory::

    ckpt/
      CURRENT                  name of the complete snapshot (replaced atomically)
      snap-000003/
        manifest.json          tables, chunk files, optimizer kinds, format version
        dense.pt               the model's state_dict without the cached tables' weights
        optim-0.pt ...         optimizer state (sparse: hyper-parameters and step counts)
        tables/<m>-<table>-<k>.pt   (ids, rows) chunks of at most ``chunk_rows`` rows

`save` flushes the caches, streams each table from its tier chunk by chunk (so a table larger
than free memory can be saved), fsyncs every file and the snapshot directory, then points
CURRENT at the new snapshot with an atomic rename and removes older snapshots. A crash at any
point leaves CURRENT naming a complete snapshot.

Rows never touched are not stored (their value is their initialiser's, a function of the id).
`load` therefore also resets rows that the live tier holds but the checkpoint does not.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from embcache.engine.interface import CachedCollectionInterface
from embcache.optim.sparse import SparseOptimizer

FORMAT_VERSION = 1
_CURRENT = "CURRENT"


def _collections(model: nn.Module) -> list[tuple[str, CachedCollectionInterface]]:
    return [
        (name, m) for name, m in model.named_modules() if isinstance(m, CachedCollectionInterface)
    ]


def _dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers outside the cached collections (whose
    tables are saved row by row, never materialised whole)."""
    state = {}
    for module_name, module in model.named_modules():
        if isinstance(module, CachedCollectionInterface):
            continue
        prefix = f"{module_name}." if module_name else ""
        for k, v in module.named_parameters(recurse=False):
            state[prefix + k] = v.detach().cpu().clone()
        for k, v in module.named_buffers(recurse=False):
            if k not in module._non_persistent_buffers_set:
                state[prefix + k] = v.detach().cpu().clone()
    return state


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    _fsync_file(path)


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
            returns them.

    Returns:
        The snapshot directory written.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    number = 1 + max(
        (int(p.name[5:]) for p in root.glob("snap-*") if p.name[5:].isdigit()), default=0
    )
    snap = root / f"snap-{number:06d}"
    tmp = root / f".tmp-{snap.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "tables").mkdir(parents=True)

    manifest: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "tables": [],
        "optimizers": [],
        "extra": extra or {},
    }
    for m_index, (m_name, coll) in enumerate(_collections(model)):
        coll.flush()
        for t in coll.tables:
            spec = coll.store.table_spec(t.name)
            files = []
            for k, (ids, rows) in enumerate(coll.store.export_rows(t.name, chunk_rows)):
                name = f"tables/{m_index}-{t.name}-{k:06d}.pt"
                _write({"ids": ids.clone(), "rows": rows.clone()}, tmp / name)
                files.append(name)
            manifest["tables"].append(
                {
                    "module": m_name,
                    "table": t.name,
                    "dim": spec.dim,
                    "num_embeddings": spec.num_embeddings,
                    "state_dim": spec.state_dim,
                    "files": files,
                }
            )
    _write(_dense_state(model), tmp / "dense.pt")
    for i, opt in enumerate(optimizers):
        if isinstance(opt, SparseOptimizer):
            kind, state = "sparse", opt.hyper_state_dict()
        elif isinstance(opt, torch.optim.Optimizer):
            kind, state = "torch", opt.state_dict()
        else:
            raise TypeError(f"optimizers[{i}]: cannot checkpoint a {type(opt).__name__}")
        _write(state, tmp / f"optim-{i}.pt")
        manifest["optimizers"].append(kind)
    with open(tmp / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp / "tables")
    _fsync_dir(tmp)
    os.rename(tmp, snap)
    _fsync_dir(root)

    pointer = root / f".{_CURRENT}.tmp"
    with open(pointer, "w") as f:
        f.write(snap.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / _CURRENT)
    _fsync_dir(root)
    for old in root.iterdir():
        if old != snap and (old.name.startswith("snap-") or old.name.startswith(".tmp-snap-")):
            shutil.rmtree(old, ignore_errors=True)
    return snap


def latest_snapshot(path: str | os.PathLike) -> Path:
    """The complete snapshot a checkpoint directory's CURRENT names."""
    root = Path(path)
    current = root / _CURRENT
    if not current.exists():
        raise FileNotFoundError(f"{root} holds no complete checkpoint (no {_CURRENT} file)")
    snap = root / current.read_text().strip()
    if not (snap / "manifest.json").exists():
        raise FileNotFoundError(f"checkpoint {snap} is incomplete (no manifest.json)")
    return snap


def load(
    path: str | os.PathLike, model: nn.Module, optimizers: Sequence[Any] = ()
) -> dict[str, Any]:
    """Restore a checkpoint written by `save` into ``model`` and ``optimizers``; returns the
    ``extra`` dict given to `save`.

    The optimizers must be constructed (attached to the model) before loading, in the order
    given to `save`. Tables are matched by module path and name and must have the same dims.
    """
    snap = latest_snapshot(path)
    manifest = json.loads((snap / "manifest.json").read_text())
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint format {manifest.get('version')} is not {FORMAT_VERSION}")
    if len(manifest["optimizers"]) != len(optimizers):
        raise ValueError(
            f"checkpoint holds {len(manifest['optimizers'])} optimizers, "
            f"{len(optimizers)} were given"
        )
    colls = dict(_collections(model))
    entries = []
    for entry in manifest["tables"]:
        coll = colls.get(entry["module"])
        if coll is None:
            raise ValueError(
                f"checkpoint table {entry['table']!r} belongs to module "
                f"{entry['module']!r}, which this model lacks"
            )
        spec = coll.store.table_spec(entry["table"])
        got = (spec.dim, spec.num_embeddings, spec.state_dim)
        want = (entry["dim"], entry["num_embeddings"], entry["state_dim"])
        if got != want:
            raise ValueError(
                f"table {entry['table']!r}: checkpoint has (dim, rows, state) {want}, the model "
                f"{got}; attach the same optimizer before loading"
            )
        entries.append((coll, entry))
    for i, (kind, opt) in enumerate(zip(manifest["optimizers"], optimizers, strict=True)):
        if (kind == "sparse") != isinstance(opt, SparseOptimizer):
            raise ValueError(f"optimizers[{i}]: checkpoint holds a {kind} optimizer")

    for coll in colls.values():
        coll.invalidate_caches()
    for coll, entry in entries:
        table = entry["table"]
        spec = coll.store.table_spec(table)
        saved_ids = [torch.load(snap / f, weights_only=True)["ids"] for f in entry["files"]]
        saved = torch.cat(saved_ids) if saved_ids else torch.empty(0, dtype=torch.int64)
        for ids, _ in coll.store.export_rows(table):
            stale = ids[~torch.isin(ids, saved)]
            if stale.numel():
                coll.store.put(table, stale, spec.initial_rows(stale))
        for f in entry["files"]:
            chunk = torch.load(snap / f, weights_only=True)
            coll.store.import_rows(table, chunk["ids"], chunk["rows"])
    dense = torch.load(snap / "dense.pt", weights_only=True)
    if dense:
        missing, unexpected = [], []
        own = _dense_state(model)
        missing = sorted(set(own) - set(dense))
        unexpected = sorted(set(dense) - set(own))
        if missing or unexpected:
            raise ValueError(f"dense state mismatch: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            params = dict(model.named_parameters())
            buffers = dict(model.named_buffers())
            for k, v in dense.items():
                target = params.get(k, buffers.get(k))
                target.copy_(v)
    for i, opt in enumerate(optimizers):
        state = torch.load(snap / f"optim-{i}.pt", weights_only=False)
        if isinstance(opt, SparseOptimizer):
            opt.load_hyper_state_dict(state)
        else:
            opt.load_state_dict(state)
    return manifest.get("extra", {})
