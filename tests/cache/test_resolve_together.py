"""`resolve_together`: several caches resolved in lockstep give what one resolve each gives,
and a failure in one cache leaves none of them locked."""

from __future__ import annotations

import pytest
import torch

from embcache.cache import group_plan, hot_cache
from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache, resolve_together
from embcache.cache.plan import SetPlanner
from embcache.cache.policy_registry import policy_names
from embcache.kv.base import TableSpec
from embcache.kv.host import HostKV
from embcache.ops.plan import MISSES, PLACED
from embcache.ops.plan.spec import assign_ways_ref

K = 20
ROWS = 700


def _caches(
    policy: str, dims: tuple[int, ...] = (4, 8, 12), bound: int | None = None
) -> list[HotCache]:
    store = HostKV()
    caches = []
    for d, dim in enumerate(dims):
        spec = TableSpec(f"t{d}", dim, num_embeddings=ROWS, state_dim=1, state_init=0.25, seed=d,
                         capacity=bound)  # fmt: skip
        store.init_table(spec)
        # Ways differ between caches: a group plan of caches of several geometries.
        ways = 4 if d % 2 == 0 else 8
        config = CacheConfig(capacity=96, ways=ways, policy=policy, max_scratch_rows=4096)
        caches.append(HotCache([(d, spec)], config, store, "cpu", K))
    return caches


def _batches(gen: torch.Generator, n: int) -> list[torch.Tensor]:
    """One batch of distinct sorted fused ids per table (skewed, so rows come back)."""
    out = []
    for d in range(n):
        raw = (torch.rand(150, generator=gen) ** 3 * ROWS).long()
        out.append(torch.unique(raw | (d << K)))
    return out


def _run(caches: list[HotCache], together: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    seen = []
    for _ in range(8):
        batches = _batches(gen, len(caches))
        if together:
            slots = resolve_together(caches, batches)
        else:
            slots = [c.resolve(b) for c, b in zip(caches, batches, strict=True)]
        for cache, s in zip(caches, slots, strict=True):
            cache.weights[s] += 1.0  # an update: dirty victims and scratch rows written back
            cache.mark_dirty(s)
            cache.unlock(s)
        seen += slots
    return seen


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("policy", policy_names())
def test_lockstep_equals_one_resolve_each(
    monkeypatch: pytest.MonkeyPatch, policy: str, backend: str
) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    alone, together = _caches(policy), _caches(policy)
    for a, b in zip(_run(alone, False), _run(together, True), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _assert_same_caches(alone, together, ("slot_keys", "scores", "dirty", "locks"))


def _assert_same_caches(alone: list, other: list, arrays: tuple[str, ...]) -> None:
    """The caches of two runs hold the same stats, per-slot ``arrays``, weights and state, and,
    once flushed, their tiers the same rows."""
    for a, b in zip(alone, other, strict=True):
        assert a.cache_stats() == b.cache_stats()
        for name in (*arrays, "weights", "state"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
        a.flush()
        b.flush()
    ids = torch.arange(ROWS)
    for d in range(3):
        torch.testing.assert_close(
            alone[0].store.get(f"t{d}", ids), other[0].store.get(f"t{d}", ids), rtol=0, atol=0
        )


@pytest.mark.parametrize("bound", [None, 2 * ROWS], ids=["unbounded", "bounded"])
def test_the_group_plan_equals_each_cache_planning_alone(
    monkeypatch: pytest.MonkeyPatch, bound: int | None
) -> None:
    """On the device path (Triton, under the interpreter) caches of several dims and ways are
    planned as one group (`cache.group_plan`) while no scratch row is in use: the same slots,
    keys, scores, locks, flags, rows and tier as each cache planned on its own (its
    `SetPlanner.plan_sets`), also where a cache of the group is left with misses and takes
    scratch rows, and with bounded tables (the evicted rows unpinned)."""
    monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    grouped = _caches("lru", bound=bound)
    sizes, left, alone = [], [], []
    plan_group, with_scratch = group_plan.plan_group, group_plan._with_scratch_rows

    def counted_group(planners, table, made):
        sizes.append(len(planners))
        return plan_group(planners, table, made)

    def counted_scratch(planners, table, counts, full):
        left.append(sum(row[PLACED] < row[MISSES] for row in counts))
        return with_scratch(planners, table, counts, full)

    monkeypatch.setattr(hot_cache, "plan_group", counted_group)
    monkeypatch.setattr(group_plan, "_with_scratch_rows", counted_scratch)
    monkeypatch.setattr(SetPlanner, "plan_sets", lambda *a: alone.append(1))
    seen = _run(grouped, True)
    assert 3 in sizes, sizes  # every cache in one group
    assert sum(left) > 0, "no cache of a group was left with misses (scratch rows)"
    assert not alone, "a plan was made cache by cache"
    monkeypatch.undo()
    monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    monkeypatch.setattr(SetPlanner, "groups", lambda self: False)
    alone = _caches("lru", bound=bound)
    for a, b in zip(_run(alone, True), seen, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(alone, grouped, strict=True):
        assert a._scratch_used == b._scratch_used
    _assert_same_caches(alone, grouped, ("slot_keys", "scores", "dirty", "locks", "batch_of"))


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_a_failed_tier_read_leaves_no_cache_locked(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    caches = _caches("lru")
    _run(caches, True)
    store = caches[0].store
    real = store.get_grouped_into, store.get_grouped, store.get

    def broken(*args: object, **kwargs: object) -> None:
        raise ConnectionError("tier down")

    for name in ("get_grouped_into", "get_grouped", "get"):
        monkeypatch.setattr(store, name, broken)
    keys = [c.slot_keys.clone() for c in caches]
    with pytest.raises(ConnectionError):
        resolve_together(caches, _batches(torch.Generator().manual_seed(9), 3))
    for cache, before in zip(caches, keys, strict=True):
        assert cache.locked_slots() == 0
        torch.testing.assert_close(cache.slot_keys[: cache.num_slots], before[: cache.num_slots])
    for name, fn in zip(("get_grouped_into", "get_grouped", "get"), real, strict=True):
        monkeypatch.setattr(store, name, fn)
    resolve_together(caches, _batches(torch.Generator().manual_seed(9), 3))  # retried: works


@pytest.mark.parametrize("seed", range(4))
def test_assign_ways_with_known_runs_reads_nothing_and_agrees(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    S, W, m = 37, 5, 120
    scores = torch.randint(-1, 50, (S, W), generator=gen)
    blocked = torch.rand(S, W, generator=gen) < 0.3
    miss_sets = torch.sort(torch.randint(0, S, (m,), generator=gen)).values
    runs = int(torch.unique(miss_sets).numel())
    torch.testing.assert_close(
        assign_ways_ref(scores, blocked, miss_sets, runs),
        assign_ways_ref(scores, blocked, miss_sets),
        rtol=0,
        atol=0,
    )
