"""The GPU's resolve path run on a CPU, against the torch plan, state for state.

On a GPU a set-associative cache finds its hits through the set index (`set_index`,
`cache_lookup`) and the scratch area (`ScratchArea.find`), and picks victims with the
Triton `assign_ways`; on a CPU it keeps a row index (``SlotStore.where``) instead. Under
``EMBCACHE_BACKEND=triton`` a CPU cache takes the GPU's path (``device_path``), with the Triton
kernels in the interpreter, so that path runs here before it runs on a GPU.

Two caches over two stores are driven through the same batches: one on the device path, one
on the torch plan (``EMBCACHE_BACKEND=torch``: row index, torch twins). After every batch they
must agree on every slot, key, score, LFU count, lock, dirty flag, scratch row and stored row;
the device cache's set index must find every resident row where the torch cache's row index
says it is; after a flush both tiers must equal a float64 dense reference.
"""

from __future__ import annotations

import pytest
import torch

import embcache.ops.plan.triton as plan_triton
from embcache.backend import for_device
from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.cache.scratch import ScratchArea
from embcache.kv.base import TableSpec
from embcache.kv.host import HostKV
from embcache.ops.plan.spec import set_index_ref

K = 20
DIM = 4
SIZES = [40, 25]  # rows of two tables: small, so the interpreter's programs are few
OFFSETS = [0, 40]  # first row of each table among the cache's rows
STEPS = 14


def _cache(backend: str, capacity: int, ways: int, policy: str, monkeypatch) -> HotCache:
    """A cache built under ``EMBCACHE_BACKEND=backend`` (the choice of path is made then)."""
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    store = HostKV()
    tables = []
    for idx, rows in enumerate(SIZES):
        spec = TableSpec(f"t{idx}", DIM, num_embeddings=rows, state_dim=1, state_init=0.5, seed=idx)
        store.init_table(spec)
        tables.append((idx, spec))
    config = CacheConfig(capacity=capacity, ways=ways, policy=policy, max_scratch_rows=256)
    return HotCache(tables, config, store, "cpu", K)


def _all_ids() -> torch.Tensor:
    """Every fused id of the two tables, in row order."""
    return torch.cat([torch.arange(rows) | (idx << K) for idx, rows in enumerate(SIZES)])


def _rows(ids: torch.Tensor) -> torch.Tensor:
    """Row of each fused id among the cache's rows (for the dense reference)."""
    return torch.tensor(OFFSETS)[ids >> K] + (ids & ((1 << K) - 1))


def _batch(gen: torch.Generator, n: int) -> torch.Tensor:
    """Distinct fused ids, sorted (as a dedup hands them), skewed towards low ids so rows come
    back: hits, in the sets and in scratch, beside misses."""
    table = torch.randint(0, len(SIZES), (n,), generator=gen)
    raw = (torch.rand(n, generator=gen) ** 2 * torch.tensor(SIZES)[table]).long()
    return torch.unique(raw | (table << K))


def _state(cache: HotCache) -> dict[str, torch.Tensor]:
    state = {
        "slot_keys": cache.slot_keys.clone(),  # the sets' ways, then the scratch rows
        "scores": cache.scores.clone(),
        "locks": cache.locks.clone(),
        "dirty": cache.dirty.clone(),
        "batch_of": cache.batch_of.clone(),
        "weights": cache.weights.clone(),
        "state": cache.state.clone(),
    }
    if cache._counts is not None:
        state["counts"] = cache._counts.exact.clone()
    return state


def _tier(cache: HotCache) -> torch.Tensor:
    return torch.cat(
        [cache.store.read(f"t{i}", torch.arange(rows)) for i, rows in enumerate(SIZES)]
    )


@pytest.mark.parametrize(
    ("backend", "expected"), [("auto", False), ("torch", False), ("triton", True)]
)
def test_the_device_path_is_taken_on_a_cpu_only_under_triton(
    monkeypatch: pytest.MonkeyPatch, backend: str, expected: bool
) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    assert for_device(torch.device("cpu")).device_path is expected
    assert for_device(torch.device("cuda")).device_path is True  # a GPU has no other path
    cache = _cache(backend, 16, 4, "lru", monkeypatch)
    assert cache.device_path is expected
    assert (cache.slot_store.where is None) is expected  # the row index is the CPU path's


