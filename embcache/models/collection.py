"""CachedEmbeddingBagCollection: torchrec's EmbeddingBagCollection over a device cache.

Example::

    ebc = CachedEmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=10_000,
                                   feature_names=["f0", "f1"])],
        cache=CacheConfig(load_factor=0.1),
    )
    opt = SparseAdaGrad([ebc], lr=0.05)
    # kjt: KeyedJaggedTensor with keys ["f0", "f1"], batch of B bags per key
    kt = ebc(kjt)                       # KeyedTensor, keys ["f0", "f1"], values [B, 32]
    kt.values().sum().backward()        # one gradient row per unique id, into ebc._trace
    opt.step()                          # fused update in the cache slots; trace cleared

A forward, per cache (one per distinct embedding dim):

1. validate the KJT and fuse ids: ``fused = id | (table_idx << fusion_k)`` (bad ids raise before
   anything changes);
2. dedup the fused ids; resolve them to cache slots (misses come from the tier), locking the
   slots until the optimizer step (nothing is locked under ``torch.no_grad()``);
3. pool each bag straight from the slots (SUM/MEAN/MAX, per-sample weights).

Backward turns the pooled gradient into one row per unique id and appends
``(table_name, ids, grads)`` to ``_trace`` (or, with ``update_in_backward=True``, applies the
attached optimizer at once). A forward whose output is never backpropagated holds its locks only
until the next forward; a forward while an un-stepped trace exists is an error unless
``accumulate_grads=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.kernels.ids import dedup, fuse_ids
from embcache.kernels.pooling import PoolingMode, pool_backward, pool_forward
from embcache.kv.base import Store, TableSpec
from embcache.kv.url import open_store
from embcache.models.tables import TableConfig, normalize_tables

_UNFUSED_K = 48  # enable_fusion=False: internal fusion with room for ids below 2**48


@dataclass
class _Lookup:
    """The features of one cache that share a pooling mode, laid out contiguously."""

    mode: PoolingMode
    features: list[str]
    feature_lo: int  # first feature of this lookup within its cache's feature order
    feature_hi: int


@dataclass
class _CacheGroup:
    """The tables of one embedding dim, their cache, and their features in lookup order."""

    dim: int
    cache: HotCache
    tables: list[TableConfig]
    features: list[str]
    feature_table: list[TableConfig]
    lookups: list[_Lookup]
    table_index: torch.Tensor = field(init=False)  # int64 [F] table of each feature
    table_rows: torch.Tensor = field(init=False)  # int64 [F] num_embeddings of that table
    table_names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.table_index = torch.tensor([t.index for t in self.feature_table])
        self.table_rows = torch.tensor([t.num_embeddings for t in self.feature_table])
        self.table_names = [t.name for t in self.feature_table]


@dataclass
class _Resolved:
    """One cache's share of a batch: unique ids, their slots, and the bag layout."""

    unique: torch.Tensor  # int64 [U] fused ids, ascending
    inverse: torch.Tensor  # int64 [nnz]
    slots: torch.Tensor  # int64 [U]
    offsets: torch.Tensor  # int64 [F*B + 1]
    weights: torch.Tensor | None
    locked: bool


@dataclass
class FusedPrefetchHandle:
    """What `issue_fused_prefetch` resolved for one batch: pass it to
    `set_fused_prefetch_handle` and run the forward on the same features."""

    module_id: int
    generation: int
    keys: list[str]
    lengths: torch.Tensor
    values: torch.Tensor
    resolved: list[_Resolved]
    used: bool = False


@dataclass
class _Batch:
    """A forward in flight: its locked slots, whether backward ran, whether it was released."""

    resolved: list[_Resolved]
    backward_done: bool = False
    released: bool = False


