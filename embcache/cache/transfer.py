"""Row transfers between a cache's device slots and its tier.

`HotCache` decides which rows move (the slot index, policy and locks); `TierTransfer` moves
them. Everything here works on host tensors: the cache brings the ids it needs on the host in
one copy per resolve (a copy to the host waits for the device, so one per call, never one per
table), and this class splits them by table on the host, where that costs no synchronisation.

* Write-backs and reads of one resolve go to the tier in one round of calls, one per table,
  run concurrently when the tier declares ``parallel_io`` (a network round trip each, so the
  latency is paid about once); a CPU cache over an in-process tier makes one grouped write
  and one grouped read for all its tables (`Store.put_grouped` / `get_grouped`), and where
  the tier can (HostKV's dense float32 tables), moves the rows straight between its tables
  and the cache's slots (`SlotStorage`, `Store.put_grouped_from` / `get_grouped_into`).
* A CPU cache over an in-process tier can take the rows to write now and make the write later
  (`stage`, `write_staged`): a prefetch worker's resolve hands its batch over first.
* Rows read come back into host memory (pinned when the cache is on a GPU) and are copied into
  their slots on a side stream; the compute stream waits for that copy through an event, so
  kernels already queued keep running.
* Rows travel as the tier stores them (`TableSpec.pack`): half-precision weights move half the
  bytes; they are split into the cache's weights and float32 state on the device.
* Bounded tables (``spec.capacity``): rows read for the cache are pinned in the tier
  (``get(..., pin=True)``) and released (`unpin`) when they leave the cache, after their
  write-back, so the tier never evicts a row the cache holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from embcache.backend import Backend
from embcache.kv.base import Store, TableSpec
from embcache.ops.registry import bind
from embcache.profiling import profiled

# A CPU cache takes the rows read in parts of at least this many (the tier returns one part per
# table): fewer calls for many small tables, no copy of all the rows for large ones.
_PLACE_ROWS = 2048


# `TierTransfer._grouped`: (order or None, [(table_idx, start, raw ids)], all raw ids).
Grouped = tuple[torch.Tensor | None, list[tuple[int, int, torch.Tensor]], torch.Tensor]


@dataclass
class Staged:
    """Rows taken from the cache for a grouped tier write not yet made (`TierTransfer.stage`):
    ``rows`` ``[n, stored_width]`` of raw ``ids``, ``counts[i]`` of them in ``tables[i]``."""

    tables: list[str]
    ids: torch.Tensor
    counts: list[int]
    rows: torch.Tensor

    def __len__(self) -> int:
        return self.ids.numel()


@dataclass
class SlotStorage:
    """A CPU cache's slot storage and the slots of one `TierTransfer.exchange`'s rows: the slot
    each row to write is held at, and the slot each row read goes to. A tier that can moves
    them straight between its tables and these slots (`Store.put_grouped_from`,
    `get_grouped_into`), with no rows tensor between."""

    weights: torch.Tensor
    state: torch.Tensor
    write_slots: torch.Tensor | None = None
    read_slots: torch.Tensor | None = None


def unpadded(host: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """A host copy made for the tier, read: ``host`` is int64 ``[2 + k]``, two counts then k
    ids with -1 where a row is skipped (a padded copy: the counts and the ids in one device
    read, `ScratchArea._release_read`). Returns the counts and the ids kept, in order. Host
    tensors only: nothing here reads the device."""
    return host[:2].tolist(), host[2:][host[2:] >= 0]


def take(t: torch.Tensor, positions: torch.Tensor | slice) -> torch.Tensor:
    """``t[positions]`` along dim 0 for a slice or int64 positions (moved to ``t``'s device),
    the latter through ``index_select`` (whole rows at once)."""
    if isinstance(positions, slice):
        return t[positions]
    return t.index_select(0, positions.to(t.device))


class TierTransfer:
    """Moves rows of the tables of one cache to and from their tier.

    Args:
        store: the tier.
        specs: ``table_idx -> TableSpec`` of the cache's tables (read at each call, so the
            cache may change a table's state layout between calls).
        fusion_k: bits of the raw id inside a fused id ``id | (table_idx << fusion_k)``.
        device: the cache's device (pinned staging and a copy stream when it is a GPU).
        backend: the cache's implementation family (`embcache.backend`), which groups ids and
            moves float32 rows in compiled passes when it is the compiled one.
    """

    def __init__(
        self,
        store: Store,
        specs: Mapping[int, TableSpec],
        fusion_k: int,
        device: torch.device,
        backend: Backend,
    ) -> None:
        self.store = store
        self.specs = specs
        self.fusion_k = fusion_k
        self.device = device
        self.backend = backend
        self.rows = bind(backend).rows  # the grouping by table, the rows' writes
        self._pool: ThreadPoolExecutor | None = None
        self._copy_stream: torch.cuda.Stream | None = None

    @property
    def spec(self) -> TableSpec:
        """A table of the cache: all share dim, dtype and state layout."""
        return next(iter(self.specs.values()))

    def _bounded(self, idx: int) -> bool:
        return self.specs[idx].capacity is not None

    def _empty(self, n: int, pin: bool = False) -> torch.Tensor:
        spec = self.spec
        return torch.empty(n, spec.stored_width, dtype=spec.dtype, pin_memory=pin)

    # -- host side --------------------------------------------------------------------------

    def _grouped(self, fused: torch.Tensor, ascending: bool = True) -> Grouped:
        """``(order, [(table_idx, start, raw_ids)], raw)``: ``fused[order]`` grouped by table,
        so table ``table_idx``'s ids are ``order[start : start + len(raw_ids)]``, raw ids
        ascending (or, with ``ascending=False``, in their order in ``fused``: a write does
        not need them sorted, and grouping by table alone is a radix pass instead of a sort);
        ``raw`` is every group's raw ids one after another (each group's a slice of it).
        ``order`` is None when ``fused`` is sorted already (a cache's misses come so from a
        sorted dedup): the sort, and the permutations it would cost the callers, are skipped.
        """
        grouped = self.rows.group_by_table(fused, self.fusion_k, ascending, max(self.specs) + 1)
        if grouped is not None:  # one pass (the compiled implementation)
            counts, order, raw = grouped
            groups = []
            start = 0
            for idx in np.flatnonzero(counts).tolist():
                count = int(counts[idx])
                groups.append((idx, start, raw[start : start + count]))
                start += count
            return order, groups, raw
        if fused.numel() <= 1 or bool((fused[1:] >= fused[:-1]).all()):
            order, ordered = None, fused
        else:
            tables = fused >> self.fusion_k
            if ascending or max(self.specs) >= 1 << 16:
                order = torch.argsort(fused)
            else:
                # numpy's stable sort of 8/16-bit keys is a radix sort: one pass.
                small = np.uint8 if max(self.specs) < 1 << 8 else np.uint16
                order = torch.from_numpy(np.argsort(tables.numpy().astype(small), kind="stable"))
            ordered = fused.index_select(0, order)
        tables, counts = torch.unique_consecutive(ordered >> self.fusion_k, return_counts=True)
        raw = ordered & ((1 << self.fusion_k) - 1)
        groups = []
        start = 0
        for idx, count in zip(tables.tolist(), counts.tolist(), strict=True):
            groups.append((idx, start, raw[start : start + count]))
            start += count
        return order, groups, raw

    @staticmethod
    def _part(order: torch.Tensor | None, start: int, n: int) -> torch.Tensor | slice:
        """Positions ``start : start + n`` of ``order`` (None: the identity)."""
        return slice(start, start + n) if order is None else order[start : start + n]

    def _run(self, calls: Sequence[Callable[[], object]]) -> list:
        """Run tier calls: concurrently when there are several and the tier's calls overlap
        (``parallel_io``); in turn for in-process tiers."""
        if len(calls) <= 1 or not self.store.parallel_io:
            return [call() for call in calls]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=min(16, 2 * len(self.specs)), thread_name_prefix="embcache-tier"
            )
        return list(self._pool.map(lambda call: call(), calls))

    @profiled("cache.tier_io")
    def exchange(
        self,
        write_ids: torch.Tensor,
        write_rows: Callable[[torch.Tensor | slice], torch.Tensor],
        read_ids: torch.Tensor,
        released: torch.Tensor | None = None,
        slots: SlotStorage | None = None,
        create: bool = True,
    ) -> list[tuple[torch.Tensor | slice, torch.Tensor]]:
        """Write rows back and read others in one round of tier calls (the ids differ, so the
        order between them does not matter), then release the rows that left the cache. Rows
        travel in table order: each table's share is a slice, and no row is gathered or
        scattered on the host only to be put in order.

        Args:
            write_ids: host int64 ``[w]`` fused ids to write.
            write_rows: ``write_rows(positions)`` gives the host stored rows of
                ``write_ids[positions]`` (``positions`` a host int64 tensor or a slice); not
                called when ``w == 0``.
            read_ids: host int64 ``[r]`` fused ids to read (pinned in bounded tables).
            released: host int64 fused ids that left the cache (written back first when
                dirty): their pins in bounded tables are released.
            slots: a CPU cache's storage and the slots of ``write_ids`` and ``read_ids``
                (either None: those rows go through ``write_rows`` and the parts returned).
                On the grouped path, a tier that can moves the rows straight between its
                tables and those slots, and the rows so read are not returned.
            create: read through `Store.get`, which creates the rows the tier does not hold
                (a training resolve); False: through `Store.read`, which creates none and
                reads them as their initial values (inference: the caller keeps such rows
                clean, so they reach the tier only once updated and written back).

        Returns:
            the rows read, in parts ``(positions, rows)``: host stored ``rows``
            ``[len(positions), stored_width]`` of ``read_ids[positions]`` (``positions`` a host
            int64 tensor or a slice). On a device one part (in pinned memory on a GPU); on a CPU
            over an in-process tier one part too (`_exchange_grouped`: one grouped write and
            one grouped read); over a tier whose calls overlap (``parallel_io``), the tier's
            own rows, those of tables with few rows joined into parts of at least `_PLACE_ROWS`
            rows. Empty when nothing is read, or when the rows read went to ``slots``. A tier
            error propagates; nothing here holds state.
        """
        if self.device.type == "cpu" and not self.store.parallel_io:
            return self._exchange_grouped(write_ids, write_rows, read_ids, released, slots, create)
        calls: list[Callable[[], object]] = []
        if write_ids.numel():
            order, groups, _ = self._grouped(write_ids, ascending=False)
            rows = write_rows(slice(None) if order is None else order)
            for idx, start, raw in groups:
                part = rows[start : start + raw.numel()]
                calls.append(partial(self.store.put, self.specs[idx].name, raw, part))
        n_puts = len(calls)
        order, groups, _ = self._grouped(read_ids) if read_ids.numel() else (None, [], None)
        read = self.store.get if create else self.store.read
        for idx, _, raw in groups:
            name = self.specs[idx].name
            if self._bounded(idx):
                calls.append(partial(read, name, raw, pin=True))
            else:
                calls.append(partial(read, name, raw))
        results = self._run(calls)
        if released is not None and released.numel():
            self.unpin(released)
        parts = results[n_puts:]
        if not parts:
            return []
        if self.device.type != "cpu":
            out = self._empty(read_ids.numel(), pin=self.device.type == "cuda")
            torch.cat(parts, out=out)
            return [(slice(None) if order is None else order, out)]
        # On a CPU the rows go to their slots as the tier returned them, a few tables' at a
        # time (no copy of them all into one array, which costs as much as the copy-in).
        chunks: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
        pending: list[torch.Tensor] = []
        first = size = 0
        for (_, start, raw), got in zip(groups, parts, strict=True):
            if not pending:
                first, size = start, 0
            pending.append(got)
            size += raw.numel()
            if size >= _PLACE_ROWS or start + raw.numel() == read_ids.numel():
                rows = pending[0] if len(pending) == 1 else torch.cat(pending)
                chunks.append((self._part(order, first, size), rows))
                pending = []
        return chunks

    @property
    def grouped(self) -> bool:
        """Whether `exchange` makes one grouped write and one grouped read (a CPU cache over an
        in-process tier), the write of which can be staged and made later (`stage`)."""
        return self.device.type == "cpu" and not self.store.parallel_io

    def stage(
        self, write_ids: torch.Tensor, write_rows: Callable[[torch.Tensor | slice], torch.Tensor]
    ) -> Staged:
        """The rows of host ``write_ids`` taken now (``write_rows`` as in `exchange`) and the
        grouped write that puts them in the tier, for `write_staged` to make later: the slots
        they came from may take other rows in between."""
        names, raw, counts, positions = self._write_call(write_ids)
        return Staged(names, raw, counts, write_rows(positions))

    def _write_call(
        self, write_ids: torch.Tensor
    ) -> tuple[list[str], torch.Tensor, list[int], torch.Tensor | slice]:
        """``(tables, raw ids, counts, positions)`` of the grouped write of host ``write_ids``:
        ``write_ids[positions]`` are the ids in the call's order (grouped by table)."""
        order, groups, raw = self._grouped(write_ids, ascending=False)
        names, counts, _ = self._grouped_call(groups)
        return names, raw, counts, slice(None) if order is None else order

    def write_staged(self, staged: Staged) -> None:
        """Make a staged write (`Store.put_grouped`). A tier error propagates and the write can
        be made again: the rows stay in ``staged``."""
        self.store.put_grouped(staged.tables, staged.ids, staged.counts, staged.rows)

    def _exchange_grouped(
        self,
        write_ids: torch.Tensor,
        write_rows: Callable[[torch.Tensor | slice], torch.Tensor],
        read_ids: torch.Tensor,
        released: torch.Tensor | None,
        slots: SlotStorage | None,
        create: bool = True,
    ) -> list[tuple[torch.Tensor | slice, torch.Tensor]]:
        """`exchange` for a CPU cache over an in-process tier: one grouped write and one grouped
        read for all the tables (HostKV moves their rows in one compiled pass each, straight
        between its tables and the cache's ``slots`` when given), the rows read returned as
        one part unless they went to their slots. ``create=False``: the grouped read is
        `Store.read_grouped` (a straight move only takes rows that all exist: it creates
        none)."""
        if write_ids.numel():
            names, raw, counts, positions = self._write_call(write_ids)
            if slots is None or slots.write_slots is None or not self.store.put_grouped_from(
                names, raw, counts, slots.weights, slots.state, take(slots.write_slots, positions)
            ):  # fmt: skip
                self.store.put_grouped(names, raw, counts, write_rows(positions))
        parts: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
        if read_ids.numel():
            order, groups, raw = self._grouped(read_ids)
            names, counts, pins = self._grouped_call(groups)
            positions = slice(None) if order is None else order
            if pins is not None or slots is None or slots.read_slots is None or not (
                self.store.get_grouped_into(
                    names, raw, counts, slots.weights, slots.state,
                    take(slots.read_slots, positions),
                )
            ):  # fmt: skip
                read = self.store.get_grouped if create else self.store.read_grouped
                parts.append((positions, read(names, raw, counts, pins)))
        if released is not None and released.numel():
            self.unpin(released)
        return parts

    def _grouped_call(
        self, groups: list[tuple[int, int, torch.Tensor]]
    ) -> tuple[list[str], list[int], list[bool] | None]:
        """``(tables, counts, pins)`` of a grouped tier call over `_grouped`'s groups (``pins``
        None when no table is bounded)."""
        names = [self.specs[idx].name for idx, _, _ in groups]
        counts = [ids.numel() for _, _, ids in groups]
        pins = [self._bounded(idx) for idx, _, _ in groups]
        return names, counts, pins if any(pins) else None

    def unpin(self, fused: torch.Tensor) -> None:
        """Release the pins of host ``fused`` ids in their bounded tables."""
        _, groups, _ = self._grouped(fused, ascending=False)
        calls = [
            partial(self.store.unpin, self.specs[idx].name, raw)
            for idx, _, raw in groups
            if self._bounded(idx)
        ]
        self._run(calls)

    def pins(self) -> bool:
        """Whether any table is bounded (its rows pinned while cached)."""
        return any(self._bounded(idx) for idx in self.specs)

    def write(self, fused: torch.Tensor, rows: torch.Tensor) -> None:
        """Write host stored ``rows`` ``[n, stored_width]`` under host ``fused`` ids."""
        self.exchange(fused, lambda positions: take(rows, positions), fused[:0])

    def read(self, fused: torch.Tensor) -> torch.Tensor:
        """Host stored rows of host ``fused`` ids, through `Store.read`: rows the tier does
        not hold read as their initial values and are not created there."""
        if not fused.numel():
            return self._empty(0)
        order, groups, _ = self._grouped(fused)
        calls = [partial(self.store.read, self.specs[idx].name, raw) for idx, _, raw in groups]
        parts = self._run(calls)
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        if order is None:
            return rows
        out = self._empty(fused.numel())
        out.index_copy_(0, order, rows)
        return out

    # -- device side ------------------------------------------------------------------------

    @profiled("cache.copy_in")
    def copy_in(
        self,
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        host_rows: torch.Tensor,
    ) -> None:
        """``weights[slots], state[slots] = host_rows`` (stored rows, `TableSpec.unpack`). On a
        GPU the copies run on a side stream and the current stream waits for them (an event):
        kernels queued after this see the rows."""
        spec = self.spec
        if self.device.type == "cpu" and spec.dtype == torch.float32:  # stored: [weights|state]
            self.rows.scatter_split(weights, state, slots, host_rows)  # one compiled pass
            return
        if self.device.type != "cuda":
            w, s = spec.unpack(host_rows)
            self.rows.copy_rows(weights, slots, w)
            self.rows.copy_rows(state, slots, s)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            w, s = spec.unpack(host_rows.to(self.device, non_blocking=True))
            weights[slots] = w
            state[slots] = s
            done = torch.cuda.Event()
            done.record(stream)
        torch.cuda.current_stream(self.device).wait_event(done)

    def place(
        self,
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        parts: list[tuple[torch.Tensor | slice, torch.Tensor]],
    ) -> None:
        """`copy_in` the rows `exchange` read: ``slots`` (on the cache's device) is the slot
        of each id it was asked to read, in that order."""
        for positions, rows in parts:
            self.copy_in(weights, state, take(slots, positions), rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
