"""The two layouts of a `HostKV` table found through an index (`host_tables` has the dense one
and chooses among the three, `make_table`):

* `HashTable` (``num_embeddings is None``, no capacity, any non-negative int64 id): a
  `HashIndex` from id to row position, and a growable row array in insertion order;
* `BoundedTable` (a ``capacity``): a `BoundedIndex` of at most ``capacity`` ids and one row
  array of that size, allocated on first touch; new rows evict the unpinned rows of lowest
  score of their bucket.

Both create a row on first touch with ``spec.initial_rows`` (one vectorised call per batch of
missing ids, run before anything changes, so an init that raises changes nothing) and write
rows through the rows family bound for the CPU (``moves``: `RowsOps.copy_rows`). The `HostKV`
lock is held around every call. `widened` re-lays any layout's rows for a new state layout.
"""

from __future__ import annotations

import torch

from embcache.kv.base import TableSpec
from embcache.kv.bounded import BoundedIndex
from embcache.kv.hash_index import HashIndex, next_pow2
from embcache.ops.registry import ops_for

_MIN_ROWS = 64


def widened(
    spec: TableSpec, old: TableSpec, rows: torch.Tensor, live: torch.Tensor
) -> torch.Tensor:
    """``rows`` re-laid for ``spec``'s state layout: weights of the ``live`` positions kept,
    their state columns reset to ``spec.state_init`` (the others left unset)."""
    if spec.state_dim != old.state_dim:
        wider = torch.empty(rows.shape[0], spec.stored_width, dtype=spec.dtype)
        wider[live, : spec.dim] = rows[live, : spec.dim]
        rows = wider
    rows[live, spec.dim :] = spec.state_fill()
    return rows


