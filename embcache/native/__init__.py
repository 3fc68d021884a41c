"""Compiled CPU kernels (numba) for the cache's per-batch bookkeeping on a CPU.

A CPU resolve is a few thousand row moves and a few passes over the batch's ids. Written as
torch ops it is 100-150 calls, each with its own dispatch, allocation and pass over memory, and
those calls cost more than the embedding work itself (FBGEMM's TBE). Here the same steps
are loops compiled by numba, over numpy views of the cache's own tensors (no copy): one pass
where the torch path makes several.

Each kernel computes exactly what the torch path beside it computes (the specification, run
under the ``torch`` backend, on a GPU, and wherever numba cannot be imported). Which one runs
is `embcache.backend`'s choice (its ``native`` family): callers hold a `Backend` and ask it, or
the op families' implementations bound for it (`embcache.ops`: the ids and plan families'
``native.py`` are the only callers of their kernels here), never this module:

* `first_bad_key` (called by `ops.ids.native`): the first fused id that is no row of a
  cache's tables (`HotCache.resolve`'s check, before the plan reads the row index unchecked);
* `hashed_uniform`: the default initialiser's rows of new ids (`kv.base.hashed_init`, whose
  torch ops build a 64-bit temporary per value, several times over);
* `scatter_rows`: ``dst[idx] = src`` along dim 0 (`indexing.copy_rows`); `write_at`: a
  value written or added at positions of a 1-D array (`indexing.fill_at`, `add_at`);
  `unlock`: a batch's locks dropped after checking them (`HotCache.unlock`), `unlock_dirty`
  its rows marked dirty in the same pass (`HotCache.unlock` with ``dirty``);
* `plan_lru`, `reserve` (called by `ops.plan.native`): a set-associative LRU cache's plan
  (`SetPlanner.plan_sets`): lookup through the row index, victim choice
  (`ops.plan.spec.assign_ways_ref` on the ways of the touched sets, misses ordered by set and
  the batch's shuffle) and the index changes that reserve the chosen ways; `plan_lfu`,
  `touch_lfu` the same for an LFU cache whose rows are counted exactly (misses by set, then
  most frequent first; a miss that would displace a row asked for as often goes to scratch;
  counts and scores updated after the reservation);
* `scratch_done`, `free_slots` (called by `ops.plan.native`): the scratch rows a
  `HotCache.release` writes back and frees, found in one pass, and freed (row index, keys,
  dirty flags) in another;
* `unique_rows`, `unique_values` (called by `ops.ids.native`): a batch's sorted unique ids
  and inverse through a bitmap over its tables' rows, each id ranked by the marked bits
  before it (`HotCache.unique_by_rows`); `unique_values` the same from raw ids, checked
  against their tables in the same pass (`HotCache.unique_values`: `IdsOps.fuse_ids`, then
  the dedup);
* `group_by_table`: a tier transfer's ids grouped by table, by one pass when sorted and a
  counting sort otherwise (`TierTransfer._grouped`);
* `scatter_split`, `gather_join`: stored rows into a cache's weights and state, and out
  (`TierTransfer.copy_in`, `HotCache.rows_of`), one pass each instead of a copy per part;
* `gather_created`, `scatter_created`: a dense tier table's reads and writes with its
  ``created`` mask (`kv.host_tables.DenseTable`); `gather_tables`, `scatter_tables` the same
  over several tables in one call (`kv.host.HostKV.get_grouped`, `put_grouped`), and
  `gather_tables_into`, `scatter_tables_from` straight between those tables and a CPU cache's
  slots, with no rows array between (`HostKV.get_grouped_into`, `put_grouped_from`);
* `bags_sample_major` (called by `ops.ids.native`): each value's slot (and weight) with the
  bags in the TBE step's order, and their offsets (`IdsOps.bags_sample_major`).

For the others, this module is their typed entry points: numpy views in (no copy), the
kernels' results out. Some return what their kernel returns, -1 or a position (the first slot not
locked), which the caller turns into its own error with its context; `group_by_table` returns
one of the ``GROUP_*`` outcomes; the row moves raise `OutOfRangeError` where their kernel
refuses positions (nothing is written then). The kernels live in two modules by what they
serve, imported at the first call: `plan_kernels` (over a cache's rows: its plan, locks, key
check and bitmap dedup) and `row_kernels` (row moves, and the grouping of a tier transfer's
ids); `bits`, `prefetch` and `jit` are their shared helpers (`direct_kernels`, the direct
share's pass, stands apart).

The ids and plan families' compiled passes have no entry point here: `ops.ids.native` and
`ops.plan.native` call their kernels (`plan_kernels`, `row_kernels`, `direct_kernels`)
directly, so that a step's call of one goes from its family's implementation straight to
the kernel.

numba is imported on first use; `importable()` says whether it can be. The kernels release the
GIL (a prefetch thread's resolve overlaps the training thread) and are cached on disk after
their first compilation (``cache=True``); `on_compile` tells a caller when one compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

GROUP_SORTED = 0  # `group_by_table`: the ids were grouped already (``raw`` holds them)
GROUP_BY_COUNTS = 1  # grouped by a counting sort (``order``, ``raw`` in that order)
GROUP_NEEDS_SORT = 2  # neither: the caller sorts

# The kernels' modules, imported at the first call (numba compiles each function at its first
# call, or loads it from its disk cache): [plan_kernels, row_kernels].
_KERNELS: list = []


def _plan() -> Any:
    """`plan_kernels`, imported at the first call."""
    if not _KERNELS:
        from embcache.native import plan_kernels, row_kernels

        _KERNELS.extend((plan_kernels, row_kernels))
    return _KERNELS[0]


def _rows() -> Any:
    """`row_kernels`, imported at the first call."""
    _plan()
    return _KERNELS[1]


# ----------------------------------------------------------------------------------------------
# a cache's rows: the locks; the grouping of a tier transfer's ids
# ----------------------------------------------------------------------------------------------


def unlock(locks: np.ndarray, slots: np.ndarray) -> int:
    """One lock dropped from each of ``slots`` when all are in range and locked (else none):
    -1, or the position of the first that is not (`HotCache.unlock`)."""
    return _plan().unlock(locks, slots)


def unlock_dirty(locks: np.ndarray, dirty: np.ndarray, slots: np.ndarray) -> int:
    """`unlock`, each slot marked in ``dirty`` too (same length as ``locks``), one pass: -1, or
    the position of the first slot that is not locked (nothing changed then)."""
    return _plan().unlock_dirty(locks, dirty, slots)


def group_by_table(
    fused: np.ndarray,
    fusion_k: int,
    ascending: bool,
    counts: np.ndarray,
    order: np.ndarray,
    raw: np.ndarray,
) -> int:
    """Fused ids grouped by table (`TierTransfer._grouped`), ``counts`` (zero on entry) the ids
    of each table: `GROUP_SORTED` when sorted already (``raw`` the raw ids), `GROUP_BY_COUNTS`
    when grouped by a counting sort (``order``, ``raw`` in that order), `GROUP_NEEDS_SORT` when
    a sort is needed (``ascending``)."""
    return _rows().group_by_table(fused, fusion_k, ascending, counts, order, raw)


# ----------------------------------------------------------------------------------------------
# row moves: the tiers' tables, a cache's slot storage, the initialiser's rows, writes at
# positions
# ----------------------------------------------------------------------------------------------


class OutOfRangeError(IndexError):
    """A compiled pass was given a position out of its array's range and wrote nothing.

    Attributes:
        position: where in the positions given the first bad one is.
    """

    def __init__(self, what: str, value: int, position: int, size: int) -> None:
        super().__init__(
            f"{what} {value} at position {position} is out of bounds for dimension 0 with "
            f"size {size} (nothing was written)"
        )
        self.position = position


def hashed_uniform(ids: np.ndarray, salt: int, mid: float, half: float, out: np.ndarray) -> None:
    """The hashed uniform initialiser's float32 rows of int64 ``ids`` (>= 0) into ``out``
    ``[n, dim]`` (`kv.base.hashed_init`, the same bits as its torch ops)."""
    _rows().hashed_uniform(ids, salt, mid, half, out)


def scatter_rows(dst: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
    """``dst[idx] = src`` for 2-D arrays of one dtype and int64 ``idx`` (in range, distinct)."""
    _rows().scatter_rows(dst, idx, src)


def write_at(arr: np.ndarray, idx: np.ndarray, value: np.generic, *, add: bool) -> None:
    """``arr[idx] = value`` (``add``: ``+= value``, a repeated position added to once per
    occurrence) for 1-D ``arr`` and int64 ``idx``, every position checked first.

    Raises:
        OutOfRangeError: a position outside ``arr`` (nothing is written).
    """
    bad = _rows().write_at(arr, idx, value, add)
    if bad >= 0:
        raise OutOfRangeError("index", int(idx[bad]), bad, arr.shape[0])


def scatter_split(
    weights: np.ndarray, state: np.ndarray, slots: np.ndarray, rows: np.ndarray
) -> None:
    """``weights[slots], state[slots] = rows[:, :dim], rows[:, dim:]`` for float32 arrays
    (a cache's copy-in of stored rows)."""
    _rows().scatter_split(weights, state, slots, rows)


def gather_join(weights: np.ndarray, state: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    """``out = [weights[slots] | state[slots]]`` for float32 arrays (a cache's stored rows)."""
    _rows().gather_join(weights, state, slots, out)


def gather_created(rows: np.ndarray, created: np.ndarray, ids: np.ndarray, out: np.ndarray) -> int:
    """``out = rows[ids]`` (same dtype), returning how many of ``ids`` are not ``created``
    (a dense tier table's read; ids in range)."""
    return _rows().gather_created(rows, created, ids, out)


def scatter_created(
    rows: np.ndarray, created: np.ndarray, ids: np.ndarray, src: np.ndarray
) -> None:
    """``rows[ids] = src`` and ``created[ids] = True`` (a dense tier table's write; ids in
    range)."""
    _rows().scatter_created(rows, created, ids, src)


def array_list(arrays: list[np.ndarray]) -> Any:
    """``arrays`` (of one dtype, rank and layout) as a list the kernels can take (numba's typed
    list: building one costs about 2 us an array, so callers keep it while the arrays live)."""
    from numba import typed

    return typed.List(arrays)


def _bad_id(limits: np.ndarray, ids: np.ndarray, bounds: np.ndarray, at: int) -> OutOfRangeError:
    """The error for the kernels' first bad position ``at`` of a grouped call."""
    table = int(np.searchsorted(bounds, at, side="right")) - 1
    return OutOfRangeError(f"id of table {table}", int(ids[at]), at, int(limits[table]))


def gather_tables(
    tables: Any,
    created: Any,
    limits: np.ndarray,
    ids: np.ndarray,
    bounds: np.ndarray,
    out: np.ndarray,
) -> int:
    """`gather_created` over several dense tables in one pass: ids ``bounds[t] .. bounds[t +
    1]`` are rows of ``tables[t]`` (typed lists of `array_list`; ``created[t]`` its mask, ids
    valid below ``limits[t]``), gathered into ``out`` in order. Returns how many are not
    created (their rows are gathered as they stand).

    Raises:
        OutOfRangeError: an id out of its table's range (nothing is written).
    """
    found = _rows().gather_tables(tables, created, limits, ids, bounds, out)
    if found < 0:
        raise _bad_id(limits, ids, bounds, -1 - found)
    return found


def scatter_tables(
    tables: Any,
    created: Any,
    limits: np.ndarray,
    ids: np.ndarray,
    bounds: np.ndarray,
    src: np.ndarray,
) -> None:
    """`scatter_created` over several dense tables in one pass (ids as `gather_tables` takes
    them), every id checked first.

    Raises:
        OutOfRangeError: an id out of its table's range (nothing is written).
    """
    bad = _rows().scatter_tables(tables, created, limits, ids, bounds, src)
    if bad >= 0:
        raise _bad_id(limits, ids, bounds, bad)


def _bad_id_or_slot(
    limits: np.ndarray, ids: np.ndarray, bounds: np.ndarray, slots: np.ndarray, rows: int, at: int
) -> OutOfRangeError:
    table = int(np.searchsorted(bounds, at, side="right")) - 1
    if 0 <= ids[at] < limits[table]:
        return OutOfRangeError("slot", int(slots[at]), at, rows)
    return _bad_id(limits, ids, bounds, at)


def gather_tables_into(
    tables: Any,
    created: Any,
    limits: np.ndarray,
    ids: np.ndarray,
    bounds: np.ndarray,
    weights: np.ndarray,
    state: np.ndarray,
    slots: np.ndarray,
) -> int:
    """`gather_tables` straight into a cache's slot storage: the row of id ``i`` goes to
    ``weights[slots[i]]`` (its first ``dim`` values) and ``state[slots[i]]`` (the rest).
    Returns 0 when every row was moved, else how many rows are not created (and nothing is
    moved: every row must exist).

    Raises:
        OutOfRangeError: an id out of its table's range or a slot out of the storage (nothing is
            written).
    """
    found = _rows().gather_tables_into(tables, created, limits, ids, bounds, weights, state, slots)
    if found < 0:
        raise _bad_id_or_slot(limits, ids, bounds, slots, weights.shape[0], -1 - found)
    return found


def scatter_tables_from(
    tables: Any,
    created: Any,
    limits: np.ndarray,
    ids: np.ndarray,
    bounds: np.ndarray,
    weights: np.ndarray,
    state: np.ndarray,
    slots: np.ndarray,
) -> None:
    """`scatter_tables` straight out of a cache's slot storage: id ``i``'s row is
    ``weights[slots[i]]`` then ``state[slots[i]]``, every id and slot checked first.

    Raises:
        OutOfRangeError: an id out of its table's range or a slot out of the storage (nothing is
            written).
    """
    bad = _rows().scatter_tables_from(tables, created, limits, ids, bounds, weights, state, slots)
    if bad >= 0:
        raise _bad_id_or_slot(limits, ids, bounds, slots, weights.shape[0], bad)


# ----------------------------------------------------------------------------------------------
# numba: whether it imports here, and its compilations
# ----------------------------------------------------------------------------------------------


_NUMBA: list = []  # [njit or None], filled on first use


def _njit() -> Any | None:
    if not _NUMBA:
        try:
            from numba import njit
        except Exception:  # absent (the GPU image), or a build that does not load here
            njit = None
        _NUMBA.append(njit)
    return _NUMBA[0]


def importable() -> bool:
    """Whether numba imports here, so that the kernels can run (`embcache.backend` chooses
    whether they do)."""
    return _njit() is not None


def _is_ours(dispatcher: Any) -> bool:
    """Whether a numba dispatcher compiles one of embcache's kernels."""
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", None) or ""
    return module == "embcache" or module.startswith("embcache.")


@contextmanager
def on_compile(callback: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``callback()`` (on the compiling thread) as each compilation of one
    of embcache's kernels starts: a kernel's first use with no entry in the disk cache (a load
    from it is none). numba's own helpers, which it compiles afresh in every process (those
    of ``numba.typed.List``, uncached), are not embcache's kernels and call nothing.
    Without numba, never."""
    if _njit() is None:
        yield
        return
    from numba.core import event

    class _Started(event.Listener):
        def on_start(self, started: Any) -> None:
            if _is_ours(started.data.get("dispatcher")):
                callback()

        def on_end(self, _event: Any) -> None:
            pass

    listener = _Started()
    event.register("numba:compile", listener)
    try:
        yield
    finally:
        event.unregister("numba:compile", listener)
