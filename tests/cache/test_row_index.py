"""The row index of a set-associative cache on a CPU (`SlotStore.where`): the slot of every row
it holds, scratch included, kept in step with ``slot_keys`` through plans, releases, rollbacks,
invalidation and restored checkpoints, and choosing nothing: a cache without it (the lookup
through the sets) makes the same choices and counts the same on the same batches."""

from __future__ import annotations

import pytest
import torch

import embcache.cache.hot_cache as hot_cache_module
import embcache.native as native
from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.kernels.optim import OptimRule
from embcache.kv.base import TableSpec
from embcache.kv.host import HostKV
from embcache.ops.ids.row_map import IDS_PER_ROW_BITMAP, IDS_PER_ROW_MAP
from tests.cache.test_hot_cache import (
    DIM,
    FUSION_K,
    OFFSETS,
    SIZES,
    FlakyStore,
    make_cache,
    random_batch,
)

CPU = torch.device("cpu")
CONFIGS = {
    "tiny-scratch": CacheConfig(capacity=4, ways=2),
    "quarter": CacheConfig(capacity=24, ways=4),
    "lfu": CacheConfig(capacity=16, ways=4, policy="lfu"),
}


def _index_matches(cache) -> None:
    """Every held key's row points at its slot, and nothing else is indexed."""
    where = cache.slot_store.where
    assert where is not None, "a CPU cache of bounded tables keeps a row index"
    held = (cache.slot_keys >= 0).nonzero().squeeze(1)
    keys = cache.slot_keys[held]
    tables, raw = keys >> FUSION_K, keys & ((1 << FUSION_K) - 1)
    offsets = torch.tensor(list(OFFSETS.values()))
    rows = offsets[tables] + raw
    assert torch.equal(where[rows].long(), held)
    assert int((where >= 0).sum()) == held.numel()


