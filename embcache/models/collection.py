"""CachedEmbeddingBagCollection: torchrec's EmbeddingBagCollection over a device cache.

Example::

    ebc = CachedEmbeddingBagCollection(
        tables=[TableConfig(name="t0", embedding_dim=16, num_embeddings=10_000,
                            feature_names=["f0", "f1"])],   # or torchrec EmbeddingBagConfig
        cache=CacheConfig(load_factor=0.1),
    )
    opt = SparseAdaGrad([ebc], lr=0.05)
    # kjt: torchrec KeyedJaggedTensor (or embcache.JaggedBatch), keys ["f0", "f1"], B bags each
    kt = ebc(kjt)                       # KeyedTensor, keys ["f0", "f1"], values [B, 32]
    kt.values().sum().backward()        # one gradient row per unique id, into ebc._trace
    opt.step()                          # fused update in the cache slots; trace cleared

A forward, per cache (one per distinct embedding dim):

1. validate the input and fuse ids: ``fused = id | (table_idx << fusion_k)`` (bad ids raise before
   anything changes);
2. dedup the fused ids; resolve them to cache slots (misses come from the tier), locking the
   slots until the optimizer step (nothing is locked under ``torch.no_grad()``);
3. pool each bag straight from the slots (SUM/MEAN/MAX, per-sample weights).

Backward turns the pooled gradient into one row per unique id and appends
``(table_name, ids, grads)`` to ``_trace`` (or, with ``update_in_backward=True``, applies the
attached optimizer at once). A forward whose output is never backpropagated holds its locks only
until the next forward; a forward while an un-stepped trace exists is an error unless
``accumulate_grads=True``.

The pieces live beside this file: the layout of features over caches in ``cache_group``, a
batch's state between forward and step in ``batch_state``, the pooling autograd op (step 3 and
the backward) in ``pooled_lookup``; input checks and table configs in ``embcache.engine``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.engine.inputs import JaggedBatch, as_jagged, check_batch, group_inputs, pooled_output
from embcache.engine.tables import TableConfig, normalize_tables
from embcache.kernels.ids import dedup, dedup_grouped, fuse_ids
from embcache.kv.base import Store, TableSpec
from embcache.kv.url import open_store

# Other modules (sharded, pipeline, the sparse optimizers) import these types from here.
from embcache.models.batch_state import FusedPrefetchHandle, TraceEntry, _Batch, _Resolved
from embcache.models.cache_group import _CacheGroup
from embcache.models.cache_group import _Lookup as _Lookup
from embcache.models.pooled_lookup import _PooledLookup

_UNFUSED_K = 48  # enable_fusion=False: internal fusion with room for ids below 2**48


class CachedEmbeddingBagCollection(nn.Module):
    """Pooled embedding lookups over a device cache with a write-back tier behind it.

    Same input, output, keys and values as `torchrec.EmbeddingBagCollection` given the same
    weights, plus MAX pooling; tables may be far larger than the device, only the cached rows
    live there.

    Args:
        tables: `TableConfig` objects, torchrec `EmbeddingBagConfig` objects or dicts (``name``,
            ``embedding_dim``, ``num_embeddings``, ``feature_names``, optional ``pooling``:
            SUM, MEAN or MAX).
        is_weighted: the inputs carry per-sample weights.
        cache: capacity and policy of each cache (one per distinct dim); None caches everything.
        store: the tier: a `Store`, a URL (``"redis://127.0.0.1:6379/0"``) or None for an
            in-process `HostKV`.
        device: where the caches live.
        enable_fusion: fuse ids of all tables into one key space with ``fusion_k`` bits for the
            raw id (RecStore's layout). With False, the collection still fuses internally but
            with 48 id bits, so only ``num_embeddings`` limits ids.
        fusion_k: bits of the raw id inside a fused id; every table needs
            ``num_embeddings <= 2**fusion_k``.
        update_in_backward: apply the attached optimizer inside backward (FBGEMM-style) instead
            of recording a trace for ``step()``; same numbers.
        accumulate_grads: allow several forward/backward passes before one ``step()``, whose
            gradients are summed per id.
        lr: learning rate a sparse optimizer uses when given none (RecStore compatibility).
        seed: seed of the default row initialiser.
    """

    supports_prefetch = True  # issue_fused_prefetch can run on a worker thread

    def __init__(
        self,
        tables: Sequence[TableConfig | Mapping[str, Any] | Any],
        is_weighted: bool = False,
        cache: CacheConfig | None = None,
        store: Store | str | None = None,
        device: torch.device | str | None = None,
        enable_fusion: bool = True,
        fusion_k: int = 30,
        update_in_backward: bool = False,
        accumulate_grads: bool = False,
        lr: float | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self._sparse_kind = "collection"  # how sparse optimizers recognise the module
        self.tables = normalize_tables(tables)
        if isinstance(fusion_k, bool) or not isinstance(fusion_k, int) or not 1 <= fusion_k <= 56:
            raise ValueError(f"fusion_k must be an int in [1, 56], got {fusion_k!r}")
        self.fusion_k = fusion_k if enable_fusion else _UNFUSED_K
        self.enable_fusion = enable_fusion
        if len(self.tables) > 1 << (62 - self.fusion_k):
            raise ValueError(
                f"{len(self.tables)} tables do not fit the {62 - self.fusion_k} prefix bits "
                f"left by fusion_k={self.fusion_k}"
            )
        for t in self.tables:
            if t.num_embeddings > 1 << self.fusion_k:
                raise ValueError(
                    f"table {t.name!r}: num_embeddings={t.num_embeddings} needs more than "
                    f"fusion_k={self.fusion_k} bits; raise fusion_k to at least "
                    f"{(t.num_embeddings - 1).bit_length()}"
                )
        self.is_weighted = is_weighted
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cache_config = cache or CacheConfig()
        self.store = open_store(store)
        self.update_in_backward = update_in_backward
        self.accumulate_grads = accumulate_grads
        self.lr = lr
        self.feature_to_table = {f: t for t in self.tables for f in t.feature_names}
        self._table_index = {t.name: t.index for t in self.tables}
        self.output_keys = [f for t in self.tables for f in t.feature_names]
        self.output_dims = [self.feature_to_table[f].dim for f in self.output_keys]

        self.specs = {
            t.name: TableSpec(t.name, t.dim, t.num_embeddings, seed=seed) for t in self.tables
        }
        for spec in self.specs.values():
            self.store.init_table(spec)
        self._groups = [self._make_group(dim) for dim in sorted({t.dim for t in self.tables})]
        self._trace: list[TraceEntry] = []
        self._inflight: list[_Batch] = []
        self._prefetch: FusedPrefetchHandle | None = None
        self._generation = 0  # bumped when caches are emptied: older handles become stale
        self._optimizer: Any = None
        self._grad_anchor = torch.empty(0, requires_grad=True)

    def _make_group(self, dim: int) -> _CacheGroup:
        tables = [t for t in self.tables if t.dim == dim]
        cache = HotCache(
            [(t.index, self.specs[t.name]) for t in tables],
            self.cache_config,
            self.store,
            self.device,
            self.fusion_k,
        )
        return _CacheGroup.of_tables(dim, cache, tables)

    # ------------------------------------------------------------------------------------------
    # input checks and id preparation

    def _checked_input(self, features: object) -> JaggedBatch:
        """``features`` (a KJT or a `JaggedBatch`) as a checked `JaggedBatch`."""
        batch = as_jagged(features)
        check_batch(batch, self.output_keys, self.is_weighted)
        return batch

    def _fuse_group(
        self, features: JaggedBatch, group: _CacheGroup
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Validated fused ids, bag lengths and weights of a group (device tensors)."""
        values, lengths, weights = group_inputs(features, group.features)
        per_feature = lengths.view(len(group.features), -1).sum(dim=1)
        fused = fuse_ids(
            values,
            per_feature,
            group.table_index,
            group.table_rows,
            self.fusion_k,
            group.features,
            group.table_names,
        )
        if weights is not None:
            weights = weights.to(self.device, torch.float32)
        return fused.to(self.device), lengths.to(self.device), weights

    def _resolve_all(self, features: JaggedBatch, lock: bool) -> list[_Resolved]:
        """Dedup and resolve every group (``features`` checked); all ids are validated before
        any cache changes."""
        prepared = [self._fuse_group(features, g) for g in self._groups]
        resolved: list[_Resolved] = []
        try:
            for group, (fused, lengths, weights) in zip(self._groups, prepared, strict=True):
                grouping = None
                if fused.device.type == "cpu" and len(group.lookups) == 1:
                    # The CPU backward sums each id's rows in one pass over the grouped values.
                    unique, inverse, order, segments = dedup_grouped(fused)
                    grouping = (order, segments)
                else:
                    unique, inverse, _ = dedup(fused, with_counts=False)
                slots = group.cache.resolve(unique, lock=lock)
                offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=self.device)
                torch.cumsum(lengths, 0, out=offsets[1:])
                resolved.append(_Resolved(unique, inverse, slots, offsets, weights, lock, grouping))
        except BaseException:
            if lock:
                for group, r in zip(self._groups, resolved, strict=False):
                    group.cache.unlock(r.slots)
            raise
        return resolved

    # ------------------------------------------------------------------------------------------
    # forward

    def forward(self, features: JaggedBatch | Any) -> Any:
        """Pooled embeddings of every feature ``[B, sum of dims]``, keyed by the tables' feature
        names in table order (as torchrec orders them): a torchrec `KeyedTensor` for a KJT
        input, a `PooledEmbeddings` for a `JaggedBatch`."""
        batch_in = self._checked_input(features)
        training = torch.is_grad_enabled()
        if training:
            try:
                self._begin_batch()
            except RuntimeError:
                if self._prefetch is not None:  # its locks would belong to no batch
                    self.cancel_fused_prefetch(self._prefetch)
                raise
        handle = self._take_prefetch(batch_in)
        resolved = handle.resolved if handle else self._resolve_all(batch_in, lock=training)
        batch = _Batch(resolved) if training else None
        if batch is not None:
            self._inflight.append(batch)
        B = batch_in.stride()
        try:
            # One autograd node for every group, so one backward sees all their gradients.
            outs = _PooledLookup.apply(self._grad_anchor, self, resolved, batch, B)
            blocks: dict[str, torch.Tensor] = {}
            for group, out in zip(self._groups, outs, strict=True):
                for i, f in enumerate(group.features):
                    blocks[f] = out[:, i * group.dim : (i + 1) * group.dim]
        finally:
            if not training:
                for group, r in zip(self._groups, resolved, strict=True):
                    if r.locked:
                        group.cache.unlock(r.slots)
                        r.locked = False
                    group.cache.release()
        if len(self._groups) == 1 and self._groups[0].features == self.output_keys:
            values = out
        else:
            values = torch.cat([blocks[f] for f in self.output_keys], dim=1)
        return pooled_output(features, self.output_keys, self.output_dims, values)

    def _begin_batch(self) -> None:
        """Before a training forward: refuse to mix in an un-stepped trace; drop the locks of
        forwards that were never backpropagated."""
        if self._trace and not self.accumulate_grads:
            raise RuntimeError(
                "forward called while the previous backward's gradients are still in _trace: "
                "call optimizer.step() (or zero_grad()) first, or build the collection with "
                "accumulate_grads=True to sum gradients over several passes"
            )
        kept = []
        for batch in self._inflight:
            if not batch.backward_done:
                self._release(batch)
            elif any(r.locked for r in batch.resolved):
                kept.append(batch)  # backpropagated, waiting for step (accumulate_grads)
        self._inflight = kept

    def _release(self, batch: _Batch) -> None:
        for group, r in zip(self._groups, batch.resolved, strict=True):
            if r.locked:
                group.cache.unlock(r.slots)
                r.locked = False

    def _release_all(self) -> None:
        for batch in self._inflight:
            self._release(batch)
        self._inflight = []

    def _on_backward(self, batch: _Batch, grad_rows: list[torch.Tensor]) -> None:
        """Record every group's gradient rows of one backward (or apply them all at once)."""
        batch.backward_done = True
        mask = (1 << self.fusion_k) - 1
        entries = []
        for gi, (group, r, grads) in enumerate(
            zip(self._groups, batch.resolved, grad_rows, strict=True)
        ):
            bounds = group.table_bounds(r.unique, self.fusion_k)
            for i, t in enumerate(group.tables):
                lo, hi = bounds[i], bounds[i + 1]
                entries.append(TraceEntry(t.name, r.unique[lo:hi] & mask, grads[lo:hi], gi, batch))
        if self.update_in_backward:
            if self._optimizer is None:
                raise RuntimeError(
                    "update_in_backward=True needs a sparse optimizer attached to the collection "
                    "(construct e.g. SparseSGD([collection], lr=...) before the first backward)"
                )
            try:
                # All groups at once: a bad gradient anywhere is refused before any update.
                self._optimizer._apply_entries(self, entries)
            except ValueError:
                self._release(batch)
                raise
        else:
            self._trace.extend(entries)

    # ------------------------------------------------------------------------------------------
    # the optimizer's side

    def _attach_optimizer(self, optimizer: Any, state_dim_of, state_init: float) -> None:
        """Give every row the state columns of ``optimizer`` (fresh state, weights kept)."""
        if self._trace:
            raise RuntimeError(
                "attach the optimizer before training: gradients of a backward are pending"
            )
        self._release_all()  # forwards that were never backpropagated
        for group in self._groups:
            group.cache.set_state(state_dim_of(group.dim), state_init)
        for name in self.specs:
            self.specs[name] = self.store.table_spec(name)
        self._generation += 1
        self._optimizer = optimizer

    def zero_grad(self) -> None:
        """Drop the recorded gradients and the locks of every forward in flight."""
        self._trace = []
        self._release_all()

    # ------------------------------------------------------------------------------------------
    # prefetch

    def issue_fused_prefetch(self, features: JaggedBatch | Any) -> FusedPrefetchHandle:
        """Dedup and resolve a batch ahead of its forward; its slots stay locked until that
        forward's step (or `cancel_fused_prefetch`)."""
        features = self._checked_input(features)
        resolved = self._resolve_all(features, lock=True)
        return FusedPrefetchHandle(
            id(self),
            self._generation,
            list(features.keys()),
            features.lengths(),
            features.values(),
            resolved,
        )

    def set_fused_prefetch_handle(self, handle: FusedPrefetchHandle | None) -> None:
        """Make the next forward use ``handle`` (which must come from this collection)."""
        if handle is not None:
            self._check_handle(handle)
        self._prefetch = handle

    def cancel_fused_prefetch(self, handle: FusedPrefetchHandle) -> None:
        """Release a handle that will not be used."""
        if handle.used or handle.module_id != id(self):
            return
        handle.used = True
        if self._prefetch is handle:
            self._prefetch = None
        self._release(_Batch(handle.resolved))

    def _check_handle(self, handle: FusedPrefetchHandle) -> None:
        if not isinstance(handle, FusedPrefetchHandle):
            raise TypeError(f"expected a FusedPrefetchHandle, got {type(handle).__name__}")
        if handle.module_id != id(self):
            raise ValueError("prefetch handle was issued by another collection")
        if handle.used or handle.generation != self._generation:
            raise ValueError("prefetch handle is stale: already used, or the cache was emptied")

    def _take_prefetch(self, features: JaggedBatch) -> FusedPrefetchHandle | None:
        handle, self._prefetch = self._prefetch, None
        if handle is None:
            return None
        self._check_handle(handle)
        if not handle.issued_for(features):
            self.cancel_fused_prefetch(handle)
            raise ValueError(
                "prefetch handle was issued for other features than this forward's; "
                "it has been cancelled"
            )
        handle.used = True
        return handle

    # ------------------------------------------------------------------------------------------
    # materialising, checkpoints, statistics

    def _group_of(self, table: str) -> _CacheGroup:
        for group in self._groups:
            if any(t.name == table for t in group.tables):
                return group
        raise KeyError(f"unknown table {table!r}; tables: {[t.name for t in self.tables]}")

    def table_rows(self, table: str, chunk_rows: int = 1 << 16) -> torch.Tensor:
        """Every row ``[num_embeddings, dim + state_dim]`` of a table (weights and optimizer
        state), after writing back the cache's dirty rows. CPU float32."""
        self._group_of(table).cache.flush()
        spec = self.store.table_spec(table)
        out = torch.empty(spec.num_embeddings, spec.row_width)
        for lo in range(0, spec.num_embeddings, chunk_rows):
            ids = torch.arange(lo, min(lo + chunk_rows, spec.num_embeddings))
            out[lo : lo + ids.numel()] = self.store.get(table, ids)
        return out

    def write_table_rows(self, table: str, rows: torch.Tensor, columns: slice) -> None:
        """Overwrite ``columns`` of every row of a table (others kept); empties the caches."""
        if self._inflight or self._trace:
            raise RuntimeError("cannot overwrite tables while a batch is in flight")
        current = self.table_rows(table)
        current[:, columns] = rows.to(torch.float32).cpu()
        self._group_of(table).cache.invalidate()
        self._generation += 1
        chunk = 1 << 16
        for lo in range(0, current.shape[0], chunk):
            ids = torch.arange(lo, min(lo + chunk, current.shape[0]))
            self.store.put(table, ids, current[lo : lo + ids.numel()])

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

    def flush(self) -> None:
        """Write every dirty cached row back to the tier."""
        for group in self._groups:
            group.cache.flush()

    def caches(self) -> list[HotCache]:
        """The caches, one per distinct embedding dim."""
        return [group.cache for group in self._groups]

    def cache_stats(self) -> dict[str, float]:
        """Hits, misses, evictions and writebacks summed over the caches, and the hit rate."""
        total = {"hits": 0, "misses": 0, "evictions": 0, "writebacks": 0}
        for group in self._groups:
            for k, v in group.cache.cache_stats().items():
                if k in total:
                    total[k] += v
        looked_up = total["hits"] + total["misses"]
        total["hit_rate"] = total["hits"] / looked_up if looked_up else 0.0
        return total

    def reset_stats(self) -> None:
        for group in self._groups:
            group.cache.reset_stats()


class RecStoreEmbeddingBagCollection(CachedEmbeddingBagCollection):
    """RecStore's name and signature for the same collection.

    Args:
        embedding_bag_configs: TableConfig or EmbeddingBagConfig objects, or dicts.
        lr: learning rate a sparse optimizer uses when given none.
        enable_fusion, fusion_k: as in `CachedEmbeddingBagCollection`.
        **kwargs: any other `CachedEmbeddingBagCollection` argument.
    """

    def __init__(
        self,
        embedding_bag_configs: Sequence[TableConfig | Mapping[str, Any] | Any],
        lr: float = 0.01,
        enable_fusion: bool = True,
        fusion_k: int = 30,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            tables=embedding_bag_configs,
            lr=lr,
            enable_fusion=enable_fusion,
            fusion_k=fusion_k,
            **kwargs,
        )
