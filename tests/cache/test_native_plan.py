"""The compiled CPU plan (`ops.plan.native`, numba) against the torch path it mirrors.

Two caches over two stores, one resolving through the numba kernels (``EMBCACHE_BACKEND=auto``),
the other through torch ops (``torch``, the specification), are driven through the same
sequence of batches, updates and releases. After every step they must agree on everything a
resolve decides: each id's slot, every slot's key, score, lock and dirty flag, the row index,
the stats, the rows in the slots and the rows in the tier.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embcache.native as native
from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.kv.base import TableSpec
from embcache.kv.host import HostKV
from embcache.ops.plan.native import NativePlan

K = 40
DIM = 4
SIZES = [300, 50, 1000]  # rows of three tables

pytestmark = pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")


def _cache(capacity: int, ways: int, bounded: bool, policy: str = "lru", **lfu: object) -> HotCache:
    store = HostKV()
    tables = []
    for idx, rows in enumerate(SIZES):
        spec = TableSpec(
            f"t{idx}", DIM, num_embeddings=rows, state_dim=1, state_init=0.25, seed=idx,
            capacity=2 * rows if bounded else None,  # room beside the pinned rows
        )  # fmt: skip
        store.init_table(spec)
        tables.append((idx, spec))
    config = CacheConfig(capacity=capacity, ways=ways, policy=policy, max_scratch_rows=4096, **lfu)
    return HotCache(tables, config, store, "cpu", K)


def _batch(gen: torch.Generator, n: int) -> torch.Tensor:
    """Distinct fused ids, sorted (as a dedup hands them), skewed towards low ids so that
    rows come back."""
    table = torch.randint(0, len(SIZES), (n,), generator=gen)
    rows = torch.tensor(SIZES)[table]
    raw = (torch.rand(n, generator=gen) ** 3 * rows).long()
    return torch.unique(raw | (table << K))


def _state(cache: HotCache) -> dict[str, torch.Tensor]:
    assert cache.slot_store.where is not None
    counts = {} if cache._counts is None else {"counts": cache._counts.exact.clone()}
    return counts | {
        "slot_keys": cache.slot_keys.clone(),
        "scores": cache.scores.clone(),
        "locks": cache.locks.clone(),
        "dirty": cache.dirty.clone(),
        "batch_of": cache.batch_of.clone(),
        "where": cache.slot_store.where.clone(),
        "weights": cache.weights.clone(),
        "state": cache.state.clone(),
    }


def _pair(monkeypatch: pytest.MonkeyPatch, *args: object, **kwargs: object) -> dict:
    """A cache built under each of ``auto`` and ``torch``: each holds the backend it was
    built under (`embcache.backend.for_device`)."""
    caches = {}
    for name in ("auto", "torch"):
        monkeypatch.setenv("EMBCACHE_BACKEND", name)
        caches[name] = _cache(*args, **kwargs)
    assert caches["auto"].backend.compiled and not caches["torch"].backend.compiled
    return caches


def _tier(cache: HotCache) -> list[torch.Tensor]:
    return [cache.store.read(f"t{idx}", torch.arange(rows)) for idx, rows in enumerate(SIZES)]


LFU_DECAY = {"lfu_decay": 0.5, "lfu_decay_interval": 4}


@pytest.mark.parametrize(
    ("capacity", "ways", "bounded", "batch", "policy", "lfu"),
    [
        (256, 8, False, 120, "lru", {}),  # evictions every batch
        (64, 16, False, 150, "lru", {}),  # batches wider than the cache: scratch rows
        (512, 32, True, 90, "lru", {}),  # bounded tier tables: pins released with the evictions
        (64, 32, False, 150, "lru", {}),  # 32 ways (the kernel's own loop for them), overflow
        (128, 4, False, 40, "lru", {}),  # few ways: sets run out while others have room
        (256, 8, False, 120, "lfu", {}),  # LFU: misses refused by frequency go to scratch
        (64, 32, False, 150, "lfu", {}),  # LFU, 32 ways, sets overflowing
        (512, 32, True, 90, "lfu", LFU_DECAY),  # LFU with decay, bounded tier tables
        (1024, 1, False, 100, "lfu", {}),  # more sets than 8 a miss: the kernel's sorts
    ],
)
def test_native_plan_equals_the_torch_plan(
    monkeypatch: pytest.MonkeyPatch,
    capacity: int,
    ways: int,
    bounded: bool,
    batch: int,
    policy: str,
    lfu: dict,
) -> None:
    caches = _pair(monkeypatch, capacity, ways, bounded, policy, **lfu)
    gen = torch.Generator().manual_seed(capacity + ways)
    plan = f"plan_{policy}"
    calls = {plan: 0, "reserve": 0}
    for name in calls:
        method = getattr(NativePlan, name)

        def counted(self: NativePlan, *args: object, _method=method, _name=name) -> object:
            calls[_name] += 1
            return _method(self, *args)

        monkeypatch.setattr(NativePlan, name, counted)
    for step in range(25):
        ids = _batch(gen, batch)
        lock = step % 3 != 2  # some unlocked resolves, as forwards without a step make
        delta = torch.randn(ids.numel(), DIM, generator=gen)
        updated = torch.rand(ids.numel(), generator=gen) < 0.7  # the others stay clean
        slots = {}
        for backend, cache in caches.items():
            monkeypatch.setenv("EMBCACHE_BACKEND", backend)
            before = cache.planner.tick
            slots[backend] = cache.resolve(ids, lock=lock)
            assert cache.planner.tick == before + 1
            live = slots[backend]
            cache.weights[live[updated]] += delta[updated]  # an update of some of its rows
            cache.mark_dirty(live[updated])
            if lock:
                cache.unlock(live)
            if step % 7 == 6:
                cache.release()
        torch.testing.assert_close(slots["auto"], slots["torch"], rtol=0, atol=0)
        ours, spec = _state(caches["auto"]), _state(caches["torch"])
        for name in ours:
            torch.testing.assert_close(ours[name], spec[name], rtol=0, atol=0, msg=name)
        assert caches["auto"].cache_stats() == caches["torch"].cache_stats()
    for ours, spec in zip(_tier(caches["auto"]), _tier(caches["torch"]), strict=True):
        torch.testing.assert_close(ours, spec, rtol=0, atol=0)
    assert calls[plan] == 25  # every resolve planned by the kernels (torch: never)
    assert calls["reserve"] > 0
    if batch > capacity:  # misses overflowed into scratch rows, reserved by the kernel too
        assert caches["auto"].scratch_rows > 0
    for backend, cache in caches.items():
        monkeypatch.setenv("EMBCACHE_BACKEND", backend)
        cache.flush()
    for ours, spec in zip(_tier(caches["auto"]), _tier(caches["torch"]), strict=True):
        torch.testing.assert_close(ours, spec, rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize(
    ("capacity", "batch"), [(256, 50), (64, 150)], ids=["ways", "ways and scratch"]
)
def test_native_plan_rolls_back_a_failed_tier_call(
    monkeypatch: pytest.MonkeyPatch, capacity: int, batch: int, policy: str
) -> None:
    """A tier error after a compiled plan leaves the cache exactly as before the resolve."""
    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    cache = _cache(capacity, 16, False, policy)
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        slots = cache.resolve(_batch(gen, batch))
        cache.mark_dirty(slots)
        cache.unlock(slots)
    assert int(cache.dirty.sum()) > capacity * 3 // 4  # misses evict dirty rows
    cache.release()  # what the resolve does first (it succeeds): the state to come back to
    scratch_used = cache._scratch_used
    before = _state(cache)
    stats = cache.cache_stats()

    def broken(*args: object, **kwargs: object) -> None:
        raise ConnectionError("tier down")

    # The read of the misses fails, whichever of the tier's reads the table takes.
    monkeypatch.setattr(cache.store, "get", broken)
    monkeypatch.setattr(cache.store, "get_grouped", broken)
    monkeypatch.setattr(cache.store, "get_grouped_into", broken)
    reserved = []
    method = NativePlan.reserve
    monkeypatch.setattr(NativePlan, "reserve", lambda *a: reserved.append(1) or method(*a))
    failed = _batch(gen, batch)
    with pytest.raises(ConnectionError):
        cache.resolve(failed)
    assert reserved
    assert cache._scratch_used == scratch_used
    after = _state(cache)
    if policy == "lfu":  # each id of the failed batch counted once more, no other count
        assert cache._counts is not None
        rows = cache._counts.row_offset[failed >> K] + (failed & ((1 << K) - 1))
        expected = before["counts"].clone()
        expected[rows] += 1
        torch.testing.assert_close(after["counts"], expected, rtol=0, atol=0)
    # Scores and LFU counts aside: the batch's hits keep their new recency, and LFU counts the
    # request (as on the torch path). A scratch area grown for the batch stays grown, its new
    # rows empty.
    for name in before.keys() - {"scores", "counts"}:
        n = before[name].shape[0]
        torch.testing.assert_close(after[name][:n], before[name], rtol=0, atol=0, msg=name)
    assert bool((cache.slot_keys[before["slot_keys"].shape[0] :] == -1).all())
    assert cache.cache_stats() == stats


@pytest.mark.parametrize("num_sets", [7, 5000], ids=["counting sort", "three sorts"])
def test_lfu_miss_order_is_set_then_frequency_then_shuffle(num_sets: int) -> None:
    """The LFU plan's order of misses, in both of its ways of sorting, is numpy's lexsort by
    (set, frequency descending, shuffle)."""
    from embcache.native import plan_kernels as kernels

    rng = np.random.default_rng(num_sets)
    m = 300
    sets = rng.integers(0, num_sets, m)
    freq = rng.integers(1, 4, m)  # few values: ties are broken by the shuffle
    shuffle = rng.permutation(np.arange(-m, m))[:m].astype(np.int64) * (1 << 40)
    order = kernels._by_set_freq(sets, freq, shuffle, num_sets)
    np.testing.assert_array_equal(order, np.lexsort((shuffle, -freq, sets)))


def test_lfu_with_admission_counts_and_scores_as_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With admission the plan stays torch ops, but an exactly counted LFU cache's counts and
    scores come from the compiled `NativePlan.touch_lfu`: the same as the torch path's, ids not
    admitted (slot -1) counted and left unscored."""
    caches = _pair(monkeypatch, 256, 8, False, "lfu", admit_after=2)
    touched = []
    method = NativePlan.touch_lfu
    monkeypatch.setattr(NativePlan, "touch_lfu", lambda *a: touched.append(1) or method(*a))
    gen = torch.Generator().manual_seed(11)
    refused = 0
    for _ in range(15):
        ids = _batch(gen, 120)
        slots = {}
        for backend, cache in caches.items():
            monkeypatch.setenv("EMBCACHE_BACKEND", backend)
            slots[backend] = cache.resolve(ids)
            cache.unlock(slots[backend][slots[backend] >= 0])
        refused += int((slots["auto"] < 0).sum())
        torch.testing.assert_close(slots["auto"], slots["torch"], rtol=0, atol=0)
        ours, spec = _state(caches["auto"]), _state(caches["torch"])
        for name in ours:
            torch.testing.assert_close(ours[name], spec[name], rtol=0, atol=0, msg=name)
        assert caches["auto"].cache_stats() == caches["torch"].cache_stats()
    assert len(touched) == 15  # every resolve of the compiled cache, none of the torch one
    assert refused > 0  # some ids were not admitted