def _run(cache, seed: int, steps: int = 12) -> list:
    """Resolve random batches (locked, then unlocked once stepped, as training does); returns
    what each resolve chose and counted."""
    gen = torch.Generator().manual_seed(seed)
    seen = []
    previous = None
    for step in range(steps):
        ids = torch.unique(random_batch(gen, 14))
        slots = cache.resolve(ids, lock=True)
        cache.mark_dirty(slots[: ids.numel() // 2])
        if previous is not None:
            cache.unlock(previous)
        previous = slots
        seen.append((slots.clone(), cache.slot_keys.clone(), dict(cache.cache_stats())))
        if cache.slot_store.where is not None:
            _index_matches(cache)
        if step % 5 == 4:
            cache.unlock(previous)
            previous = None
            cache.release()
    return seen


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_row_index_follows_every_change_and_chooses_nothing(monkeypatch, name: str) -> None:
    indexed, _, _ = make_cache(CONFIGS[name], OptimRule.SGD, CPU)
    with_index = _run(indexed, seed=3)
    monkeypatch.setattr(hot_cache_module, "ROW_INDEX_MAX_ROWS", 0)
    plain, _, _ = make_cache(CONFIGS[name], OptimRule.SGD, CPU)
    assert plain.slot_store.where is None
    without = _run(plain, seed=3)
    for step, (a, b) in enumerate(zip(with_index, without, strict=True)):
        assert torch.equal(a[0], b[0]), f"step {step}: slots differ"
        assert torch.equal(a[1], b[1]), f"step {step}: slot keys differ"
        assert a[2] == b[2], f"step {step}: counters differ"
    if name == "tiny-scratch":  # batches overflowed into the scratch area, indexed too
        assert any(bool(s[1][indexed.num_slots :].ge(0).any()) for s in with_index)


def test_a_failed_resolve_leaves_the_index_as_it_was() -> None:
    cache, store, _ = make_cache(CacheConfig(capacity=4, ways=2), OptimRule.SGD, CPU, FlakyStore())
    _run(cache, seed=5, steps=6)
    before = cache.slot_store.where.clone()
    store.down = True
    with pytest.raises(ConnectionError):
        cache.resolve(torch.arange(30, 50))  # evicts dirty rows: the write-back fails
    assert torch.equal(cache.slot_store.where, before)
    _index_matches(cache)
    store.down = False
    cache.resolve(torch.arange(30, 50), lock=False)
    _index_matches(cache)


def test_invalidate_and_a_restored_policy_state_rebuild_the_index() -> None:
    cache, _, _ = make_cache(CONFIGS["quarter"], OptimRule.SGD, CPU)
    _run(cache, seed=7, steps=5)
    cache.unlock(cache.resolve(torch.arange(3), lock=True))
    tensors, meta = cache.policy_state()
    tensors = {k: v.clone() for k, v in tensors.items()}  # as saved (on a CPU: the live tensors)
    cache.invalidate()
    assert int((cache.slot_store.where >= 0).sum()) == 0
    assert cache.load_policy_state(tensors, meta)
    _index_matches(cache)
    assert int((cache.slot_store.where >= 0).sum()) == int((cache.slot_keys >= 0).sum()) > 0


def test_no_index_for_unbounded_tables_or_a_direct_cache() -> None:
    unbounded, _, _ = make_cache(CONFIGS["quarter"], OptimRule.SGD, CPU, unbounded=True)
    assert unbounded.slot_store.where is None
    whole, _, _ = make_cache(CacheConfig(capacity=sum(SIZES.values())), OptimRule.SGD, CPU)
    assert whole.direct and whole.slot_store.where is None


def _four_tables() -> tuple[HotCache, dict[int, int]]:
    """A cache over four tables declared out of index order; their sizes by table index."""
    store = HostKV()
    specs = [
        (2, TableSpec("b", DIM, 40)),
        (0, TableSpec("a", DIM, 30)),
        (5, TableSpec("c", DIM, 27)),
        (3, TableSpec("d", DIM, 700)),
    ]
    for _, spec in specs:
        store.init_table(spec)
    cache = HotCache(specs, CacheConfig(capacity=16, ways=4), store, CPU, FUSION_K)
    return cache, {idx: spec.num_embeddings for idx, spec in specs}


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["compiled bitmap", "torch map"])
@pytest.mark.parametrize("n", [1, 2, 40, 97, 500, 4000])
def test_unique_by_rows_is_torch_unique(monkeypatch, n: int, backend: str) -> None:
    """A batch deduplicated through the map over its tables' rows gives exactly the sorted unique
    ids and inverse index of `torch.unique`, with tables declared out of index order (their
    rows then lie in index order), repeats, and each table's first and last rows; a table
    spans many 64-row words of the compiled path's bitmap."""
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    cache, sizes = _four_tables()
    gen = torch.Generator().manual_seed(n)
    tables = torch.tensor(list(sizes))[torch.randint(0, len(sizes), (n,), generator=gen)]
    limits = torch.tensor([sizes[int(t)] for t in tables])
    raw = (torch.rand(n, generator=gen) * limits).long()
    raw[:3], raw[3:6] = 0, limits[3:6] - 1
    ids = raw | (tables << FUSION_K)
    got = cache.unique_by_rows(ids)
    per_row = IDS_PER_ROW_BITMAP if cache.backend.compiled else IDS_PER_ROW_MAP
    if n * per_row < sum(sizes.values()):
        assert got is None  # too few ids for the map: the sort is cheaper
        return
    assert got is not None
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    assert torch.equal(got[0], unique)
    assert torch.equal(got[1], inverse)
    again = cache.unique_by_rows(ids[: n // 2 + 50])  # the map is cleared between batches
    assert again is not None and torch.equal(again[0], torch.unique(ids[: n // 2 + 50]))


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_the_compiled_dedup_ranks_every_bit_of_full_words_and_keeps_no_rank_per_row() -> None:
    """Every row of every table, shuffled and each seen three times: every bit of the bitmap's
    words between the first row and the last is set, bits 0 and 63 of words and the rows of
    tables whose first row falls inside a word included, and each id's rank (counted from the
    bits below it in its word) is still `torch.unique`'s inverse. The compiled path keeps a rank
    per 64-row word, never the 4-byte rank per row the torch path needs."""
    cache, sizes = _four_tables()
    ids = torch.cat([torch.arange(n) | (t << FUSION_K) for t, n in sizes.items()])
    gen = torch.Generator().manual_seed(7)
    batch = ids.repeat(3)[torch.randperm(3 * ids.numel(), generator=gen)]
    got = cache.unique_by_rows(batch)
    assert got is not None
    unique, inverse = torch.unique(batch, sorted=True, return_inverse=True)
    assert torch.equal(got[0], unique) and torch.equal(got[1], inverse)
    assert not bool(cache.dedup.row_bits.any()), "the bitmap is clear for the next batch"
    assert cache.dedup.row_rank is None and cache.dedup.row_map is None
    assert cache.dedup.word_rank.size == (sum(sizes.values()) + 63) // 64


def _raw_features(gen, sizes, feature_tables, per_feature):
    """Raw ids of features (one after another), each table's first and last rows among them,
    and the bounds of the features' values."""
    parts = []
    for t, n in zip(feature_tables, per_feature, strict=True):
        raw = torch.randint(0, sizes[t], (n,), generator=gen)
        if n >= 2:
            raw[0], raw[-1] = 0, sizes[t] - 1
        parts.append(raw)
    bounds = torch.tensor([0, *per_feature]).cumsum(0)
    return torch.cat(parts), bounds


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("per_feature", [(300, 0, 250, 120, 90), (1000, 3, 1, 400, 7)])
def test_unique_values_checks_fuses_and_dedups_raw_ids(
    dtype: torch.dtype, per_feature: tuple[int, ...]
) -> None:
    """Raw ids of features (two of one table, an empty one) give exactly `torch.unique` of
    their fused ids, sorted, with its inverse; the bitmap is clear afterwards (a second batch
    is right too)."""
    cache, sizes = _four_tables()
    feature_tables = [3, 0, 3, 5, 2]
    gen = torch.Generator().manual_seed(sum(per_feature))
    ranges = cache.row_ranges(feature_tables)
    prefixes = torch.tensor(feature_tables).repeat_interleave(torch.tensor(per_feature))
    assert cache.maps_batch(sum(per_feature)) and not cache.maps_batch(1)  # too sparse
    for _ in range(2):  # the second batch sees the bitmap the first one left
        raw, bounds = _raw_features(gen, sizes, feature_tables, per_feature)
        got = cache.unique_values(raw.to(dtype), bounds, ranges)
        assert got is not None
        unique, inverse = torch.unique(raw | (prefixes << FUSION_K), return_inverse=True)
        assert torch.equal(got[0], unique)
        assert torch.equal(got[1], inverse)


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", ["negative", "past the table", "past 2**fusion_k"])
def test_unique_values_refuses_a_bad_id_and_leaves_the_bitmap_clear(where: str, bad: str) -> None:
    """An id out of its table's range (or one that would overflow fusion_k) anywhere in the
    batch gives None, and the rows marked before it are cleared: the next batch is right."""
    cache, sizes = _four_tables()
    feature_tables, per_feature = [3, 0, 2], (400, 300, 200)
    gen = torch.Generator().manual_seed(7)
    raw, bounds = _raw_features(gen, sizes, feature_tables, per_feature)
    ranges = cache.row_ranges(feature_tables)
    if bad == "past 2**fusion_k":  # a narrower fusion_k than the table's rows
        cache.fusion_k = cache.dedup.fusion_k = 8
        ranges = cache.row_ranges(feature_tables)
        assert int(ranges[1][0]) == 1 << 8
        value = 1 << 8
    else:
        value = -1 if bad == "negative" else sizes[3]
    at = {"first": 0, "middle": 250, "last": 399}[where]
    broken = raw.clone()
    broken[at] = value
    assert cache.unique_values(broken, bounds, ranges) is None
    assert not bool(cache.dedup.row_bits.any()), "marks of the refused batch are cleared"
    cache.fusion_k = cache.dedup.fusion_k = FUSION_K
    ranges = cache.row_ranges(feature_tables)
    got = cache.unique_values(raw, bounds, ranges)
    ids = raw | (torch.tensor(feature_tables).repeat_interleave(torch.tensor(per_feature))
                 << FUSION_K)  # fmt: skip
    assert got is not None and torch.equal(got[0], torch.unique(ids))


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_unique_values_refuses_bounds_that_miss_values() -> None:
    cache, sizes = _four_tables()
    raw, bounds = _raw_features(torch.Generator().manual_seed(1), sizes, [3, 0], (400, 300))
    ranges = cache.row_ranges([3, 0])
    assert cache.unique_values(raw, bounds - 1, ranges) is None  # does not start at 0
    assert cache.unique_values(raw[:-1], bounds, ranges) is None  # past the last value
    assert cache.unique_values(raw.float(), bounds, ranges) is None  # not integer ids
    assert not bool(cache.dedup.row_bits.any())


def test_unique_by_rows_needs_the_row_index() -> None:
    ids = torch.arange(97)
    unbounded, _, _ = make_cache(CONFIGS["quarter"], OptimRule.SGD, CPU, unbounded=True)
    assert unbounded.unique_by_rows(ids) is None
    whole, _, _ = make_cache(CacheConfig(capacity=sum(SIZES.values())), OptimRule.SGD, CPU)
    assert whole.unique_by_rows(ids) is None