class HashTable:
    """An unbounded table: a `HashIndex` from id to row, rows in insertion order."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.moves = ops_for("cpu").rows  # rows written at positions
        self.index = HashIndex()
        self.count = 0
        self.rows = torch.empty(0, spec.stored_width, dtype=spec.dtype)
        self.row_ids = torch.empty(0, dtype=torch.int64)  # id of each row (-1: removed)

    def _locate(self, ids: torch.Tensor, init: bool) -> tuple[torch.Tensor, int]:
        """Row position of each id, appending rows for new ids; returns (positions, created).

        New rows are filled by the initialiser when ``init``, else left for the caller to write.
        """
        positions = self.index.find(ids)
        absent = positions < 0
        if not bool(absent.any()):
            return positions, 0
        new_ids, inverse = torch.unique(ids[absent], return_inverse=True)
        fresh = self.spec.initial_rows(new_ids) if init else None
        n_new = new_ids.numel()
        self._reserve(self.count + n_new)
        new_positions = torch.arange(self.count, self.count + n_new)
        self.index.insert(new_ids, new_positions)
        self.row_ids[self.count : self.count + n_new] = new_ids
        if fresh is not None:
            self.rows[self.count : self.count + n_new] = fresh
        self.count += n_new
        positions[absent] = new_positions[inverse]
        return positions, n_new

    def _reserve(self, n: int) -> None:
        if n <= self.rows.shape[0]:
            return
        capacity = max(_MIN_ROWS, next_pow2(n))
        rows = torch.empty(capacity, self.spec.stored_width, dtype=self.spec.dtype)
        rows[: self.count] = self.rows[: self.count]
        row_ids = torch.empty(capacity, dtype=torch.int64)
        row_ids[: self.count] = self.row_ids[: self.count]
        self.rows, self.row_ids = rows, row_ids

    def get(self, ids: torch.Tensor, out: torch.Tensor, pin: bool) -> int:
        del pin  # nothing is evicted here
        positions, created = self._locate(ids, init=True)
        torch.index_select(self.rows, 0, positions, out=out)
        return created

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        positions = self.index.find(ids)
        present = positions >= 0
        out[present] = self.rows[positions[present]]
        if not bool(present.all()):
            out[~present] = self.spec.initial_rows(ids[~present])

    def put(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        positions, _ = self._locate(ids, init=False)
        self.moves.copy_rows(self.rows, positions, values)

    def existing(self) -> tuple[torch.Tensor, torch.Tensor]:
        row_ids = self.row_ids[: self.count]
        live = (row_ids >= 0).nonzero().flatten()
        ids, order = torch.sort(row_ids[live])
        return ids, live[order]

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        return self.rows.index_select(0, positions)

    def remove(self, ids: torch.Tensor) -> None:
        """Forget ``ids`` (their rows' space is not reused: an unbounded table only grows)."""
        positions = self.index.find(ids)
        held = positions >= 0
        self.index.remove(ids[held])
        self.row_ids[positions[held]] = -1

    def __len__(self) -> int:
        return len(self.index)

    def redeclare(self, spec: TableSpec) -> None:
        old, self.spec = self.spec, spec
        if (old.state_dim, old.state_init) != (spec.state_dim, spec.state_init):
            self.rows = widened(spec, old, self.rows, torch.arange(self.count))

    def nbytes(self) -> int:
        return self.rows.nbytes + self.row_ids.nbytes + self.index.nbytes


class BoundedTable:
    """A table of at most ``spec.capacity`` rows: a `BoundedIndex` and its rows.

    ``tier_evictions`` counts the rows evicted to make room.
    """

    def __init__(self, spec: TableSpec) -> None:
        assert spec.capacity is not None
        self.spec = spec
        self.moves = ops_for("cpu").rows  # rows written at positions
        self.index = BoundedIndex(spec.capacity, spec.score)
        self.rows: torch.Tensor | None = None  # [positions, stored_width], on first touch
        self.evictions = 0

    def _rows(self) -> torch.Tensor:
        if self.rows is None:
            size = self.index.capacity
            self.rows = torch.empty(size, self.spec.stored_width, dtype=self.spec.dtype)
        return self.rows

    def _locate(self, ids: torch.Tensor, init: bool) -> tuple[torch.Tensor, int]:
        """Positions of ``ids``, inserting the absent ones once each (an id given twice gets
        one row), filled by the initialiser when ``init``, else left for the caller; returns
        (positions, created)."""
        positions = self.index.find(ids)
        absent = positions < 0
        if not bool(absent.any()):
            return positions, 0
        new, inverse = torch.unique(ids[absent], return_inverse=True)
        fresh = self.spec.initial_rows(new) if init else None
        new_positions, evicted = self.index.insert(new, positions[~absent])
        self.evictions += evicted.numel()
        positions[absent] = new_positions[inverse]
        if fresh is not None:
            self._rows()[new_positions] = fresh
        return positions, new.numel()

    def get(self, ids: torch.Tensor, out: torch.Tensor, pin: bool) -> int:
        positions, created = self._locate(ids, init=True)
        if pin:
            self.index.pin(positions)
        else:
            self.index.touch(positions)
        torch.index_select(self._rows(), 0, positions, out=out)
        return created

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        positions = self.index.find(ids)
        present = positions >= 0
        if self.rows is not None:
            out[present] = self.rows[positions[present]]
        if not bool(present.all()):
            out[~present] = self.spec.initial_rows(ids[~present])

    def put(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        positions, _ = self._locate(ids, init=False)
        self.moves.copy_rows(self._rows(), positions, values)
        # A pinned row's reader is writing it back: its use is counted when it lets go.
        unpinned = positions[self.index.pins[positions] == 0]
        self.index.touch(unpinned)

    def import_scores(self, ids: torch.Tensor, scores: torch.Tensor) -> None:
        self.index.set_scores(self.index.find(ids), scores)

    def scores(self, positions: torch.Tensor) -> torch.Tensor:
        return self.index.scores[positions]

    def pin_existing(self, ids: torch.Tensor) -> None:
        """Pin the rows of ``ids`` that exist (a read that creates none)."""
        positions = self.index.find(ids)
        self.index.pin(positions[positions >= 0])

    def unpin(self, ids: torch.Tensor) -> None:
        positions = self.index.find(ids)
        self.index.unpin(positions[positions >= 0])

    def remove(self, ids: torch.Tensor) -> None:
        positions = self.index.find(ids)
        self.index.remove(positions[positions >= 0])

    def existing(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.index.items()

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        return self._rows().index_select(0, positions)

    def __len__(self) -> int:
        return len(self.index)

    def redeclare(self, spec: TableSpec) -> None:
        old, self.spec = self.spec, spec
        if self.rows is not None and (old.state_dim, old.state_init) != (
            spec.state_dim,
            spec.state_init,
        ):
            self.rows = widened(spec, old, self.rows, self.index.items()[1])

    def nbytes(self) -> int:
        rows = 0 if self.rows is None else self.rows.nbytes
        return rows + self.index.nbytes
