"""Compiled CPU kernels (numba) for the cache's per-batch bookkeeping on a CPU.

A CPU resolve is a few thousand row moves and a few passes over the batch's ids. Written as
torch ops it is 100-150 calls, each with its own dispatch, allocation and pass over memory, and
those calls cost more than the embedding work itself (FBGEMM's fused TBE). Here the same steps
are loops compiled by numba, over numpy views of the cache's own tensors (no copy): one pass
where the torch path makes several.

Each kernel computes exactly what the torch path beside it computes (the specification, run
under ``EMBCACHE_BACKEND=torch``, on a GPU, and wherever numba cannot be imported):

* `first_bad_key`: the first fused id that is no row of a cache's tables (`HotCache.resolve`'s
  check, before the plan reads the row index unchecked);
* `hashed_uniform`: the default initialiser's rows of new ids (`kv.base.hashed_init`, whose
  torch ops build a 64-bit temporary per value, several times over);
* `scatter_rows`: ``dst[idx] = src`` along dim 0 (`indexing.copy_rows`); `write_at`: a
  value written or added at positions of a 1-D array (`indexing.fill_at`, `add_at`);
  `unlock`: a batch's locks dropped after checking them (`HotCache.unlock`), `unlock_dirty`
  its rows marked dirty in the same pass (`HotCache.unlock` with ``dirty``);
* `plan_lru`, `reserve`: a set-associative LRU cache's plan (`HotCache._plan_sets`): lookup
  through the row index, victim choice (`cache_index_ref.assign_ways_ref` on the ways of the
  touched sets, misses ordered by set and the batch's shuffle) and the index changes that
  reserve the chosen ways; `plan_lfu`, `touch_lfu` the same for an LFU cache whose rows are
  counted exactly (misses by set, then most frequent first; a miss that would displace a row
  asked for as often goes to scratch; counts and scores updated after the reservation);
* `scratch_done`, `free_slots`: the scratch rows a `HotCache.release` writes back and frees,
  found in one pass, and freed (row index, keys, dirty flags) in another;
* `unique_rows`: a batch's sorted unique ids and inverse through a bitmap over its tables' rows,
  each id ranked by the marked bits before it (`HotCache.unique_by_rows`); `unique_values`
  the same from raw ids, checked against their tables in the same pass
  (`HotCache.unique_values`: `kernels.ids.fuse_ids`, then the dedup);
* `group_by_table`: a tier transfer's ids grouped by table, by one pass when sorted and a
  counting sort otherwise (`TierTransfer._grouped`);
* `scatter_split`, `gather_join`: stored rows into a cache's weights and state, and out
  (`TierTransfer.copy_in`, `HotCache.rows_of`), one pass each instead of a copy per part;
* `gather_created`, `scatter_created`: a dense tier table's reads and writes with its
  ``created`` mask (`kv.host_tables.DenseTable`); `gather_tables`, `scatter_tables` the same
  over several tables in one call (`kv.host.HostKV.get_grouped`, `put_grouped`), and
  `gather_tables_into`, `scatter_tables_from` straight between those tables and a CPU cache's
  slots, with no rows array between (`HostKV.get_grouped_into`, `put_grouped_from`);
* `bags_sample_major`: each value's slot (and weight) with the bags in the fused CPU step's
  order, and their offsets (`engine.fused_cpu`).

numba is imported on first use; `available()` says whether it can be. The kernels release the
GIL (a prefetch thread's resolve overlaps the training thread) and are cached on disk after
their first compilation (``cache=True``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

_NUMBA: list = []  # [njit or None], filled on first use


def _njit() -> Any | None:
    if not _NUMBA:
        try:
            from numba import njit
        except Exception:  # absent (the GPU image), or a build that does not load here
            njit = None
        _NUMBA.append(njit)
    return _NUMBA[0]


def available() -> bool:
    """Whether the compiled kernels run: numba imports, and ``EMBCACHE_BACKEND`` is ``auto``
    (``torch`` asks for the torch path, the specification; read at every call)."""
    name = os.environ.get("EMBCACHE_BACKEND", "auto").strip().lower() or "auto"
    return name == "auto" and _njit() is not None


def _kernels() -> Any:
    """The kernels' module (numba compiles each function at its first call, or loads it from
    its disk cache)."""
    assert _njit() is not None, "native kernels asked for without numba (check available())"
    from embcache.native import kernels

    return kernels


def hashed_uniform(ids: np.ndarray, salt: int, mid: float, half: float, out: np.ndarray) -> None:
    """The hashed uniform initialiser's float32 rows of int64 ``ids`` (>= 0) into ``out``
    ``[n, dim]`` (`kv.base.hashed_init`, the same bits as its torch ops)."""
    _kernels().hashed_uniform(ids, salt, mid, half, out)


def scatter_rows(dst: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
    """``dst[idx] = src`` for 2-D arrays of one dtype and int64 ``idx`` (in range, distinct)."""
    _kernels().scatter_rows(dst, idx, src)


def first_bad_key(keys: np.ndarray, fusion_k: int, limits: np.ndarray) -> int:
    """The position of the first int64 fused id of ``keys`` that is no row of tables of
    ``limits[t]`` raw ids each (0: no such table), or -1 (`HotCache.resolve`'s check)."""
    return _kernels().first_bad_key(keys, fusion_k, limits)


def write_at(arr: np.ndarray, idx: np.ndarray, value: Any, add: bool) -> int:
    """``arr[idx] = value`` (``add``: ``+= value``) for 1-D ``arr`` and int64 ``idx``, every
    position checked first: -1, or the position of the first one out of range (nothing is
    written then)."""
    return _kernels().write_at(arr, idx, value, add)


def unlock(locks: np.ndarray, slots: np.ndarray) -> int:
    """One lock dropped from each of ``slots`` when all are in range and locked (else none):
    -1, or the position of the first that is not (`HotCache.unlock`)."""
    return _kernels().unlock(locks, slots)


def unlock_dirty(locks: np.ndarray, dirty: np.ndarray, slots: np.ndarray) -> int:
    """`unlock`, each slot marked in ``dirty`` too (same length as ``locks``), one pass: -1, or
    the position of the first slot that is not locked (nothing changed then)."""
    return _kernels().unlock_dirty(locks, dirty, slots)


def plan_lru(*args: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """See the kernel of this name in `native.kernels` (numpy arrays and ints)."""
    return _kernels().plan_lru(*args)


def plan_lfu(*args: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """See the kernel of this name in `native.kernels` (numpy arrays and ints)."""
    return _kernels().plan_lfu(*args)


def touch_lfu(*args: Any) -> None:
    """See the kernel of this name in `native.kernels` (numpy arrays and ints)."""
    _kernels().touch_lfu(*args)


def scratch_done(*args: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """See the kernel of this name in `native.kernels` (numpy arrays and ints)."""
    return _kernels().scratch_done(*args)


def free_slots(*args: Any) -> None:
    """See the kernel of this name in `native.kernels` (numpy arrays and ints)."""
    _kernels().free_slots(*args)


def reserve(*args: Any) -> tuple[np.ndarray, ...]:
    """See the kernel of this name in `native.kernels` (numpy arrays and ints)."""
    return _kernels().reserve(*args)


def unique_rows(*args: Any) -> tuple[np.ndarray, np.ndarray]:
    """See the kernel of this name in `native.kernels` (numpy arrays and ints)."""
    return _kernels().unique_rows(*args)


def unique_values(*args: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """See the kernel of this name in `native.kernels` (numpy arrays and ints)."""
    return _kernels().unique_values(*args)


def group_by_table(*args: Any) -> int:
    """See the kernel of this name in `native.kernels` (numpy arrays and ints)."""
    return _kernels().group_by_table(*args)


def scatter_split(*args: np.ndarray) -> None:
    """``weights[slots], state[slots] = rows[:, :dim], rows[:, dim:]`` for float32 arrays
    (a cache's copy-in of stored rows)."""
    return _kernels().scatter_split(*args)


def gather_join(*args: np.ndarray) -> None:
    """``out = [weights[slots] | state[slots]]`` for float32 arrays (a cache's stored rows)."""
    return _kernels().gather_join(*args)


def gather_created(*args: np.ndarray) -> int:
    """``out = rows[ids]`` (same dtype), returning how many of ``ids`` are not ``created``
    (a dense tier table's read)."""
    return _kernels().gather_created(*args)


def scatter_created(*args: np.ndarray) -> None:
    """``rows[ids] = src`` and ``created[ids] = True`` (a dense tier table's write)."""
    return _kernels().scatter_created(*args)


def array_list(arrays: list[np.ndarray]) -> Any:
    """``arrays`` (of one dtype, rank and layout) as a list the kernels can take (numba's typed
    list: building one costs about 2 us an array, so callers keep it while the arrays live)."""
    from numba import typed

    return typed.List(arrays)


def gather_tables(*args: Any) -> int:
    """See the kernel of this name in `native.kernels` (typed lists, numpy arrays)."""
    return _kernels().gather_tables(*args)


def scatter_tables(*args: Any) -> int:
    """See the kernel of this name in `native.kernels` (typed lists, numpy arrays)."""
    return _kernels().scatter_tables(*args)


def gather_tables_into(*args: Any) -> int:
    """See the kernel of this name in `native.kernels` (typed lists, numpy arrays)."""
    return _kernels().gather_tables_into(*args)


def scatter_tables_from(*args: Any) -> int:
    """See the kernel of this name in `native.kernels` (typed lists, numpy arrays)."""
    return _kernels().scatter_tables_from(*args)


def bags_sample_major(*args: np.ndarray | int) -> None:
    """A batch's values as slots (and weights), its bags moved to sample-major order with
    their offsets (the fused CPU step's indices: `engine.fused_cpu`), one pass."""
    _kernels().bags_sample_major(*args)
