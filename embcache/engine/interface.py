"""The interface every cached collection implements, one process or sharded over many.

`CachedCollectionInterface` fixes what the rest of embcache relies on: the sparse optimizers
(`attach_sparse_optimizer`, `sparse_gradients`, `apply_sparse_gradients`, `zero_grad`, whole
tables through `table_rows` / `write_table_rows`), `TrainPipeline` (`issue_fused_prefetch`,
`set_fused_prefetch_handle`, `cancel_fused_prefetch`), checkpoints (``store``, ``tables``,
`flush`, `invalidate_caches`) and torchrec-style ``state_dict()`` keys. Each collection holds an
`EngineGroup` (``self.engines``) and its own data path; neither subclasses the other, as
torchrec's sharded modules implement its module interfaces rather than extend the unsharded
ones.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.engine.batch_state import FusedPrefetchHandle, TraceEntry
from embcache.engine.group import EngineGroup
from embcache.engine.inputs import JaggedBatch, as_jagged, check_batch
from embcache.engine.tables import Table, normalize_tables
from embcache.kv.base import Store, TableSpec
from embcache.kv.url import open_store

UNFUSED_K = 48  # enable_fusion=False: internal fusion with room for ids below 2**48


def checked_fusion_k(fusion_k: int, enable_fusion: bool, tables: Sequence[Table]) -> int:
    """The fusion width a collection uses, after checking its tables fit it."""
    if isinstance(fusion_k, bool) or not isinstance(fusion_k, int) or not 1 <= fusion_k <= 56:
        raise ValueError(f"fusion_k must be an int in [1, 56], got {fusion_k!r}")
    k = fusion_k if enable_fusion else UNFUSED_K
    if len(tables) > 1 << (62 - k):
        raise ValueError(
            f"{len(tables)} tables do not fit the {62 - k} prefix bits left by fusion_k={k}"
        )
    for t in tables:
        if t.num_embeddings > 1 << k:
            raise ValueError(
                f"table {t.name!r}: num_embeddings={t.num_embeddings} needs more than "
                f"fusion_k={k} bits; raise fusion_k to at least "
                f"{(t.num_embeddings - 1).bit_length()}"
            )
    return k


class CachedCollectionInterface(nn.Module, abc.ABC):
    """Pooled embedding lookups over device caches with a write-back tier behind them.

    Subclasses call `_setup` from their constructor and implement the data path (`forward`,
    the prefetch calls) and whole-table access (`table_rows`, `write_table_rows`).

    Attributes:
        tables: the normalised tables (`Table`), in the order given.
        store: the tier.
        engines: the `EngineGroup` (one `CacheEngine` per embedding dim).
        output_keys: the output's keys: every table's features, in table order.
        output_dims: the embedding dim of each output key.
    """

    def _setup(
        self,
        tables: Sequence[Any],
        is_weighted: bool,
        cache: CacheConfig | None,
        store: Store | str | None,
        device: torch.device | str | None,
        enable_fusion: bool,
        fusion_k: int,
        update_in_backward: bool,
        accumulate_grads: bool,
        lr: float | None,
        seed: int,
    ) -> None:
        self.tables = normalize_tables(tables)
        self.fusion_k = checked_fusion_k(fusion_k, enable_fusion, self.tables)
        self.enable_fusion = enable_fusion
        self.is_weighted = is_weighted
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cache_config = cache or CacheConfig()
        self.store = open_store(store)
        self.update_in_backward = update_in_backward
        self.accumulate_grads = accumulate_grads
        self.lr = lr
        self.feature_to_table = {f: t for t in self.tables for f in t.feature_names}
        self.output_keys = [f for t in self.tables for f in t.feature_names]
        self.output_dims = [self.feature_to_table[f].dim for f in self.output_keys]
        self.specs = {
            t.name: TableSpec(t.name, t.dim, t.num_embeddings, seed=seed) for t in self.tables
        }
        for spec in self.specs.values():
            self.store.init_table(spec)
        self.engines = EngineGroup(
            self.tables,
            self.specs,
            self.store,
            self.cache_config,
            self.device,
            self.fusion_k,
            update_in_backward,
            accumulate_grads,
        )
        self.engines.owner = self
        # Requires grad, so the pooling op is recorded although the rows are no leaves.
        self.grad_anchor = torch.empty(0, requires_grad=True)

    def checked_input(self, features: object) -> JaggedBatch:
        """``features`` (a KJT or a `JaggedBatch`) as a checked `JaggedBatch`."""
        batch = as_jagged(features)
        check_batch(batch, self.output_keys, self.is_weighted)
        return batch

    # -- the data path (each collection's own) ----------------------------------------------

    @abc.abstractmethod
    def forward(self, features: Any) -> Any: ...

    @abc.abstractmethod
    def issue_fused_prefetch(self, features: Any) -> FusedPrefetchHandle: ...

    @abc.abstractmethod
    def table_rows(self, table: str, chunk_rows: int = 1 << 16) -> torch.Tensor:
        """Every row ``[num_embeddings, dim + state_dim]`` of a table. CPU float32."""

    @abc.abstractmethod
    def write_table_rows(self, table: str, rows: torch.Tensor, columns: slice) -> None:
        """Overwrite ``columns`` of every row of a table (others kept)."""

    def set_fused_prefetch_handle(self, handle: FusedPrefetchHandle | None) -> None:
        """Make the next forward use ``handle`` (which must come from this collection; issuing
        records a handle already, so this is needed only to choose another, or None)."""
        self.engines.set_prefetch(handle, id(self))

    def cancel_fused_prefetch(self, handle: FusedPrefetchHandle) -> None:
        """Release a handle that will not be used (waits for its prefetch first)."""
        self.engines.cancel(handle, id(self))

    @property
    def pending_prefetch(self) -> FusedPrefetchHandle | None:
        """The handle the next forward uses, if any."""
        return self.engines.prefetches.recorded

    @property
    def _fused_prefetch_handle(self) -> FusedPrefetchHandle | None:
        """RecStore's name for `pending_prefetch`."""
        return self.engines.prefetches.recorded

    # -- what a sparse optimizer drives -----------------------------------------------------

    @property
    def _trace(self) -> list[TraceEntry]:
        """The recorded gradients, ``(table_name, ids, grads)`` per table and backward
        (RecStore's ``module._trace``)."""
        return self.engines.trace

    def attach_sparse_optimizer(self, optimizer: Any) -> None:
        """Give every row ``optimizer``'s state columns (fresh state, weights kept)."""
        self.engines.attach(optimizer)

    def sparse_gradients(self) -> list[TraceEntry]:
        return list(self.engines.trace)

    def apply_sparse_gradients(self, optimizer: Any) -> None:
        self.engines.apply_trace(optimizer)

    def sparse_tables(self) -> list[Table]:
        """The tables whose rows hold the attached optimizer's state."""
        return list(self.tables)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the recorded gradients and the locks of every forward in flight, and release
        every prefetch handle."""
        del set_to_none  # nothing of ours is an nn.Parameter gradient
        self.engines.zero_grad()

    def reset_trace(self) -> None:
        """RecStore's name for `zero_grad`: drop ``_trace`` (and what its forwards and the
        prefetch handles hold)."""
        self.engines.zero_grad()

    # -- caches, statistics -----------------------------------------------------------------

    def flush(self) -> None:
        """Write every dirty cached row back to the tier."""
        self.engines.flush()

    def invalidate_caches(self) -> None:
        """Drop pending gradients, write back and empty every cache (the next batch reads
        everything from the tier); prefetch handles issued before become stale."""
        self.engines.invalidate()

    def caches(self) -> list[HotCache]:
        """The caches, one per distinct embedding dim."""
        return self.engines.caches()

    def cache_stats(self) -> dict[str, float]:
        """Hits, misses, evictions and writebacks summed over the caches, and the hit rate."""
        return self.engines.cache_stats()

    def reset_stats(self) -> None:
        self.engines.reset_stats()

    # -- torchrec's state_dict keys ---------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for t in self.tables:
            destination[f"{prefix}embedding_bags.{t.name}.weight"] = self.table_rows(t.name)[
                :, : t.dim
            ]

    def _load_from_state_dict(
        self,
        state_dict,
        prefix,
        local_metadata,
        strict,
        missing_keys,
        unexpected_keys,
        error_msgs,
    ) -> None:
        expected = {f"{prefix}embedding_bags.{t.name}.weight": t for t in self.tables}
        updates = []
        for key, t in expected.items():
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                error_msgs.append(
                    f"{key} has dtype {getattr(value, 'dtype', type(value).__name__)}; table "
                    f"weights must be floating point"
                )
                continue
            if tuple(value.shape) != (t.num_embeddings, t.dim):
                error_msgs.append(
                    f"size mismatch for {key}: checkpoint has {tuple(value.shape)}, table "
                    f"{t.name!r} is {(t.num_embeddings, t.dim)}"
                )
                continue
            if not bool(torch.isfinite(value).all()):
                error_msgs.append(f"{key} holds NaN or Inf values")
                continue
            updates.append((t, value))
        # Every key under this module's prefix is ours: it has no parameters or children.
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
        if error_msgs or (strict and (missing_keys or unexpected_keys)):
            return  # nn.Module raises with these messages; nothing was written
        for t, value in updates:
            self.write_table_rows(t.name, value.detach(), slice(0, t.dim))
