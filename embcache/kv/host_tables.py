"""The three ways `HostKV` lays out a table in host memory, behind one interface.

* `DenseTable` (``num_embeddings`` given, no capacity): a dense ``[N, stored_width]`` array of
  the table's dtype, allocated on first touch in huge pages (`embcache.hostmem`: pages never
  written cost nothing, 2 MiB at a time), plus a bool ``created`` mask;
* `HashTable` (``num_embeddings is None``, no capacity, any non-negative int64 id): a
  `HashIndex` from id to row position, and a growable row array in insertion order;
* `BoundedTable` (a ``capacity``): a `BoundedIndex` of at most ``capacity`` ids and one row
  array of that size, allocated on first touch; new rows evict the unpinned rows of lowest
  score of their bucket.

Every layout creates a row on first touch with ``spec.initial_rows`` (one vectorised call per
batch of missing ids, run before anything changes, so an init that raises changes nothing).
The `HostKV` lock is held around every call.

A dense table chooses its row moves once, when declared (`DenseTable.compiled`): the compiled
passes of `embcache.native` (float32 rows, the ``native`` backend of `embcache.backend`), or
torch ops. A read that finds rows never created creates them within the same implementation; it does
not try another.
"""

from __future__ import annotations

import torch

import embcache.native as native
from embcache.backend import cpu_backend
from embcache.hostmem import host_zeros
from embcache.indexing import copy_rows, fill_at, select, true_at
from embcache.kv.base import TableSpec, host_memory_bytes
from embcache.kv.bounded import BoundedIndex
from embcache.kv.hash_index import HashIndex, next_pow2

_MIN_ROWS = 64
_NO_POSITIONS = torch.empty(0, dtype=torch.int64)


def empty_rows(spec: TableSpec, n: int, pin_memory: bool) -> torch.Tensor:
    """Uninitialised stored rows ``[n, stored_width]`` of ``spec.dtype`` (pinned memory when
    ``pin_memory``), for a call to fill and return."""
    return torch.empty(n, spec.stored_width, dtype=spec.dtype, pin_memory=pin_memory)


def check_dense_fits(spec: TableSpec) -> None:
    """A bounded table is one dense array, allocated at its first write (pages committed as
    rows are touched): refuse, before allocating, one larger than this machine's memory, which
    the allocator would refuse with a raw error (declaring it allocates nothing, so a model on
    the meta device may declare any size)."""
    if spec.num_embeddings is None or spec.capacity is not None:
        return
    need = spec.num_embeddings * (spec.row_bytes + 1)  # rows and the `created` mask
    have = host_memory_bytes()
    if need > have:
        raise ValueError(
            f"table {spec.name!r}: {spec.num_embeddings:,} rows of {spec.row_bytes} bytes "
            f"need {need:,} bytes as a dense host array, more than this machine's {have:,}; "
            "use num_embeddings=None (hashed ids: memory grows with the rows touched), a tier "
            "capacity (CacheConfig(tier_capacity=...)) or a Redis tier"
        )


