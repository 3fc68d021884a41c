"""CacheEngine: one cache's share of a training step, in the order it runs.

    prepared = engine.prepare(*engine.fuse(batch), lock=True)   # 1. fuse, dedup, resolve, lock
    saved = engine.lookup_rows(prepared, B, out, columns)       # 2. pool bags (or gather rows)
    grads = engine.grad_rows(prepared, B, grad_out, columns, saved)  # 3. one row per id
    entries = engine.trace_entries(prepared.unique, grads, ...) # (per table, for the trace)
    located = engine.locate(entries, table_index)               # 4. slots and per-id gradients,
    engine.apply(located, rule, steps)                          #    rows + state updated in place
    engine.release(prepared)                                    # 5. unlock (apply does it too)

A collection holds one engine per embedding dim (its tables share one `HotCache`) and an
`EngineGroup` that runs them together. The sharded collection uses the same engines on each
rank for the rows it owns, and their reductions (`engine.reduction`) on rows that other ranks
sent. What the lookup does with the rows, pool bags or gather one row per value, is the
engine's `reduction`, chosen by its layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from embcache.cache.hot_cache import HotCache
from embcache.engine.batch_state import DirectIds, InFlight, Prepared, TraceEntry
from embcache.engine.inputs import JaggedBatch, group_inputs
from embcache.engine.layout import CacheLayout
from embcache.engine.reduction import Saved, reduction_of
from embcache.engine.tbe_step import PendingUpdate
from embcache.kernels.ids import (
    Deduped,
    dedup,
    dedup_grouped,
    fuse_ids,
)
from embcache.ops.ids import DirectRows
from embcache.ops.update import RowUpdate
from embcache.profiling import profiled


class TbeStepLike(Protocol):
    """A cache's TBE step (`engine.tbe_step.TbeStep`), as the engine, its group and
    the lookup use it: ``takes`` a share's weights or not; ``pool`` (by slot) or
    ``pool_direct`` (a direct share, by table and raw id) with the graph of the update at
    ``lr``, and the storage it is bound to; ``can_apply`` / ``apply`` a `PendingUpdate`."""

    @property
    def direct(self) -> bool: ...

    def takes(self, weights: torch.Tensor | None) -> bool: ...

    def pool(
        self, p: Prepared, lr: float, batch_size: int
    ) -> tuple[torch.Tensor, tuple[int, int, int]]: ...

    def pool_direct(
        self, p: Prepared, lr: float, batch_size: int
    ) -> tuple[torch.Tensor, tuple[int, int, int]]: ...

    def can_apply(self, pending: PendingUpdate, update: RowUpdate) -> bool: ...

    def apply(self, pending: PendingUpdate, p: Prepared) -> None: ...


@dataclass
class Located:
    """A cache's rows to update in one step: their fused ids, locked slots and gradients, and
    the forward's share whose slots they are (None: locked by `CacheEngine.locate`)."""

    unique: torch.Tensor  # int64 [U] fused ids, ascending
    slots: torch.Tensor  # int64 [U]
    grads: torch.Tensor  # float32 [U, dim]
    prepared: Prepared | None


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` of 2-D row blocks; with no copy (so no launch) when they are
    consecutive rows of one contiguous tensor, as a forward's trace entries are."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    at = first.storage_offset()
    for p in parts:
        if (
            not p.is_contiguous()
            or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or p.storage_offset() != at
            or p.shape[1:] != first.shape[1:]
        ):
            return torch.cat(parts)
        at += p.numel()
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def masked_together(parts: Sequence[torch.Tensor], mask: int) -> list[torch.Tensor]:
    """``[p & mask for p in parts]`` of 1-D int64 tensors; with one op (so one launch) when
    they are contiguous views of one storage, as the shares of one joint dedup are
    (`engine.joint`): the span that covers them all is masked once (the padding between
    shares too, unread), and each part is its slice of it."""
    first = parts[0] if parts else None
    if (
        first is None
        or len(parts) == 1
        or any(
            p.dim() != 1
            or not p.is_contiguous()
            or p.dtype != first.dtype
            or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            for p in parts
        )
    ):
        return [p & mask for p in parts]
    lo = min(p.storage_offset() for p in parts)
    hi = max(p.storage_offset() + p.numel() for p in parts)
    span = first.as_strided((hi - lo,), (1,), lo) & mask
    return [span[p.storage_offset() - lo :][: p.numel()] for p in parts]


class CacheEngine:
    """The data path of one cache (the tables of one embedding dim) through a training step.

    Args:
        layout: the cache's tables and features.
        cache: their device cache.
        fusion_k: bits of the raw id inside a fused id.
        device: where the cache and the batch's tensors live.
    """

    def __init__(
        self, layout: CacheLayout, cache: HotCache, fusion_k: int, device: torch.device
    ) -> None:
        self.layout = layout
        self.cache = cache
        self.fusion_k = fusion_k
        self.device = device
        self.mask = (1 << fusion_k) - 1
        self.reduction = reduction_of(layout, cache.ops)  # pool bags, or one row per value
        # The TBE step (FBGEMM's CPU TBE over this cache), set by `EngineGroup.attach` when it
        # applies to the attached optimizer; None: the twins (or Triton) do every phase.
        self.tbe_step: TbeStepLike | None = None
        self._bases: torch.Tensor | None = None  # direct mapping: slot of row 0 per feature
        self._distinct_rows: DirectRows | None = None  # its pass (`_direct_rows`)
        self._row_ranges: tuple[torch.Tensor, torch.Tensor] | None = None  # `unique_share`'s
        self._columns: torch.Tensor | None = None

    @property
    def dim(self) -> int:
        return self.layout.dim

    @property
    def columns(self) -> torch.Tensor:
        """The first output column of each feature, int64 ``[F]`` (read only)."""
        if self._columns is None:
            f = len(self.layout.features)
            self._columns = torch.arange(f, device=self.device) * self.dim
        return self._columns

    def owns(self, table: str) -> bool:
        return any(t.name == table for t in self.layout.tables)

    # -- 1. prepare ------------------------------------------------------------------------

    @profiled("engine.fuse")
    def fuse(self, batch: JaggedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Validated fused ids, bag lengths and weights of this cache's features in a checked
        batch (device tensors). A bad id raises here, before any cache changes."""
        values, lengths, weights = group_inputs(batch, self.layout.features)
        per_feature = lengths.view(len(self.layout.features), -1).sum(dim=1)
        table_index, table_rows = self.layout.indexes(values.device)
        fused = fuse_ids(
            values,
            per_feature,
            table_index,
            table_rows,
            self.fusion_k,
            self.layout.features,
            self.layout.table_names,
        )
        if weights is not None:
            weights = weights.to(self.device, torch.float32)
        return fused.to(self.device), lengths.to(self.device), weights

    def prepare(
        self,
        fused: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        lock: bool,
        cuts: list[int] | None = None,
    ) -> Prepared:
        """Dedup ``fused`` ids (checked, as `fuse` gives them) and resolve them to slots
        (misses come from the tier), locked until `release` when ``lock``; ``cuts``: see
        `Prepared.cuts`."""
        return self.resolve_share(self.dedup(fused, lengths, weights, cuts), lock)

    def resolve_share(self, p: Prepared, lock: bool, defer_writeback: bool = False) -> Prepared:
        """Resolve a deduplicated share's unique ids to slots, locked until `release` when
        ``lock`` (``defer_writeback``: as `HotCache.resolve` says). Its ids were checked when
        the share was made (`fuse`, `unique_share`)."""
        assert p.unique is not None  # deduplicated (`dedup`, `unique_share`): not direct
        p.slots = self.cache.resolve(
            p.unique, lock=lock, defer_writeback=defer_writeback, checked=True
        )
        p.locked = lock
        return p

    @profiled("engine.dedup")
    def unique_share(self, batch: JaggedBatch) -> Prepared | None:
        """This cache's share of a checked batch, its ids checked, fused and deduplicated in
        one compiled pass (`HotCache.unique_values`), not yet resolved: what `fuse` and then
        `dedup` give, for a cache on the TBE step that indexes its rows. None when that
        does not apply, and for a bad id (`fuse` then raises naming it)."""
        if self.tbe_step is None:
            return None
        values, lengths, weights = group_inputs(batch, self.layout.features)
        if values.device.type != "cpu" or not self.tbe_step.takes(weights):
            return None
        if not self.cache.maps_batch(values.numel()):
            return None
        if self._row_ranges is None:
            self._row_ranges = self.cache.row_ranges([t.index for t in self.layout.feature_table])
        whole = batch.keys() == self.layout.features
        offsets = (batch.offsets() if whole else _offsets(lengths)).to(torch.int64)
        b = batch.stride()
        found = self.cache.unique_values(values, offsets[::b], self._row_ranges) if b else None
        if found is None:
            return None
        unique, inverse = found
        if weights is not None:
            weights = weights.to(self.device, torch.float32)
        return Prepared(unique, inverse, unique[:0], offsets, weights, False)

    @profiled("engine.dedup")
    def dedup(
        self,
        fused: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        cuts: list[int] | None = None,
        found: Deduped | None = None,
    ) -> Prepared:
        """The batch's unique ids, inverse index and bag offsets, not yet resolved (a sharded
        requester sends the unique ids to their owners instead). ``cuts``: see
        `Prepared.cuts`; ``found``: the unique ids and inverse (and table bounds), when
        `IdsOps.dedup_together` made them (`plain_dedup`)."""
        if found is not None:
            unique = found.unique
            # The device path's dedup grouped the values by id (a stable sort): the backward
            # of a cache of one lookup sums by that grouping instead of sorting again.
            grouping = None
            if found.order is not None and len(self.layout.lookups) == 1:
                assert found.segment_starts is not None  # made with the order
                grouping = (found.order, found.segment_starts)
            offsets = found.offsets if found.offsets is not None else _offsets(lengths)
            return Prepared(unique, found.inverse, unique[:0], offsets, weights, False,
                            grouping, cuts=cuts, bounds=found.bounds)  # fmt: skip
        grouping = None
        through_tbe = self.tbe_step is not None and self.tbe_step.takes(weights)
        if self._grouped_dedup(fused, through_tbe):
            # The twins' CPU backward sums each id's rows in one pass over the grouped values
            # (the TBE step's TBE groups them itself: its dedup is half the cost).
            unique, inverse, order, segments = dedup_grouped(fused)
            grouping = (order, segments)
        else:
            by_rows = self.cache.unique_by_rows(fused) if through_tbe else None
            unique, inverse = by_rows or dedup(fused, with_counts=False)[:2]
        empty = unique[:0]
        return Prepared(unique, inverse, empty, _offsets(lengths), weights, False, grouping,
                        cuts=cuts)  # fmt: skip

    def _grouped_dedup(self, fused: torch.Tensor, through_tbe: bool) -> bool:
        # The device path (a GPU, or a CPU under Triton, whose backward does not take the
        # grouping) dedups as a GPU does.
        return not self.cache.device_path and len(self.layout.lookups) == 1 and not through_tbe

    def plain_dedup(self, fused: torch.Tensor, weights: torch.Tensor | None) -> bool:
        """Whether `dedup` of these ids is a plain `kernels.ids.dedup` (no grouping for the
        CPU backward, no map over the rows for the TBE): what `IdsOps.dedup_together` makes."""
        through_tbe = self.tbe_step is not None and self.tbe_step.takes(weights)
        return not through_tbe and not self._grouped_dedup(fused, through_tbe)

    # -- 1'. a direct-mapped cache on the TBE step: no dedup, no resolve ---------------------

    @profiled("engine.direct")
    def direct_share(self, batch: JaggedBatch) -> Prepared | None:
        """This cache's share of a checked training batch, served straight from its slots when
        the cache maps every row directly and the TBE step pools it (FBGEMM's TBE reads
        rows by table and raw id, and sums repeated ids in its own backward): the ids are
        checked and each value's slot computed (`_direct_slots`), or where the ids family is
        compiled, the batch's distinct rows found in the same pass (`_direct_rows`), nothing
        more. None when that does not apply.

        Raises:
            ValueError: an id out of its table's range (nothing changed), as `fuse` says it."""
        if self.tbe_step is None or not self.tbe_step.direct:
            return None
        values, lengths, weights = group_inputs(batch, self.layout.features)
        if not self.tbe_step.takes(weights):
            return None
        values = values.to(self.device, torch.int64)
        if weights is not None:
            weights = weights.to(self.device, torch.float32)
        # The batch's own offsets when this cache reads all its features in its order.
        whole = batch.keys() == self.layout.features
        offsets = (batch.offsets() if whole else _offsets(lengths)).to(self.device, torch.int64)
        share = self._direct_rows(values, offsets, batch.stride())
        if share is None:
            share = DirectIds(values, self._direct_slots(batch, values, lengths).to(self.device))
        return Prepared(None, None, None, offsets, weights, False, direct=share)

    def _direct_rows(
        self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int
    ) -> DirectIds | None:
        """The share with its distinct rows found by one compiled pass over the values, which
        checks the ids as `_direct_slots` does (`IdsOps.direct_rows`); None when the cache's
        ids family is not compiled (`IdsOps.compiled`: its torch specification of the pass is
        what that pass is tested against, and this engine's own torch path serves the share),
        or an id or the offsets are wrong (`_direct_slots` then raises naming it)."""
        ids = self.cache.ops.ids
        if not ids.compiled:
            return None
        if self._distinct_rows is None:
            bases = self.cache.direct_bases()
            table_rows = []
            for t in self.layout.feature_table:
                assert t.num_embeddings is not None  # a direct-mapped cache's are bounded
                table_rows.append(t.num_embeddings)
            self._distinct_rows = ids.direct_rows(
                table_rows,
                [bases[t.index] for t in self.layout.feature_table],
                self.cache.num_slots,
            )
        rows = self._distinct_rows(values, offsets, batch_size)
        return None if rows is None else DirectIds(values, None, rows)

    def _direct_slots(self, batch: JaggedBatch, values: torch.Tensor, lengths: torch.Tensor
                      ) -> torch.Tensor:  # fmt: skip
        """The slot of each value under direct mapping. Features of one length are checked and
        placed in one pass over them all; any other batch goes through `fuse` (which names a
        bad id) and the cache's row of each fused id."""
        f = len(self.layout.features)
        n = values.numel() // f if f else 0
        if n and values.numel() == n * f and bool((lengths.view(f, -1).sum(dim=1) == n).all()):
            grid = values.view(f, n)
            lo, hi = torch.aminmax(grid, dim=1)
            table_rows = self.layout.indexes(hi.device)[1]
            if bool(torch.logical_and(lo >= 0, hi < table_rows).all()):
                return (grid + self._feature_bases().unsqueeze(1)).view(-1)
        fused, _, _ = self.fuse(batch)
        return self.cache.row_index(fused)

    def _feature_bases(self) -> torch.Tensor:
        """Direct mapping: the slot of row 0 of each feature's table, int64 ``[F]``."""
        if self._bases is None:
            bases = self.cache.direct_bases()
            # Made on the cache's device once: no upload per step.
            self._bases = torch.tensor(
                [bases[t.index] for t in self.layout.feature_table], device=self.device
            )
        return self._bases

    def value_slots(self, p: Prepared) -> torch.Tensor:
        """The slot of each value of a direct share (computed once, when the share's pass
        found only its distinct rows)."""
        assert p.direct is not None
        if p.direct.slots is None:
            values = p.direct.values
            b = (p.offsets.numel() - 1) // len(self.layout.features)
            if b and values.numel():
                per_feature = p.offsets[b::b] - p.offsets[:-1:b]
                bases = self._feature_bases()
                values = values + bases.repeat_interleave(per_feature, output_size=values.numel())
            p.direct.slots = values
        return p.direct.slots

    @profiled("engine.direct")
    def serve_direct(self, p: Prepared) -> Prepared:
        """Load the cache on first use and count the share's rows (hits), as a resolve would."""
        assert p.direct is not None
        p.direct.batch = self.cache.serve_direct(p.direct.slots, p.direct.rows)
        return p

    def mark_dirty(self, p: Prepared, release: bool = False) -> None:
        """Mark the rows of a share dirty after its update; with ``release``, `release` it too
        (a locked share's slots are unlocked and marked in one pass)."""
        if p.direct is None and release and p.locked:
            assert p.slots is not None  # locked: resolved
            self.cache.unlock(p.slots, dirty=True)
            p.locked = False
            return
        if p.direct is not None:
            self.cache.mark_dirty_direct(p.direct.slots, p.direct.batch, p.direct.rows)
        else:
            assert p.slots is not None  # a share served otherwise than directly is resolved
            self.cache.mark_dirty(p.slots)
        if release:
            self.release(p)

    def materialize(self, p: Prepared) -> Prepared:
        """Give a direct share its unique ids, inverse index and slots (locked until
        `release`), for the paths that want per-id rows: reading the trace, pooling without
        the TBE (a prefetched share read without gradients)."""
        if p.direct is not None and p.unique is None:
            slots, inverse, _ = dedup(self.value_slots(p), with_counts=False)
            # Slots ascend with fused ids under direct mapping: unique stays ascending.
            p.unique = self.cache.slot_keys.index_select(0, slots)
            p.inverse, p.slots = inverse, slots
            self.cache.hold(slots)
            p.locked = True
        return p

    def resolve(self, unique: torch.Tensor, lock: bool) -> Prepared:
        """Resolve distinct ascending fused ids that arrive without bags (a sharded owner's
        share): their slots, locked until `release` when ``lock``."""
        slots = self.cache.resolve(unique, lock=lock)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return Prepared(unique, torch.arange(unique.numel(), device=self.device), slots, empty,
                        None, lock)  # fmt: skip

    # -- 2. pool (or gather), 3. gradient rows --------------------------------------------

    def output(self, p: Prepared, batch_size: int) -> torch.Tensor:
        """An empty output for a share: ``[B, F * dim]`` pooled, ``[nnz, dim]`` unpooled."""
        assert p.inverse is not None  # materialized (`materialize`) when direct
        return self.reduction.output(batch_size, p.inverse.numel(), self.device)

    def _start(self, columns: torch.Tensor) -> int | None:
        # The engine's own columns lie side by side from 0: the kernels need not read them.
        return 0 if columns is self._columns else None

    @profiled("engine.pool")
    def lookup_rows(
        self, p: Prepared, batch_size: int, out: torch.Tensor, columns: torch.Tensor
    ) -> Saved:
        """Pool the batch's bags (or gather its values' rows) straight from the cache slots
        into ``out``; returns what `grad_rows` needs."""
        # No cache lock: this batch's slots are locked, so no resolve writes them, and a
        # resolve that replaces `rows` (growing the scratch area) copies them unchanged.
        start = self._start(columns)
        rows = self.cache.weights
        assert p.slots is not None  # resolved, or materialized when direct
        return self.reduction.forward(rows, p.slots, p, batch_size, out, columns, start)

    @profiled("engine.grad_rows")
    def grad_rows(
        self,
        p: Prepared,
        batch_size: int,
        grad_out: torch.Tensor,
        columns: torch.Tensor,
        saved: Saved,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One gradient row ``[U, dim]`` per unique id of the batch (written into ``out``
        when given: float32 ``[U, dim]``, contiguous)."""
        assert p.unique is not None  # materialized (`materialize`) when direct
        start, n = self._start(columns), p.unique.numel()
        return self.reduction.backward(
            grad_out, n, p, batch_size, columns, start, saved, p.grouping, out
        )

    @profiled("engine.trace")
    def trace_entries(
        self,
        unique: torch.Tensor,
        grads: torch.Tensor,
        index: int,
        batch: InFlight | None,
        bounds: list[int] | None = None,
        raw: torch.Tensor | None = None,
    ) -> list[TraceEntry]:
        """``(table_name, raw ids, grads)`` per table of this cache, for the trace; ``bounds``:
        `CacheLayout.table_bounds` of ``unique`` when the caller read them already; ``raw``:
        ``unique & mask`` when the caller made it (`masked_together`)."""
        if bounds is None:
            bounds = self.layout.table_bounds(unique, self.fusion_k)
        if raw is None:
            raw = unique & self.mask  # one op for every table; each entry holds a slice of it
        return [
            TraceEntry(t.name, raw[lo:hi], grads[lo:hi], index, batch)
            for t, lo, hi in zip(self.layout.tables, bounds, bounds[1:], strict=False)
        ]

    # -- 4. apply a rule ---------------------------------------------------------------------

    @profiled("engine.locate")
    def locate(self, entries: list[TraceEntry], table_index: dict[str, int]) -> Located:
        """The slots (locked) and per-id gradients of this cache's trace entries.

        Entries of one forward (the usual step) use that forward's slots as they are; entries
        of several forwards (``accumulate_grads``) or of a forward already released are summed
        per id and resolved again, which may read the tier and raise (nothing changed then).
        """
        batch = entries[0].batch
        prepared = batch.prepared[entries[0].engine] if batch is not None else None
        if (
            prepared is not None
            and prepared.locked
            and all(e.batch is batch for e in entries)
            and len({e.table_name for e in entries}) == len(entries)
        ):
            grads = _joined([e.grads for e in entries])
            # Its entries were made of its unique ids (`trace_entries`); locked: resolved.
            assert prepared.unique is not None and prepared.slots is not None
            return Located(prepared.unique, prepared.slots, grads, prepared)
        fused = torch.cat([e.ids | (table_index[e.table_name] << self.fusion_k) for e in entries])
        unique, grads = self.cache.ops.update.aggregate_grads(
            fused, torch.cat([e.grads for e in entries])
        )
        # Their forwards counted these ids' sightings already (admission).
        slots = self.cache.resolve(unique, lock=True, count_sightings=False)
        return Located(unique, slots, grads, None)

    def abandon(self, located: Located) -> None:
        """Give back the slots `locate` locked itself (a later engine failed to locate)."""
        if located.prepared is None:
            self.cache.unlock(located.slots)

    @profiled("engine.apply_rule")
    def apply(self, located: Located, rule: RowUpdate, steps: dict[str, int]) -> None:
        """Update located rows and their state in place with ``rule`` (a
        `ops.update.RowUpdate`; ``steps`` gives each table's step number), mark them dirty
        and unlock them. Makes no tier call, so it cannot fail half-way on a tier error."""
        try:
            self.update(located, rule, steps)
        finally:
            self.cache.unlock(located.slots)
            if located.prepared is not None:
                located.prepared.locked = False

    def update(
        self, located: Located, rule: RowUpdate, steps: dict[str, int], mark_dirty: bool = True
    ) -> None:
        """`apply` without the unlock (`EngineGroup.apply` unlocks every engine's rows at
        once, `unlock_together`): the rows updated in place and marked dirty (unless
        ``mark_dirty`` is False: the unlock marks them)."""
        bounds = None if located.prepared is None else located.prepared.bounds
        self._update_rows(located.unique, located.slots, located.grads, rule, steps, bounds,
                          mark_dirty)  # fmt: skip

    def _update_rows(
        self,
        unique: torch.Tensor,
        slots: torch.Tensor,
        grads: torch.Tensor,
        rule: RowUpdate,
        steps: dict[str, int],
        bounds: list[int] | None = None,
        mark_dirty: bool = True,
    ) -> None:
        cache = self.cache
        table_steps = {steps[t.name] for t in self.layout.tables if t.name in steps}
        # Half-precision weights round stochastically, with draws keyed by each row's id.
        ids = unique if cache.stochastic_rounding else None
        seed = cache.rounding_seed
        may_skip = not cache.admits_all  # slots of ids not admitted are -1
        apply_row_update = cache.ops.update.apply_row_update
        with cache.lock:
            # Slots from a resolve are distinct by construction: no sorted check.
            if len(table_steps) == 1:
                step = table_steps.pop()
                apply_row_update(cache.weights, cache.state, slots, grads, rule, step, False,
                                 ids, seed, may_skip)  # fmt: skip
            else:
                if bounds is None:  # else read by the forward's dedup (`Prepared.bounds`)
                    bounds = self.layout.table_bounds(unique, self.fusion_k)
                for t, lo, hi in zip(self.layout.tables, bounds, bounds[1:], strict=False):
                    if hi > lo:
                        apply_row_update(cache.weights, cache.state, slots[lo:hi], grads[lo:hi],
                                         rule, steps[t.name], False,
                                         None if ids is None else ids[lo:hi], seed,
                                         may_skip)  # fmt: skip
            if mark_dirty:
                cache.mark_dirty(slots)

    # -- 5. release --------------------------------------------------------------------------

    @profiled("engine.release")
    def release(self, p: Prepared) -> None:
        """Unlock a batch's slots (once) and write back scratch rows no batch holds."""
        if p.locked:
            assert p.slots is not None  # locked: resolved, or materialized when direct
            self.cache.unlock(p.slots)
            p.locked = False
