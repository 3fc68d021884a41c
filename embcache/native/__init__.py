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

* `first_bad_key`: the first fused id that is no row of a cache's tables (`HotCache.resolve`'s
  check, before the plan reads the row index unchecked);
* `hashed_uniform`: the default initialiser's rows of new ids (`kv.base.hashed_init`, whose
  torch ops build a 64-bit temporary per value, several times over);
* `scatter_rows`: ``dst[idx] = src`` along dim 0 (`indexing.copy_rows`); `write_at`: a
  value written or added at positions of a 1-D array (`indexing.fill_at`, `add_at`);
  `unlock`: a batch's locks dropped after checking them (`HotCache.unlock`), `unlock_dirty`
  its rows marked dirty in the same pass (`HotCache.unlock` with ``dirty``);
* `plan_lru`, `reserve`: a set-associative LRU cache's plan (`SetPlanner.plan_sets`): lookup
  through the row index, victim choice (`ops.plan.spec.assign_ways_ref` on the ways of the
  touched sets, misses ordered by set and the batch's shuffle) and the index changes that
  reserve the chosen ways; `plan_lfu`, `touch_lfu` the same for an LFU cache whose rows are
  counted exactly (misses by set, then most frequent first; a miss that would displace a row
  asked for as often goes to scratch; counts and scores updated after the reservation);
* `scratch_done`, `free_slots`: the scratch rows a `HotCache.release` writes back and frees,
  found in one pass, and freed (row index, keys, dirty flags) in another;
* `unique_rows`: a batch's sorted unique ids and inverse through a bitmap over its tables' rows,
  each id ranked by the marked bits before it (`HotCache.unique_by_rows`); `unique_values`
  the same from raw ids, checked against their tables in the same pass
  (`HotCache.unique_values`: `IdsOps.fuse_ids`, then the dedup);
* `group_by_table`: a tier transfer's ids grouped by table, by one pass when sorted and a
  counting sort otherwise (`TierTransfer._grouped`);
* `scatter_split`, `gather_join`: stored rows into a cache's weights and state, and out
  (`TierTransfer.copy_in`, `HotCache.rows_of`), one pass each instead of a copy per part;
* `gather_created`, `scatter_created`: a dense tier table's reads and writes with its
  ``created`` mask (`kv.host_tables.DenseTable`); `gather_tables`, `scatter_tables` the same
  over several tables in one call (`kv.host.HostKV.get_grouped`, `put_grouped`), and
  `gather_tables_into`, `scatter_tables_from` straight between those tables and a CPU cache's
  slots, with no rows array between (`HostKV.get_grouped_into`, `put_grouped_from`);
* `bags_sample_major`: each value's slot (and weight) with the bags in the TBE step's
  order, and their offsets (`engine.tbe_step`).

The kernels live in three modules by what they serve: `plan_kernels` (the cache's plan and
locks) and `dedup_kernels` (dedup, grouping), called through the typed functions of `plan`,
and `row_kernels` (row moves), called through those of `rows`, which raise `OutOfRangeError`
where a kernel refuses positions; `bits`, `prefetch` and `jit` are their shared helpers.

numba is imported on first use; `importable()` says whether it can be. The kernels release the
GIL (a prefetch thread's resolve overlaps the training thread) and are cached on disk after
their first compilation (``cache=True``); `on_compile` tells a caller when one compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from embcache.native.plan import (
    GROUP_BY_COUNTS,
    GROUP_NEEDS_SORT,
    GROUP_SORTED,
    first_bad_key,
    free_slots,
    group_by_table,
    plan_lfu,
    plan_lru,
    reserve,
    scratch_done,
    touch_lfu,
    unique_rows,
    unique_values,
    unlock,
    unlock_dirty,
)
from embcache.native.rows import (
    OutOfRangeError,
    array_list,
    bags_sample_major,
    gather_created,
    gather_join,
    gather_tables,
    gather_tables_into,
    hashed_uniform,
    scatter_created,
    scatter_rows,
    scatter_split,
    scatter_tables,
    scatter_tables_from,
    write_at,
)

__all__ = [
    "GROUP_BY_COUNTS",
    "GROUP_NEEDS_SORT",
    "GROUP_SORTED",
    "OutOfRangeError",
    "array_list",
    "bags_sample_major",
    "first_bad_key",
    "free_slots",
    "gather_created",
    "gather_join",
    "gather_tables",
    "gather_tables_into",
    "group_by_table",
    "hashed_uniform",
    "importable",
    "on_compile",
    "plan_lfu",
    "plan_lru",
    "reserve",
    "scatter_created",
    "scatter_rows",
    "scatter_split",
    "scatter_tables",
    "scatter_tables_from",
    "scratch_done",
    "touch_lfu",
    "unique_rows",
    "unique_values",
    "unlock",
    "unlock_dirty",
    "write_at",
]

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