def _widened(
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


class DenseTable:
    """A table of ``num_embeddings`` rows: row ``i`` of a dense array holds id ``i``.

    ``compiled``: its rows move through the compiled passes (`native.gather_created`,
    `scatter_created`, and `HostKV`'s grouped passes over several tables), chosen at
    declaration: float32 rows (numba has no half-precision type) under a backend that runs
    them (`embcache.backend.cpu_backend`, which raises on a backend name that is none of the
    choices).
    """

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.compiled = spec.dtype == torch.float32 and cpu_backend().compiled
        self.rows: torch.Tensor | None = None  # [N, stored_width], allocated on first touch
        self.created: torch.Tensor | None = None  # [N] bool

    def allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's rows and ``created`` mask, allocated at the first call."""
        if self.rows is None or self.created is None:
            n = self.spec.num_embeddings
            assert n is not None
            check_dense_fits(self.spec)  # a clear error, not the allocator's
            # Rows are read at random: huge pages spare the TLB (`embcache.hostmem`).
            self.rows = host_zeros((n, self.spec.stored_width), self.spec.dtype)
            self.created = torch.zeros(n, dtype=torch.bool)
        return self.rows, self.created

    def get(self, ids: torch.Tensor, out: torch.Tensor, pin: bool) -> int:
        """Gather rows of ``ids`` into ``out``, creating missing ones; returns rows created."""
        del pin  # nothing is evicted here
        if self.compiled:
            # One pass gathers the rows and counts those never created: at steady state none.
            if self.rows is not None and self.created is not None:
                absent = native.gather_created(
                    self.rows.numpy(), self.created.numpy(), ids.numpy(), out.numpy()
                )
                if not absent:
                    return 0
            return self.create_missing(ids, out)
        missing = ids if self.created is None else select(ids, ~self.created.index_select(0, ids))
        fresh = self.spec.initial_rows(missing) if missing.numel() else None
        rows, created = self.allocate()
        if fresh is not None:
            copy_rows(rows, missing, fresh)
            fill_at(created, missing, True)
        torch.index_select(rows, 0, ids, out=out)
        return missing.numel()

    def create_missing(self, ids: torch.Tensor, out: torch.Tensor) -> int:
        """Create the rows of ``ids`` never created and write them into ``out`` (``[n,
        stored_width]``, the rows of the others gathered already, as a compiled read leaves
        it); returns how many were created (a repeated id counted each time)."""
        if self.created is None:  # nothing allocated yet: every row is new
            fresh = self.spec.initial_rows(ids)  # before anything changes: it may raise
            self.put(ids, fresh.contiguous())
            out.copy_(fresh)
            return ids.numel()
        at = true_at(~self.created.index_select(0, ids))
        if not at.numel():
            return 0
        missing = ids.index_select(0, at)
        fresh = self.spec.initial_rows(missing)
        self.put(missing, fresh.contiguous())
        copy_rows(out, at, fresh)
        return missing.numel()

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Rows of ``ids`` into ``out``, initial values for rows never created (not stored)."""
        if self.rows is None or self.created is None:
            out.copy_(self.spec.initial_rows(ids))
            return
        torch.index_select(self.rows, 0, ids, out=out)
        absent = ~self.created[ids]
        if bool(absent.any()):
            out[absent] = self.spec.initial_rows(ids[absent])

    def put(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        rows, created = self.allocate()
        if self.compiled:
            native.scatter_created(rows.numpy(), created.numpy(), ids.numpy(), values.numpy())
            return
        copy_rows(rows, ids, values)
        fill_at(created, ids, True)

    def existing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids ascending, positions of their rows)`` of the rows created so far."""
        if self.created is None:
            return _NO_POSITIONS, _NO_POSITIONS
        ids = self.created.nonzero().flatten()
        return ids, ids

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        assert self.rows is not None
        return self.rows.index_select(0, positions)

    def remove(self, ids: torch.Tensor) -> None:
        if self.created is not None:
            self.created[ids] = False

    def __len__(self) -> int:
        return 0 if self.created is None else int(self.created.sum())

    def redeclare(self, spec: TableSpec) -> None:
        """Adopt ``spec`` (same dim and num_embeddings); reset state columns if they changed."""
        if self.rows is not None and spec.state_dim != self.spec.state_dim:
            check_dense_fits(spec)  # the array is allocated again, wider
        old, self.spec = self.spec, spec
        if self.rows is None or self.created is None:
            return
        if (old.state_dim, old.state_init) != (spec.state_dim, spec.state_init):
            # Only the created rows: a whole-array copy would touch every page.
            self.rows = _widened(spec, old, self.rows, self.created.nonzero().flatten())

    def nbytes(self) -> int:
        if self.rows is None or self.created is None:
            return 0
        return self.rows.nbytes + self.created.nbytes


class HashTable:
    """An unbounded table: a `HashIndex` from id to row, rows in insertion order."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
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
        copy_rows(self.rows, positions, values)

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
            self.rows = _widened(spec, old, self.rows, torch.arange(self.count))

    def nbytes(self) -> int:
        return self.rows.nbytes + self.row_ids.nbytes + self.index.nbytes


class BoundedTable:
    """A table of at most ``spec.capacity`` rows: a `BoundedIndex` and its rows.

    ``tier_evictions`` counts the rows evicted to make room.
    """

    def __init__(self, spec: TableSpec) -> None:
        assert spec.capacity is not None
        self.spec = spec
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
        copy_rows(self._rows(), positions, values)
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
            self.rows = _widened(spec, old, self.rows, self.index.items()[1])

    def nbytes(self) -> int:
        rows = 0 if self.rows is None else self.rows.nbytes
        return rows + self.index.nbytes


Table = DenseTable | HashTable | BoundedTable


def make_table(spec: TableSpec) -> Table:
    """The layout for ``spec``: bounded by a capacity, dense, or hashed."""
    if spec.capacity is not None:
        return BoundedTable(spec)
    return DenseTable(spec) if spec.num_embeddings is not None else HashTable(spec)
