"""Row I/O of `RedisKV` in chunks of at most ``chunk_rows`` ids, each chunk one round trip
run under `RedisCalls.call`: reads that create missing rows (``SET NX``, another client's
value kept), reads that create nothing, whole-row writes, the SCAN of a table's ids, the
export's fetches and the rewrite of a table's state columns. Every read and write goes
through the write marks (`MarkGuard`) and the table's fence (this writer's epoch, see
`embcache.kv.redis_lease`), and rows this client wrote are remembered
(`WrittenIds`, kept in the client's `RedisTables`) so that one found missing is a loss, never a
row re-created. A part `RedisKV` holds (`RedisRowIO`).
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterator
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from embcache.kv.base import checked_ids, checked_rows
from embcache.kv.redis_calls import RedisCalls
from embcache.kv.redis_tables import RedisTables
from embcache.kv.redis_wire import (
    ROW_DTYPE,
    TableLayout,
    decode_blobs,
    from_blobs,
    key_batch,
    set_nx,
    to_blobs,
)
from embcache.kv.tier_state import missing_rows_message

_SCAN_COUNT = 1000
_T = TypeVar("_T")


class RedisRowIO:
    """Chunked row reads and writes of one `RedisKV` client.

    Args:
        calls: the client's call layer (connection, guards, retries).
        tables: its registry (the rows each table's writes were acknowledged for, the counters).
        chunk_rows: most rows per round trip.
    """

    def __init__(self, calls: RedisCalls, tables: RedisTables, chunk_rows: int) -> None:
        self._calls = calls
        self._tables = tables
        self._client = calls.client
        self._marks = calls.marks
        self._cluster = calls.cluster
        self.chunk_rows = chunk_rows

    # -- what `RedisKV` calls ------------------------------------------------------------

    def get(self, t: TableLayout, ids: torch.Tensor) -> torch.Tensor:
        """`RedisKV.get`: rows missing on the server are created (a read-only client creates
        none), counted."""
        ids = checked_ids(t.spec, ids)
        out = torch.empty(ids.numel(), t.spec.stored_width, dtype=t.spec.dtype)
        created = 0
        for start in range(0, ids.numel(), self.chunk_rows):
            chunk = ids[start : start + self.chunk_rows]
            if self._calls.shared:  # read-only: nothing is created
                rows, made = self._call("get", t, partial(self._read_chunk, t, chunk)), 0
            else:
                rows, made = self._call("get", t, partial(self._get_chunk, t, chunk))
            out[start : start + chunk.numel()] = rows
            created += made
        self._tables.count("read", ids.numel(), t, created=created)
        return out

    def read(self, t: TableLayout, ids: torch.Tensor) -> torch.Tensor:
        """`RedisKV.read`: rows not on the server read as their initial values, none created;
        counted."""
        ids = checked_ids(t.spec, ids)
        out = torch.empty(ids.numel(), t.spec.stored_width, dtype=t.spec.dtype)
        for start in range(0, ids.numel(), self.chunk_rows):
            chunk = ids[start : start + self.chunk_rows]
            rows = self._call("read", t, partial(self._read_chunk, t, chunk))
            out[start : start + chunk.numel()] = rows
        self._tables.count("read", ids.numel(), t)
        return out

    def write(self, t: TableLayout, op: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole rows of ``ids`` (stored, or the float32 view), chunk by chunk in order."""
        self._calls.check_writable(op, t.spec.name)
        ids = checked_ids(t.spec, ids)
        rows = checked_rows(t.spec, ids, rows)
        for start in range(0, ids.numel(), self.chunk_rows):
            part = slice(start, start + self.chunk_rows)
            if t.stored is None:
                blobs = to_blobs(rows[part])
                self._call(op, t, partial(self._put_blobs, t, ids[part], blobs))
            else:
                self._call(op, t, partial(self._put_keeping_state, t, ids[part], rows[part]))

    def remove(self, t: TableLayout, ids: torch.Tensor) -> None:
        """DEL the rows of ``ids``, with the write marks incremented like any write."""
        self._calls.check_writable("remove", t.spec.name)
        ids = checked_ids(t.spec, ids)
        # Forgotten before the DEL: a read racing it must not take the row for lost.
        self._tables.written_ids(t).discard(ids)
        for part in ids.split(self.chunk_rows):
            batch = key_batch(t, part, self._cluster)
            fence = self._writer_fence(t)
            self._call("remove", t, partial(self._marks.write, t, batch, None, fence))

    def export(
        self, t: TableLayout, chunk_rows: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """`RedisKV.export_rows`: the ids listed and sorted first, a written one found missing
        a loss, then the rows fetched chunk by chunk (a generator)."""
        # Marks before listing and after the last fetch: a server that lost writes before or
        # during the export must not end up in a checkpoint.
        self._call("export_rows", t, lambda: self._marks.verify([t]))
        ids = self._call("export_rows", t, lambda: self.scan_ids(t))
        written = self._tables.written_ids(t).ids()
        absent = written[~torch.isin(written, ids)]
        if absent.numel():
            self._call(
                "export_rows", t, lambda: self._check_not_lost(t, absent, "a checkpoint export")
            )
        return self._export_chunks(t, ids, chunk_rows)

    def scan_ids(self, t: TableLayout) -> torch.Tensor:
        """Ids of every row of the table on the server, ascending (SCAN over all primaries)."""
        found = array.array("q")
        for key in self._client.scan_iter(match=t.scan_match, count=_SCAN_COUNT):
            match = t.id_re.fullmatch(key)
            if match is not None:  # the pattern also admits tables named like "T:x"
                found.append(int(match.group(1)))
        ids = torch.from_numpy(np.frombuffer(found, dtype=np.int64).copy())
        # A cluster SCAN may list a key twice when a slot migrates while it runs.
        return torch.unique(ids)

    def reset_state(self, t: TableLayout) -> None:
        """Rewrite every row of ``t`` on the server as its first ``dim`` weights + fresh state.

        Idempotent (the weights are always the leading ``dim`` columns), so a rewrite cut short
        by a fault is finished by declaring the table again.
        """
        ids = self._call("init_table", t, lambda: self.scan_ids(t))
        weight_bytes = t.spec.dim * t.spec.dtype.itemsize
        state = np.full(t.spec.state_dim, t.spec.state_init, dtype=ROW_DTYPE).tobytes()

        def rewrite(part: torch.Tensor) -> None:
            values = self._mget_in_order(t, part)
            present = [k for k, value in enumerate(values) if value is not None]
            blobs = [values[k][:weight_bytes] + state for k in present]  # type: ignore[index]
            if any(len(blob) != t.row_bytes for blob in blobs):
                raise RuntimeError(f"table {t.spec.name!r}: a row on the server is too short")
            if blobs:
                self._put_blobs(t, part[torch.tensor(present, dtype=torch.int64)], blobs)

        for part in ids.split(self.chunk_rows):
            self._call("init_table", t, partial(rewrite, part))

    # -- one round trip each (run under `RedisCalls.call`) --------------------------------

    def _call(self, op: str, t: TableLayout, fn: Callable[[], _T]) -> _T:
        return self._calls.call(op, t.spec.name, fn)

    def _export_chunks(
        self, t: TableLayout, ids: torch.Tensor, chunk_rows: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, ids.numel(), chunk_rows):
            part = ids[start : start + chunk_rows]
            kept, rows = [], []
            for sub in part.split(self.chunk_rows):
                found, values = self._call("export_rows", t, partial(self._fetch_existing, t, sub))
                kept.append(found)
                rows.append(values)
            if start + chunk_rows >= ids.numel():
                self._call("export_rows", t, lambda: self._marks.verify([t]))
            yield torch.cat(kept), torch.cat(rows)

    def _writer_fence(self, t: TableLayout) -> bytes:
        fence = self._calls.fence(t.spec.name)
        if fence is None:  # `check_writable` refuses a read-only client's writes before
            raise RuntimeError(f"table {t.spec.name!r}: a write without this client's lease")
        return fence

    def _check_not_lost(self, t: TableLayout, absent: torch.Tensor, how: str) -> None:
        """``absent`` ids were found missing: a loss when any of them was written (read
        again first: a write acknowledged meanwhile is not a loss)."""
        if absent.numel() == 0:
            return
        written = self._tables.written(t.spec.name)
        if written is None:
            return
        suspects = absent[written.contains(absent)]
        if suspects.numel() == 0:
            return
        again = self._mget_in_order(t, suspects)
        lost = suspects[torch.tensor([v is None for v in again], dtype=torch.bool)]
        if lost.numel():
            message = missing_rows_message(self._calls.describe(), t.spec.name, lost, how)
            self._marks.fail(t.spec.name, message)

    def _mget_in_order(self, t: TableLayout, ids: torch.Tensor) -> list[bytes | None]:
        """Values of the rows of ``ids`` (None where absent), in the order of ``ids``."""
        batch = key_batch(t, ids, self._cluster)
        values = self._marks.read(t, batch, self._calls.fence(t.spec.name))
        if batch.order is None:
            return values
        ordered: list[bytes | None] = [None] * len(values)
        for position, value in zip(batch.order.tolist(), values, strict=True):
            ordered[position] = value
        return ordered

    def _put_blobs(self, t: TableLayout, ids: torch.Tensor, blobs: list[bytes]) -> None:
        batch = key_batch(t, ids, self._cluster)
        if batch.order is not None:
            blobs = [blobs[k] for k in batch.order.tolist()]
        self._marks.write(t, batch, blobs, self._writer_fence(t))
        self._tables.written_ids(t).add(ids)

    def _get_chunk(self, t: TableLayout, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Rows of one chunk of ids (creating the missing ones), and how many were created."""
        batch = key_batch(t, ids, self._cluster)
        values = self._marks.read(t, batch, self._calls.fence(t.spec.name))
        if batch.order is not None:
            ids = ids[batch.order]  # work in key order, restore the caller's at the end
        missing = [k for k, value in enumerate(values) if value is None]
        created = 0
        if missing:
            self._check_not_lost(t, ids[torch.tensor(missing)], "a read")
            # Created in the server's layout: a weights-only view must not make short rows.
            fresh = to_blobs(t.server.initial_rows(ids[torch.tensor(missing)]))
            won = set_nx(self._client, batch, missing, fresh)
            lost = []
            for k, blob, ok in zip(missing, fresh, won, strict=True):
                if ok:
                    values[k] = blob
                    created += 1
                else:
                    lost.append(k)
            if lost:  # another writer created (or put) these first: theirs is the value
                again = self._mget_in_order(t, ids[torch.tensor(lost)])
                for k, value in zip(lost, again, strict=True):
                    if value is None:
                        raise RuntimeError(
                            f"table {t.spec.name!r}: row {int(ids[k])} was deleted on the "
                            f"server while being created"
                        )
                    values[k] = value
        rows = from_blobs(values, t)
        if batch.order is None:
            return rows, created
        out = torch.empty_like(rows)
        out[batch.order] = rows
        return out, created

    def _read_chunk(self, t: TableLayout, ids: torch.Tensor) -> torch.Tensor:
        """Rows of one chunk of ids, initial values where the server has none."""
        found, rows = self._fetch_existing(t, ids)
        if found.numel() == ids.numel():
            return rows
        present = torch.isin(ids, found)  # found and rows keep the order of ``ids``
        self._check_not_lost(t, ids[~present], "a read")
        out = torch.empty(ids.numel(), t.spec.stored_width, dtype=t.spec.dtype)
        out[present] = rows
        out[~present] = t.spec.initial_rows(ids[~present])
        return out

    def _fetch_existing(
        self, t: TableLayout, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids found, their rows)`` of ``ids``, in their order, skipping rows not there."""
        values = self._mget_in_order(t, ids)
        present = [k for k, value in enumerate(values) if value is not None]
        rows = from_blobs([values[k] for k in present], t)
        return ids[torch.tensor(present, dtype=torch.int64)], rows

    def _put_keeping_state(self, t: TableLayout, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write a view's rows (a weights-only client's) with the state the server holds for
        them, fresh state where it holds none: the optimizer state survives a client that
        does not know it (one writer per table, so nothing writes between the read and the
        write)."""
        server = t.server
        values = self._mget_in_order(t, ids)
        state = torch.full((ids.numel(), server.state_dim), float(server.state_init))
        present = [k for k, value in enumerate(values) if value is not None]
        if present:
            _, kept = server.unpack(decode_blobs([values[k] for k in present], server))
            state[torch.tensor(present, dtype=torch.int64)] = kept
        weights, _ = t.spec.unpack(rows)
        self._put_blobs(t, ids, to_blobs(server.pack(weights, state)))