class TraceEntry:
    """One table's gradients from one backward; unpacks as ``(table_name, ids, grads)``."""

    __slots__ = ("batch", "grads", "group", "ids", "table_name", "unique_hi", "unique_lo")

    def __init__(self, table_name, ids, grads, group, batch, unique_lo, unique_hi) -> None:
        self.table_name = table_name
        self.ids = ids  # int64 [n] raw ids, ascending, distinct
        self.grads = grads  # float32 [n, D]
        self.group = group  # index of the cache group
        self.batch = batch  # the _Batch whose slots hold these rows
        self.unique_lo = unique_lo  # slice of the batch's unique ids in that group
        self.unique_hi = unique_hi

    def __iter__(self):
        return iter((self.table_name, self.ids, self.grads))

    def __repr__(self) -> str:
        return f"TraceEntry({self.table_name!r}, ids[{self.ids.numel()}])"


class CachedEmbeddingBagCollection(nn.Module):
    """Pooled embedding lookups over a device cache with a write-back tier behind it.

    Same input, output, keys and values as `torchrec.EmbeddingBagCollection` given the same
    weights, plus MAX pooling; tables may be far larger than the device, only the cached rows
    live there.

    Args:
        tables: `torchrec.EmbeddingBagConfig` objects or dicts (``name``, ``embedding_dim``,
            ``num_embeddings``, ``feature_names``, optional ``pooling``: SUM, MEAN or MAX).
        is_weighted: the KJTs carry per-sample weights.
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

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig | Mapping[str, Any]],
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
        pairs = [(f, t) for t in tables for f in t.feature_names]
        pairs.sort(key=lambda p: int(p[1].pooling))  # stable: same-mode features contiguous
        lookups: list[_Lookup] = []
        for i, (f, t) in enumerate(pairs):
            if lookups and lookups[-1].mode == t.pooling:
                lookups[-1].features.append(f)
                lookups[-1].feature_hi = i + 1
            else:
                lookups.append(_Lookup(t.pooling, [f], i, i + 1))
        cache = HotCache(
            [(t.index, self.specs[t.name]) for t in tables],
            self.cache_config,
            self.store,
            self.device,
            self.fusion_k,
        )
        return _CacheGroup(
            dim, cache, tables, [f for f, _ in pairs], [t for _, t in pairs], lookups
        )

    # ------------------------------------------------------------------------------------------
    # input checks and id preparation

    def _check_features(self, features: KeyedJaggedTensor) -> None:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"expected a torchrec KeyedJaggedTensor, got {type(features).__name__}")
        keys = features.keys()
        unknown = [k for k in keys if k not in self.feature_to_table]
        if unknown:
            raise ValueError(
                f"unknown feature keys {unknown}; this collection looks up {self.output_keys}"
            )
        missing = [k for k in self.output_keys if k not in keys]
        if missing:
            raise ValueError(f"KeyedJaggedTensor lacks features {missing}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate feature keys in {keys}")
        if features.variable_stride_per_key():
            raise ValueError("KJTs with a variable batch size per feature are not supported")
        values, lengths = features.values(), features.lengths()
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"KJT values must be integer ids, got dtype {values.dtype}")
        if lengths.numel() != len(keys) * features.stride():
            raise ValueError(
                f"KJT lengths has {lengths.numel()} entries, expected "
                f"{len(keys)} features x batch {features.stride()}"
            )
        if bool((lengths < 0).any()):
            raise ValueError("KJT lengths must be >= 0")
        if int(lengths.sum()) != values.numel():
            raise ValueError(
                f"KJT lengths sum to {int(lengths.sum())} but there are {values.numel()} values"
            )
        weights = features.weights_or_none()
        if self.is_weighted and weights is None:
            raise ValueError("this collection is_weighted=True but the KJT carries no weights")
        if not self.is_weighted and weights is not None:
            raise ValueError("the KJT carries weights but the collection is_weighted=False")
        if weights is not None:
            if not weights.is_floating_point():
                raise TypeError(f"KJT weights must be floating point, got {weights.dtype}")
            if weights.numel() != values.numel():
                raise ValueError(f"KJT has {weights.numel()} weights for {values.numel()} values")

    def _group_inputs(self, features: KeyedJaggedTensor, group: _CacheGroup):
        """Values, lengths and weights of a group's features, in the group's feature order."""
        keys = features.keys()
        B = features.stride()
        values, lengths = features.values(), features.lengths()
        weights = features.weights_or_none()
        if keys == group.features:
            return values, lengths, weights
        offsets = features.offset_per_key()
        pos = {k: i for i, k in enumerate(keys)}
        order = [pos[f] for f in group.features]
        v = torch.cat([values[offsets[i] : offsets[i + 1]] for i in order])
        ln = torch.cat([lengths[i * B : (i + 1) * B] for i in order])
        w = None
        if weights is not None:
            w = torch.cat([weights[offsets[i] : offsets[i + 1]] for i in order])
        return v, ln, w

    def _fuse_group(
        self, features: KeyedJaggedTensor, group: _CacheGroup
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Validated fused ids, bag lengths and weights of a group (device tensors)."""
        values, lengths, weights = self._group_inputs(features, group)
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

    def _resolve_all(self, features: KeyedJaggedTensor, lock: bool) -> list[_Resolved]:
        """Dedup and resolve every group; all ids are validated before any cache changes."""
        self._check_features(features)
        prepared = [self._fuse_group(features, g) for g in self._groups]
        resolved: list[_Resolved] = []
        try:
            for group, (fused, lengths, weights) in zip(self._groups, prepared, strict=True):
                unique, inverse, _ = dedup(fused)
                slots = group.cache.resolve(unique, lock=lock)
                offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=self.device)
                torch.cumsum(lengths, 0, out=offsets[1:])
                resolved.append(_Resolved(unique, inverse, slots, offsets, weights, lock))
        except BaseException:
            if lock:
                for group, r in zip(self._groups, resolved, strict=False):
                    group.cache.unlock(r.slots)
            raise
        return resolved

    # ------------------------------------------------------------------------------------------
    # forward

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of every feature: a `KeyedTensor` ``[B, sum of dims]`` whose keys
        are the tables' feature names in table order (as torchrec orders them)."""
        training = torch.is_grad_enabled()
        if training:
            try:
                self._begin_batch()
            except RuntimeError:
                if self._prefetch is not None:  # its locks would belong to no batch
                    self.cancel_fused_prefetch(self._prefetch)
                raise
        handle = self._take_prefetch(features)
        resolved = handle.resolved if handle else self._resolve_all(features, lock=training)
        batch = _Batch(resolved) if training else None
        if batch is not None:
            self._inflight.append(batch)
        B = features.stride()
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
        return KeyedTensor(keys=self.output_keys, length_per_key=self.output_dims, values=values)

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
        batch.released = True

    def _release_all(self) -> None:
        for batch in self._inflight:
            self._release(batch)
        self._inflight = []

    def _pool(self, gi: int, r: _Resolved, B: int) -> tuple[torch.Tensor, list]:
        group = self._groups[gi]
        out = torch.empty(B, len(group.features) * group.dim, device=self.device)
        argmaxes = []
        # No cache lock: this batch's slots are locked, so no resolve writes them, and a
        # resolve that replaces `rows` (growing the scratch area) copies them unchanged.
        rows = group.cache.rows
        for lk, inputs in zip(group.lookups, self._lookup_inputs(group, r, B), strict=True):
            inverse, offsets, weights, cols = inputs
            argmaxes.append(
                pool_forward(
                    rows,
                    group.dim,
                    r.slots,
                    inverse,
                    offsets,
                    weights,
                    lk.mode,
                    out,
                    B,
                    cols,
                )
            )
        return out, argmaxes

    def _lookup_inputs(self, group: _CacheGroup, r: _Resolved, B: int):
        """Per lookup of a group: its values' inverse, rebased offsets, weights and columns."""
        if len(group.lookups) == 1:
            cols = torch.arange(len(group.features), device=self.device) * group.dim
            return [(r.inverse, r.offsets, r.weights, cols)]
        bounds = r.offsets[[lk.feature_lo * B for lk in group.lookups] + [r.offsets.numel() - 1]]
        bounds = bounds.tolist()
        inputs = []
        for i, lk in enumerate(group.lookups):
            lo, hi = bounds[i], bounds[i + 1]
            offsets = r.offsets[lk.feature_lo * B : lk.feature_hi * B + 1] - lo
            weights = None if r.weights is None else r.weights[lo:hi]
            cols = torch.arange(lk.feature_lo, lk.feature_hi, device=self.device) * group.dim
            inputs.append((r.inverse[lo:hi], offsets, weights, cols))
        return inputs

    def _grad_rows(self, gi: int, r: _Resolved, B: int, grad_out, argmaxes) -> torch.Tensor:
        group = self._groups[gi]
        grad = None
        lookups = zip(group.lookups, self._lookup_inputs(group, r, B), argmaxes, strict=True)
        for lk, (inverse, offsets, weights, cols), argmax in lookups:
            g = pool_backward(
                grad_out,
                group.dim,
                inverse,
                r.unique.numel(),
                offsets,
                weights,
                lk.mode,
                B,
                cols,
                argmax,
            )
            grad = g if grad is None else grad + g
        return grad

    def _on_backward(self, batch: _Batch, grad_rows: list[torch.Tensor]) -> None:
        """Record every group's gradient rows of one backward (or apply them all at once)."""
        batch.backward_done = True
        mask = (1 << self.fusion_k) - 1
        entries = []
        for gi, (group, r, grads) in enumerate(
            zip(self._groups, batch.resolved, grad_rows, strict=True)
        ):
            starts = torch.tensor(
                [t.index << self.fusion_k for t in group.tables], device=self.device
            )
            bounds = [*torch.searchsorted(r.unique, starts).tolist(), r.unique.numel()]
            for i, t in enumerate(group.tables):
                lo, hi = bounds[i], bounds[i + 1]
                entries.append(
                    TraceEntry(t.name, r.unique[lo:hi] & mask, grads[lo:hi], gi, batch, lo, hi)
                )
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

    def issue_fused_prefetch(self, features: KeyedJaggedTensor) -> FusedPrefetchHandle:
        """Dedup and resolve a batch ahead of its forward; its slots stay locked until that
        forward's step (or `cancel_fused_prefetch`)."""
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

    def _take_prefetch(self, features: KeyedJaggedTensor) -> FusedPrefetchHandle | None:
        handle, self._prefetch = self._prefetch, None
        if handle is None:
            return None
        self._check_handle(handle)
        same = list(features.keys()) == handle.keys and (
            (features.values() is handle.values and features.lengths() is handle.lengths)
            or (
                torch.equal(features.lengths(), handle.lengths)
                and torch.equal(features.values(), handle.values)
            )
        )
        if not same:
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


