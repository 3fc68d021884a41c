"""The eviction policies (`cache.policy`): the object a cache holds, LFU's admission of
misses over resident rows, and the miss order each policy hands the way assignment (every
registered policy: `cache.policy_registry`)."""

from __future__ import annotations

import pytest
import torch

from embcache.backend import for_device
from embcache.cache.config import CacheConfig, CachePolicy
from embcache.cache.hot_cache import HotCache
from embcache.cache.policy import EvictionPolicy, make_policy, policy_type
from embcache.cache.policy_registry import policy_names
from embcache.cache.sketch import LfuCounts
from embcache.kernels.cache_index import set_index
from embcache.kv.base import TableSpec
from embcache.kv.host import HostKV

K = 20
CPU = for_device("cpu")


def _counts(rows: int) -> LfuCounts:
    return LfuCounts(torch.tensor([0]), rows, None, K)


@pytest.mark.parametrize("policy", policy_names())
def test_a_cache_holds_the_policy_of_its_config(policy: str) -> None:
    store = HostKV()
    spec = TableSpec("t", 5, num_embeddings=1000, state_dim=1)
    store.init_table(spec)
    config = CacheConfig(capacity=64, ways=4, policy=policy.upper())  # any case
    cache = HotCache([(0, spec)], config, store, "cpu", K)
    assert type(cache.eviction) is policy_type(policy)
    assert issubclass(policy_type(policy), EvictionPolicy)
    assert cache.policy == config.policy == policy
    assert cache.eviction.counts is cache._counts
    assert (cache._counts is not None) == policy_type(policy).needs_counts


def test_lru_admits_every_assigned_way() -> None:
    lru = make_policy(CachePolicy.LRU, None, CacheConfig(capacity=8), CPU, K)
    assigned = torch.tensor([0, -1, 3, 1])
    scores = torch.full((2, 4), 99)
    got = lru.admit(assigned, scores, torch.tensor([0, 1]), torch.tensor([0, 0, 1, 1]), None)
    assert torch.equal(got, assigned)


def test_lfu_displaces_only_rarer_rows() -> None:
    """A miss takes a way when its frequency beats the way's score (an empty way: -1)."""
    lfu = make_policy(CachePolicy.LFU, _counts(16), CacheConfig(capacity=8), CPU, K)
    set_scores = torch.tensor([[5, -1, 2, 7], [1, 1, 1, 1]])
    touched = torch.tensor([0, 1])
    owner = torch.tensor([0, 0, 0, 1, 1])  # the run (touched set) of each miss
    assigned = torch.tensor([0, 1, 3, 2, -1])
    priority = torch.tensor([5, 1, 8, 2, 9])
    got = lfu.admit(assigned, set_scores, touched, owner, priority)
    # 5 vs 5: no; 1 vs empty: yes; 8 vs 7: yes; 2 vs 1: yes; no way: stays -1.
    assert got.tolist() == [-1, 1, 3, 2, -1]


@pytest.mark.parametrize("kind", policy_names())
def test_misses_come_grouped_by_set(kind: str) -> None:
    """Each policy hands the misses sorted by set (the runs `assign_ways` needs), every miss
    once; LFU puts the most frequent first within a set."""
    counts = _counts(64)
    ids = torch.arange(64, dtype=torch.int64)
    counts.add(ids[::3])  # every third id seen once before
    policy = make_policy(kind, counts, CacheConfig(capacity=8), CPU, K)
    miss_pos = torch.arange(1, 64, 2)
    miss_ids = ids.index_select(0, miss_pos)
    shuffle = torch.arange(miss_ids.numel(), dtype=torch.int64) * 7919 % 31
    pos, sets, priority = policy.order_misses(ids, miss_pos, miss_ids, shuffle, num_sets=4)
    assert sorted(pos.tolist()) == miss_pos.tolist()
    assert torch.equal(sets, set_index(ids.index_select(0, pos), 4))
    assert bool((sets[1:] >= sets[:-1]).all())
    if kind == CachePolicy.LRU:
        assert priority is None
    if kind != CachePolicy.LFU:  # the frequency order below is LFU's
        return
    assert priority is not None
    assert torch.equal(priority, counts.get(ids.index_select(0, pos)) + 1)
    same_set = sets[1:] == sets[:-1]
    assert bool((priority[1:][same_set] <= priority[:-1][same_set]).all())