@pytest.mark.parametrize(
    ("policy", "capacity", "ways"),
    [
        ("lru", 16, 4),  # 4 sets: evictions and overflowing sets every few batches
        ("lfu", 16, 4),  # LFU: misses refused by frequency go to scratch too
        ("lru", 8, 1),  # one way a set: the kernels' narrowest blocks
    ],
)
def test_device_path_on_cpu_equals_the_torch_plan(
    monkeypatch: pytest.MonkeyPatch, policy: str, capacity: int, ways: int
) -> None:
    caches = {b: _cache(b, capacity, ways, policy, monkeypatch) for b in ("triton", "torch")}
    device, spec = caches["triton"], caches["torch"]
    assert device.device_path and device.slot_store.where is None  # the GPU's structures
    assert not spec.device_path and spec.slot_store.where is not None  # the CPU's row index

    # Count the launches of the Triton kernels and the scratch searches, so the test fails when
    # the device branch is not the one taken.
    # An LRU plan is a group plan (`cache.group_plan`: one `probe_group_triton` a resolve), an
    # LFU plan is made cache by cache (one `cache_lookup_triton`, its misses placed by
    # `assign_ways`, whose `admit` needs its runs): launchers of the triton plan
    # (`ops.plan.triton`), which its methods call by their module names.
    calls = dict.fromkeys(
        ("set_index_triton", "cache_lookup_triton", "assign_ways_triton", "assign_misses_triton",
         "probe_group_triton"),
        0,
    )  # fmt: skip
    for name in calls:
        launcher = getattr(plan_triton, name)

        def counted(*args: object, _launcher=launcher, _name=name) -> torch.Tensor:
            calls[_name] += 1
            return _launcher(*args)

        monkeypatch.setattr(plan_triton, name, counted)
    found_in_scratch = []
    find = ScratchArea.find

    def counted_find(self: ScratchArea, ids: torch.Tensor, slots: torch.Tensor) -> None:
        find(self, ids, slots)
        found_in_scratch.append(int((slots >= self.slots.num_slots).sum()))

    monkeypatch.setattr(ScratchArea, "find", counted_find)

    dense = _tier(spec).double()  # the rows as first touched (HostKV.read creates nothing)
    gen = torch.Generator().manual_seed(capacity * 10 + ways)
    held: dict[str, torch.Tensor | None] = {"triton": None, "torch": None}
    device_resolves = 0
    for step in range(STEPS):
        ids = _batch(gen, 3 * capacity // 2)  # wider than the cache: sets overflow to scratch
        # Locked resolves whose lock is held over the next batch (as under prefetch), so its
        # misses meet ways they may not take; every third one unlocked (a forward without step).
        lock = step % 3 != 2
        delta = torch.randn(ids.numel(), DIM, generator=gen)
        updated = torch.rand(ids.numel(), generator=gen) < 0.7  # the others stay clean
        slots = {}
        for backend, cache in caches.items():
            monkeypatch.setenv("EMBCACHE_BACKEND", backend)
            before = calls["cache_lookup_triton"] + calls["probe_group_triton"]
            slots[backend] = cache.resolve(ids, lock=lock)
            after = calls["cache_lookup_triton"] + calls["probe_group_triton"]
            if backend == "triton":
                device_resolves += 1
                assert after == before + 1, "device path not taken"
            else:
                assert after == before, "torch plan ran a Triton lookup"
            live = slots[backend]
            cache.weights[live[updated]] += delta[updated]
            cache.state[live[updated]] += 1.0
            cache.mark_dirty(live[updated])
            if held[backend] is not None:
                cache.unlock(held[backend])
            held[backend] = live if lock else None
            if step % 5 == 4:
                cache.release()
        dense[_rows(ids[updated]), :DIM] += delta[updated].double()
        dense[_rows(ids[updated]), DIM:] += 1.0

        torch.testing.assert_close(slots["triton"], slots["torch"], rtol=0, atol=0)
        ours, theirs = _state(device), _state(spec)
        assert ours.keys() == theirs.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
        assert device._scratch_used == spec._scratch_used
        assert device.cache_stats() == spec.cache_stats()

        # The set index holds what the row index says: each key of the sets lies in the set
        # its hash names, and a lookup of every row through the sets and the scratch area
        # finds the slot the torch cache's row index holds for it (-1 when not resident).
        main = device.slot_keys[: device.num_slots]
        in_set = torch.arange(device.num_slots) // device.ways
        held_ways = main >= 0
        assert torch.equal(set_index_ref(main[held_ways], device.num_sets), in_set[held_ways])
        monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
        everywhere = device._resident_slots(_all_ids())
        assert spec.slot_store.where is not None
        torch.testing.assert_close(everywhere, spec.slot_store.where.long(), rtol=0, atol=0)

    # What the sequence was built to reach, on the device path itself.
    stats = device.cache_stats()
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["writebacks"] > 0
    assert device.scratch_rows > 0, "no set ever had more misses than unlocked ways"
    assert sum(found_in_scratch) > 0, "no hit was found in the scratch area"
    assert calls["set_index_triton"] + calls["probe_group_triton"] >= device_resolves
    if policy == "lru":  # every plan a group plan, scratch rows in use or not
        assert calls["probe_group_triton"] == device_resolves, calls
    else:  # cache by cache: LFU's admission needs the runs
        assert calls["assign_ways_triton"] > 0 and calls["probe_group_triton"] == 0, calls

    for backend, cache in caches.items():
        monkeypatch.setenv("EMBCACHE_BACKEND", backend)
        if held[backend] is not None:
            cache.unlock(held[backend])
        cache.release()
        cache.flush()
    tiers = {backend: _tier(cache) for backend, cache in caches.items()}
    torch.testing.assert_close(tiers["triton"], tiers["torch"], rtol=0, atol=0)
    torch.testing.assert_close(tiers["triton"].double(), dense, rtol=1e-6, atol=1e-5)
    assert not bool(device.dirty.any())
