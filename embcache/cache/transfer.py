"""Row transfers between a cache's device slots and its tier.

`HotCache` decides which rows move (the slot index, policy and locks); `TierTransfer` moves
them. Everything here works on host tensors: the cache brings the ids it needs on the host in
one copy per resolve (a copy to the host waits for the device, so one per call, never one per
table), and this class splits them by table on the host, where that costs no synchronisation.

* Write-backs and reads of one resolve go to the tier in one round of calls, one per table,
  run concurrently when the tier declares ``parallel_io`` (a network round trip each, so the
  latency is paid about once).
* Rows read come back into host memory (pinned when the cache is on a GPU) and are copied into
  their slots on a side stream; the compute stream waits for that copy through an event, so
  kernels already queued keep running.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from embcache.kv.base import Store, TableSpec
from embcache.profiling import profiled


class TierTransfer:
    """Moves rows of the tables of one cache to and from their tier.

    Args:
        store: the tier.
        specs: ``table_idx -> TableSpec`` of the cache's tables (read at each call, so the
            cache may change a table's state layout between calls).
        fusion_k: bits of the raw id inside a fused id ``id | (table_idx << fusion_k)``.
        device: the cache's device (pinned staging and a copy stream when it is a GPU).
    """

    def __init__(
        self,
        store: Store,
        specs: Mapping[int, TableSpec],
        fusion_k: int,
        device: torch.device,
    ) -> None:
        self.store = store
        self.specs = specs
        self.fusion_k = fusion_k
        self.device = device
        self._pool: ThreadPoolExecutor | None = None
        self._copy_stream: torch.cuda.Stream | None = None

    @property
    def width(self) -> int:
        return next(iter(self.specs.values())).row_width

    # -- host side --------------------------------------------------------------------------

    def split_by_table(self, fused: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(table_idx, positions, raw_ids)`` per table present in host ``fused`` ids."""
        order = torch.argsort(fused)
        sorted_ids = fused[order]
        tables, counts = torch.unique_consecutive(sorted_ids >> self.fusion_k, return_counts=True)
        mask = (1 << self.fusion_k) - 1
        groups = []
        start = 0
        for idx, count in zip(tables.tolist(), counts.tolist(), strict=True):
            groups.append(
                (idx, order[start : start + count], sorted_ids[start : start + count] & mask)
            )
            start += count
        return groups

    def _run(self, calls: list[Callable[[], object]]) -> list:
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
        write_rows: torch.Tensor | None,
        read_ids: torch.Tensor,
    ) -> torch.Tensor | None:
        """Write rows back and read others in one round of tier calls (the ids differ, so the
        order between them does not matter).

        Args:
            write_ids: host int64 ``[w]`` fused ids to write.
            write_rows: host float32 ``[w, width]`` their rows (None when ``w == 0``).
            read_ids: host int64 ``[r]`` fused ids to read.

        Returns:
            Host float32 ``[r, width]`` rows read (pinned when the cache is on a GPU), or None
            when nothing is read. A tier error propagates; nothing here holds state.
        """
        calls = []
        if write_ids.numel():
            for idx, pos, raw in self.split_by_table(write_ids):
                calls.append(partial(self.store.put, self.specs[idx].name, raw, write_rows[pos]))
        n_puts = len(calls)
        groups = self.split_by_table(read_ids) if read_ids.numel() else []
        calls += [partial(self.store.get, self.specs[idx].name, raw) for idx, _, raw in groups]
        results = self._run(calls)
        if not groups:
            return None
        pin = self.device.type == "cuda"
        out = torch.empty(read_ids.numel(), self.width, dtype=torch.float32, pin_memory=pin)
        for (_, pos, _), rows in zip(groups, results[n_puts:], strict=True):
            out[pos] = rows
        return out

    def write(self, fused: torch.Tensor, rows: torch.Tensor) -> None:
        """Write host ``rows`` ``[n, width]`` under host ``fused`` ids."""
        self.exchange(fused, rows, fused[:0])

    def read(self, fused: torch.Tensor) -> torch.Tensor:
        """Host rows ``[n, width]`` of host ``fused`` ids, through `Store.read`: rows the tier
        does not hold read as their initial values and are not created there."""
        groups = self.split_by_table(fused) if fused.numel() else []
        calls = [partial(self.store.read, self.specs[idx].name, raw) for idx, _, raw in groups]
        out = torch.empty(fused.numel(), self.width, dtype=torch.float32)
        for (_, pos, _), rows in zip(groups, self._run(calls), strict=True):
            out[pos] = rows
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
        """``weights[slots], state[slots] = host_rows`` split after the weights' columns. On a
        GPU the copies run on a side stream and the current stream waits for them (an event):
        kernels queued after this see the rows."""
        dim = weights.shape[1]
        if self.device.type != "cuda":
            weights[slots] = host_rows[:, :dim]
            state[slots] = host_rows[:, dim:]
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            rows = host_rows.to(self.device, non_blocking=True)
            weights[slots] = rows[:, :dim]
            state[slots] = rows[:, dim:]
            done = torch.cuda.Event()
            done.record(stream)
        torch.cuda.current_stream(self.device).wait_event(done)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
