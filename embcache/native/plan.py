"""Typed entry points to the compiled passes of a cache's plan (`plan_kernels`) and of a batch's
dedup and grouping (`dedup_kernels`): numpy views in, the kernels' results out.

Some return what the kernels return, -1 or a position (the first bad key, the first slot not
locked), which the caller turns into its own error with its context; `group_by_table` returns
one of the ``GROUP_*`` outcomes. Only `embcache.backend`'s native family calls them, and only
where numba imports (the kernels' modules import it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

GROUP_SORTED = 0  # `group_by_table`: the ids were grouped already (``raw`` holds them)
GROUP_BY_COUNTS = 1  # grouped by a counting sort (``order``, ``raw`` in that order)
GROUP_NEEDS_SORT = 2  # neither: the caller sorts

_KERNELS: list = []  # [plan kernels' module, dedup kernels' module], filled on first use


def _plan() -> Any:
    if not _KERNELS:
        from embcache.native import dedup_kernels, plan_kernels

        _KERNELS.extend((plan_kernels, dedup_kernels))
    return _KERNELS[0]


def _dedup() -> Any:
    _plan()
    return _KERNELS[1]


def first_bad_key(keys: np.ndarray, fusion_k: int, limits: np.ndarray) -> int:
    """The position of the first int64 fused id of ``keys`` that is no row of tables of
    ``limits[t]`` raw ids each (0: no such table), or -1 (`HotCache.resolve`'s check)."""
    return _plan().first_bad_key(keys, fusion_k, limits)


def unlock(locks: np.ndarray, slots: np.ndarray) -> int:
    """One lock dropped from each of ``slots`` when all are in range and locked (else none):
    -1, or the position of the first that is not (`HotCache.unlock`)."""
    return _plan().unlock(locks, slots)


def unlock_dirty(locks: np.ndarray, dirty: np.ndarray, slots: np.ndarray) -> int:
    """`unlock`, each slot marked in ``dirty`` too (same length as ``locks``), one pass: -1, or
    the position of the first slot that is not locked (nothing changed then)."""
    return _plan().unlock_dirty(locks, dirty, slots)


def plan_lru(
    ids: np.ndarray,
    where: np.ndarray,
    row_offset: np.ndarray,
    fusion_k: int,
    scores: np.ndarray,
    locks: np.ndarray,
    batch_of: np.ndarray,
    num_slots: int,
    num_sets: int,
    ways: int,
    tick: int,
    batch_seq: int,
    slots: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A set-associative LRU cache's plan (`SetPlanner.plan_sets`): ``slots`` filled (hits; -1
    for misses), the hits locked, and ``(miss_pos, order, place)``: the misses' positions,
    their order by (set, shuffle) and each one's way in that order (-1: none free); three
    empty arrays when there is no miss (every slot locked and touched)."""
    return _plan().plan_lru(
        ids,
        where,
        row_offset,
        fusion_k,
        scores,
        locks,
        batch_of,
        num_slots,
        num_sets,
        ways,
        tick,
        batch_seq,
        slots,
    )


def plan_lfu(
    ids: np.ndarray,
    where: np.ndarray,
    row_offset: np.ndarray,
    fusion_k: int,
    counts: np.ndarray,
    count_offset: np.ndarray,
    scores: np.ndarray,
    locks: np.ndarray,
    batch_of: np.ndarray,
    num_sets: int,
    ways: int,
    tick: int,
    batch_seq: int,
    slots: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`plan_lru` for an LFU cache counted exactly (``counts[count_offset[t] + id]``): misses
    by (set, frequency descending, shuffle), a miss whose way holds a row scored no lower left
    to scratch (-1). No miss: every slot locked (`touch_lfu` does the rest)."""
    return _plan().plan_lfu(
        ids,
        where,
        row_offset,
        fusion_k,
        counts,
        count_offset,
        scores,
        locks,
        batch_of,
        num_sets,
        ways,
        tick,
        batch_seq,
        slots,
    )


def touch_lfu(
    ids: np.ndarray,
    slots: np.ndarray,
    counts: np.ndarray,
    count_offset: np.ndarray,
    fusion_k: int,
    scores: np.ndarray,
    num_slots: int,
) -> None:
    """One more request of each (distinct) id counted, each slot of the cache proper scored
    with its row's count (`SetPlanner.touch` for an LFU cache counted exactly)."""
    _plan().touch_lfu(ids, slots, counts, count_offset, fusion_k, scores, num_slots)


def scratch_done(
    slot_keys: np.ndarray,
    locks: np.ndarray,
    batch_of: np.ndarray,
    dirty: np.ndarray,
    num_slots: int,
    batch_seq: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scratch rows (slots from ``num_slots``) no batch holds any more, ascending, and the
    dirty ones' slots and keys (`HotCache.release`)."""
    return _plan().scratch_done(slot_keys, locks, batch_of, dirty, num_slots, batch_seq)


def free_slots(
    slots: np.ndarray,
    slot_keys: np.ndarray,
    dirty: np.ndarray,
    where: np.ndarray,
    row_offset: np.ndarray,
    fusion_k: int,
) -> None:
    """The rows held at ``slots`` leave the cache: row index entries cleared, slots empty and
    clean."""
    _plan().free_slots(slots, slot_keys, dirty, where, row_offset, fusion_k)


def reserve(
    ids: np.ndarray,
    slots: np.ndarray,
    miss_pos: np.ndarray,
    order: np.ndarray,
    place: np.ndarray,
    where: np.ndarray,
    row_offset: np.ndarray,
    fusion_k: int,
    slot_keys: np.ndarray,
    scores: np.ndarray,
    locks: np.ndarray,
    dirty: np.ndarray,
    num_slots: int,
    tick: int,
) -> tuple[np.ndarray, ...]:
    """Every miss given its planned slot, the victims recorded, the slots re-keyed and
    re-indexed, the batch locked and touched. Returns the misses' slots, the dirty victims'
    ids and slots, every evicted id, and each reserved slot's old key, score and dirty flag."""
    return _plan().reserve(
        ids,
        slots,
        miss_pos,
        order,
        place,
        where,
        row_offset,
        fusion_k,
        slot_keys,
        scores,
        locks,
        dirty,
        num_slots,
        tick,
    )


def unique_rows(
    ids: np.ndarray,
    row_offset: np.ndarray,
    fusion_k: int,
    bits: np.ndarray,
    word_rank: np.ndarray,
    row_starts: np.ndarray,
    row_tables: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``torch.unique(ids, sorted=True, return_inverse=True)`` for fused ids of bounded
    tables, through a bitmap over their rows (``bits``, all zero, left all zero) and a rank per
    word of it (`HotCache.unique_by_rows`)."""
    return _dedup().unique_rows(ids, row_offset, fusion_k, bits, word_rank, row_starts, row_tables)


def unique_values(
    values: np.ndarray,
    bounds: np.ndarray,
    bases: np.ndarray,
    limits: np.ndarray,
    fusion_k: int,
    bits: np.ndarray,
    word_rank: np.ndarray,
    row_starts: np.ndarray,
    row_tables: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, int]:
    """`unique_rows` of raw ids (feature ``f``'s values ``values[bounds[f] : bounds[f + 1]]``
    rows of the table starting at ``bases[f]``, valid below ``limits[f]``), checked in the
    same pass: ``(unique fused ids, inverse, -1)``, or two empty arrays and the first bad
    value's position (``len(values)``: bounds that do not cover the values)."""
    return _dedup().unique_values(
        values, bounds, bases, limits, fusion_k, bits, word_rank, row_starts, row_tables
    )


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
    return _dedup().group_by_table(fused, fusion_k, ascending, counts, order, raw)
