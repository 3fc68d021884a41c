"""A cached collection's state as ``nn.Module`` tooling sees it: torchrec's ``state_dict()``
keys (``<weights_prefix>.<table>.weight``, a ``[num_embeddings, dim]`` tensor per bounded
table), written and read through the collection's whole tables, and the copies it refuses.

The functions take the collection (`WholeTables`: its ``tables``, ``weights_prefix``,
``device``, `table_rows` and `write_table_rows`); `CachedCollectionInterface` calls them from
``nn.Module``'s hooks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from embcache.engine.tables import Table


class WholeTables(Protocol):
    """What the state functions read of a collection."""

    @property
    def tables(self) -> Sequence[Table]: ...

    @property
    def weights_prefix(self) -> str: ...

    @property
    def device(self) -> torch.device: ...

    def table_rows(self, table: str, chunk_rows: int = ...) -> torch.Tensor: ...

    def write_table_rows(self, table: str, rows: torch.Tensor, columns: slice) -> None: ...


def save_weights(collection: WholeTables, destination: dict[str, Any], prefix: str) -> None:
    """Every bounded table's weights into ``destination`` under torchrec's key (meta tensors on
    the meta device). An unbounded table has no ``[num_embeddings, dim]`` tensor:
    `embcache.save` holds its rows."""
    for t in collection.tables:
        if t.num_embeddings is None:
            continue
        key = f"{prefix}{collection.weights_prefix}.{t.name}.weight"
        if collection.device.type == "meta":
            destination[key] = torch.empty(t.num_embeddings, t.dim, dtype=t.dtype, device="meta")
        else:
            destination[key] = collection.table_rows(t.name)[:, : t.dim].to(t.dtype)


def load_weights(
    collection: WholeTables,
    state_dict: Mapping[str, Any],
    prefix: str,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """``nn.Module._load_from_state_dict`` for the tables: every key checked first (missing,
    unexpected, dtype, shape, NaN/Inf, each appended to torch's lists), then, only if all pass,
    each table's weight columns written (`write_table_rows`; nothing on the meta device)."""
    expected = {
        f"{prefix}{collection.weights_prefix}.{t.name}.weight": t
        for t in collection.tables
        if t.num_embeddings is not None
    }
    updates = []
    for key, t in expected.items():
        if key not in state_dict:
            missing_keys.append(key)
            continue
        error = _weight_error(key, t, state_dict[key])
        if error is not None:
            error_msgs.append(error)
            continue
        updates.append((t, state_dict[key]))
    # Every key under this module's prefix is ours: its parameters stand for the tables,
    # which state_dict() holds under these keys, and its children hold nothing.
    unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
    if error_msgs or (strict and (missing_keys or unexpected_keys)):
        return  # nn.Module raises with these messages; nothing was written
    if collection.device.type == "meta":
        return  # no rows to write, as torchrec's meta weights take no values
    for t, value in updates:
        collection.write_table_rows(t.name, value.detach(), slice(0, t.dim))


def _weight_error(key: str, table: Table, value: Any) -> str | None:
    """Why ``value`` cannot be ``table``'s weights (None: it can)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return (
            f"{key} has dtype {getattr(value, 'dtype', type(value).__name__)}; table "
            f"weights must be floating point"
        )
    if tuple(value.shape) != (table.num_embeddings, table.dim):
        return (
            f"size mismatch for {key}: checkpoint has {tuple(value.shape)}, table "
            f"{table.name!r} is {(table.num_embeddings, table.dim)}"
        )
    if not value.is_meta and not bool(torch.isfinite(value).all()):
        return f"{key} holds NaN or Inf values"
    return None


def deepcopy_refused(collection: object) -> TypeError:
    """What ``copy.deepcopy`` of a collection raises: its rows live in the caches and the tier,
    not in the module (a copy would have to duplicate a tier that may be far larger than
    memory, or share it and break the one-writer-per-row rule)."""
    return TypeError(
        f"copy.deepcopy of a {type(collection).__name__} is not supported: its rows live in a "
        "device cache and a tier, not in the module. To copy it, build a new collection "
        "with the same tables and call new.load_state_dict(old.state_dict()) (the "
        "weights), or embcache.save(path, old_model, optimizers) then "
        "embcache.load(path, new_model, optimizers) (weights and optimizer state)"
    )


def pickle_refused(collection: object) -> TypeError:
    """What ``pickle``, ``torch.save(module)`` and ``copy.copy`` of a collection raise:
    checkpoints hold data, never pickled modules."""
    return TypeError(
        f"a {type(collection).__name__} cannot be pickled (pickle, torch.save(module), "
        "copy.copy): its rows live in a device cache and a tier, not in the module. Save "
        "the data instead: embcache.save(path, model, optimizers) (weights and optimizer "
        "state, checksummed) or torch.save(model.state_dict()) (torchrec's keys); rebuild "
        "the model and load it with embcache.load(path, model, optimizers) or "
        "model.load_state_dict(...)"
    )