class _PooledLookup(torch.autograd.Function):
    """Pool every cache group's bags from its slots; backward yields one gradient row per unique
    id and group, handed to the collection (trace or immediate update), never a table-sized
    gradient."""

    @staticmethod
    def forward(ctx, anchor, module, resolved, batch, batch_size):
        outs, argmaxes = [], []
        for gi, r in enumerate(resolved):
            out, argmax = module._pool(gi, r, batch_size)
            outs.append(out)
            argmaxes.append(argmax)
        ctx.module, ctx.resolved, ctx.batch = module, resolved, batch
        ctx.batch_size, ctx.argmaxes = batch_size, argmaxes
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        module = ctx.module
        grad_rows = []
        for gi, (r, grad_out) in enumerate(zip(ctx.resolved, grad_outs, strict=True)):
            if grad_out.stride(-1) != 1 or grad_out.stride(0) < grad_out.shape[1]:
                grad_out = grad_out.contiguous()  # e.g. the expanded gradient of a .sum()
            grad_rows.append(module._grad_rows(gi, r, ctx.batch_size, grad_out, ctx.argmaxes[gi]))
        module._on_backward(ctx.batch, grad_rows)
        return None, None, None, None, None


class RecStoreEmbeddingBagCollection(CachedEmbeddingBagCollection):
    """RecStore's name and signature for the same collection.

    Args:
        embedding_bag_configs: EmbeddingBagConfig objects or dicts.
        lr: learning rate a sparse optimizer uses when given none.
        enable_fusion, fusion_k: as in `CachedEmbeddingBagCollection`.
        **kwargs: any other `CachedEmbeddingBagCollection` argument.
    """

    def __init__(
        self,
        embedding_bag_configs: Sequence[EmbeddingBagConfig | Mapping[str, Any]],
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
