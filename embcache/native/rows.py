"""Typed entry points to the compiled row moves (`row_kernels`): a table's rows, a cache's slot
storage, the initialiser's rows, writes at positions, the TBE step's bag order.

Each takes numpy views (no copy) and raises `OutOfRangeError` where its kernel refuses positions
(nothing is written then) instead of returning a code for the caller to check. Their callers
hold an `embcache.backend.Backend` whose family is ``native`` (numba imports).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_KERNELS: list = []  # [the kernels' module], filled on first use


def _kernels() -> Any:
    """The kernels' module (numba compiles each function at its first call, or loads it from
    its disk cache)."""
    if not _KERNELS:
        from embcache.native import row_kernels

        _KERNELS.append(row_kernels)
    return _KERNELS[0]


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
    _kernels().hashed_uniform(ids, salt, mid, half, out)


def scatter_rows(dst: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
    """``dst[idx] = src`` for 2-D arrays of one dtype and int64 ``idx`` (in range, distinct)."""
    _kernels().scatter_rows(dst, idx, src)


def write_at(arr: np.ndarray, idx: np.ndarray, value: np.generic, *, add: bool) -> None:
    """``arr[idx] = value`` (``add``: ``+= value``, a repeated position added to once per
    occurrence) for 1-D ``arr`` and int64 ``idx``, every position checked first.

    Raises:
        OutOfRangeError: a position outside ``arr`` (nothing is written).
    """
    bad = _kernels().write_at(arr, idx, value, add)
    if bad >= 0:
        raise OutOfRangeError("index", int(idx[bad]), bad, arr.shape[0])


def scatter_split(
    weights: np.ndarray, state: np.ndarray, slots: np.ndarray, rows: np.ndarray
) -> None:
    """``weights[slots], state[slots] = rows[:, :dim], rows[:, dim:]`` for float32 arrays
    (a cache's copy-in of stored rows)."""
    _kernels().scatter_split(weights, state, slots, rows)


def gather_join(weights: np.ndarray, state: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    """``out = [weights[slots] | state[slots]]`` for float32 arrays (a cache's stored rows)."""
    _kernels().gather_join(weights, state, slots, out)


def gather_created(rows: np.ndarray, created: np.ndarray, ids: np.ndarray, out: np.ndarray) -> int:
    """``out = rows[ids]`` (same dtype), returning how many of ``ids`` are not ``created``
    (a dense tier table's read; ids in range)."""
    return _kernels().gather_created(rows, created, ids, out)


def scatter_created(
    rows: np.ndarray, created: np.ndarray, ids: np.ndarray, src: np.ndarray
) -> None:
    """``rows[ids] = src`` and ``created[ids] = True`` (a dense tier table's write; ids in
    range)."""
    _kernels().scatter_created(rows, created, ids, src)


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
    found = _kernels().gather_tables(tables, created, limits, ids, bounds, out)
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
    bad = _kernels().scatter_tables(tables, created, limits, ids, bounds, src)
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
    found = _kernels().gather_tables_into(
        tables, created, limits, ids, bounds, weights, state, slots
    )
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
    bad = _kernels().scatter_tables_from(
        tables, created, limits, ids, bounds, weights, state, slots
    )
    if bad >= 0:
        raise _bad_id_or_slot(limits, ids, bounds, slots, weights.shape[0], bad)


def bags_sample_major(
    slots: np.ndarray,
    inverse: np.ndarray,
    offsets: np.ndarray,
    batch_size: int,
    weights: np.ndarray,
    out: np.ndarray,
    out_offsets: np.ndarray,
    out_weights: np.ndarray,
) -> None:
    """A batch's values as slots (``out[k] = slots[inverse[i]]``) and weights, its bags moved
    from feature-major (``offsets[f * B + b]``) to sample-major order (bag ``b * F + f``)
    with their offsets ``[F * B + 1]`` (the TBE step's indices: `engine.tbe_step`),
    one pass. ``weights`` empty: unweighted (``out_weights`` is not written)."""
    _kernels().bags_sample_major(
        slots, inverse, offsets, batch_size, weights, out, out_offsets, out_weights
    )
