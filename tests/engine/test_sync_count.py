"""Host synchronisations per step do not grow with the number of tables.

Counted on the CPU with `tests/sync_count.SyncCounter` (host reads of tensors and ops whose
output size depends on the data, outside the tiers, which only see host tensors): each would
drain the stream on a GPU, and on the prefetch thread stall the training that shares it.
"""

from __future__ import annotations

import pytest
import torch

import embcache
from tests.sync_count import SyncCounter

# Ceilings of today's counts (a 10% LRU cache with misses, dirty victims and scratch rows, the
# worst path): they guard against a sync creeping back in per table or per id.
MAX_FORWARD, MAX_STEP = 30, 8


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted on the torch path, the one a GPU runs: the compiled CPU kernels
    (`embcache.native`, CPU only) read their arrays through ``numpy()``, which syncs nothing."""
    monkeypatch.setenv("EMBCACHE_BACKEND", "torch")


def _collection(num_tables: int, policy: str, load_factor: float):
    tables = [
        embcache.TableConfig(
            name=f"t{i}", embedding_dim=16, num_embeddings=1000, feature_names=[f"f{i}"]
        )
        for i in range(num_tables)
    ]
    cache = embcache.CacheConfig(load_factor=load_factor, policy=policy, ways=4)
    return embcache.CachedEmbeddingBagCollection(tables=tables, cache=cache)


def _batches(num_tables: int, n: int, seed: int = 0) -> list[embcache.JaggedBatch]:
    gen = torch.Generator().manual_seed(seed)
    keys = [f"f{i}" for i in range(num_tables)]
    out = []
    for _ in range(n):
        lengths = torch.randint(1, 5, (num_tables * 64,), generator=gen)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
        out.append(embcache.JaggedBatch.from_lengths(keys, values, lengths))
    return out


def _counts(num_tables: int, policy: str, load_factor: float, prefetch: bool) -> dict:
    ebc = _collection(num_tables, policy, load_factor)
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    *warm, batch = _batches(num_tables, 5)
    for b in warm:  # fill the cache: the counted step has hits, misses and dirty victims
        ebc(b).values().sum().backward()
        opt.step()
    with SyncCounter() as forward:
        if prefetch:
            ebc.set_fused_prefetch_handle(ebc.issue_fused_prefetch(batch))
        out = ebc(batch)
    with SyncCounter() as backward:
        out.values().square().sum().backward()
    with SyncCounter() as step:
        opt.step()
    return {
        "forward": forward.total,
        "backward": backward.total,
        "step": step.total,
        "kinds": (dict(forward.counts), dict(step.counts)),
    }


@pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])
@pytest.mark.parametrize(
    ("policy", "load_factor"),
    [("lru", 0.1), ("lfu", 0.1), ("lru", 1.0)],
    ids=["lru-10pct", "lfu-10pct", "whole-table"],
)
def test_syncs_per_step_do_not_grow_with_tables(
    policy: str, load_factor: float, prefetch: bool
) -> None:
    two = _counts(2, policy, load_factor, prefetch)
    many = _counts(26, policy, load_factor, prefetch)
    assert two == many, f"2 tables: {two}\n26 tables: {many}"
    assert two["forward"] <= MAX_FORWARD, two
    assert two["backward"] <= 1, two  # every cache's per-table cut of its ids, in one read
    assert two["step"] <= MAX_STEP, two


def test_the_counter_sees_a_sync_per_table() -> None:
    """The counter is not blind: one ``.tolist()`` per table is counted once per table."""
    tensors = [torch.arange(3) for _ in range(26)]
    with SyncCounter() as c:
        for t in tensors:
            t.tolist()
        torch.arange(5).nonzero()
        torch.arange(5)[torch.arange(5) > 2]
    assert c.counts["tolist"] == 26
    assert c.counts["aten.nonzero"] == 1
    assert c.counts["bool-mask index"] == 1


# -- distinct embedding dims (one cache each) ----------------------------------------------------

POOLINGS = ("sum", "mean")


def _dims_collection(num_dims: int, policy: str, load_factor: float):
    """Two tables per dim, one summed and one averaged: every cache has two lookups."""
    tables = [
        embcache.TableConfig(
            name=f"t{d}_{p}",
            embedding_dim=8 * (d + 1),
            num_embeddings=1000,
            feature_names=[f"f{d}_{p}"],
            pooling=pooling,
        )
        for d in range(num_dims)
        for p, pooling in enumerate(POOLINGS)
    ]
    cache = embcache.CacheConfig(load_factor=load_factor, policy=policy, ways=4)
    ebc = embcache.CachedEmbeddingBagCollection(tables=tables, cache=cache)
    # The batch's keys in another order than the caches' (as a loader's often are): each
    # cache's features are regrouped, with one dim or several.
    return ebc, [f for t in reversed(tables) for f in t.feature_names]


def _dims_batches(keys: list[str], n: int) -> list[embcache.JaggedBatch]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.randint(1, 5, (len(keys) * 64,), generator=gen)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
        out.append(embcache.JaggedBatch.from_lengths(keys, values, lengths))
    return out


def _dims_counts(num_dims: int, policy: str, load_factor: float, prefetch: bool) -> dict:
    ebc, keys = _dims_collection(num_dims, policy, load_factor)
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    *warm, batch = _dims_batches(keys, 5)
    for b in warm:
        ebc(b).values().sum().backward()
        opt.step()
    with SyncCounter() as check:  # every cache's ids validated and fused: one pass for all
        ebc.engines.check(ebc.checked_input(batch), lock=True)
    with SyncCounter() as forward:
        if prefetch:
            ebc.set_fused_prefetch_handle(ebc.issue_fused_prefetch(batch))
        out = ebc(batch)
    with SyncCounter() as backward:
        out.values().square().sum().backward()
    with SyncCounter() as step:
        opt.step()
    return {
        "check": check.total,
        "forward": forward.total,
        "backward": backward.total,
        "step": step.total,
    }


CASES = pytest.mark.parametrize(
    ("policy", "load_factor"),
    [("lru", 0.1), ("lfu", 0.1), ("lru", 1.0)],
    ids=["lru-10pct", "lfu-10pct", "whole-table"],
)
PREFETCH = pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])


@PREFETCH
@CASES
def test_checking_a_batch_syncs_once_for_all_dims(
    policy: str, load_factor: float, prefetch: bool
) -> None:
    """Validating and fusing every cache's ids (`EngineGroup.check`) makes the same host reads
    for 1, 3 and 5 distinct dims (one read of the values per key, one `fuse_ids` over all
    caches), and backward none (every cache's per-table cut of its ids for the trace is read
    in the forward, with its unique count; the counter sees autograd's backward since it
    patches `torch.Tensor`'s reads)."""
    counts = {d: _dims_counts(d, policy, load_factor, prefetch) for d in (1, 3, 5)}
    assert len({c["check"] for c in counts.values()}) == 1, counts
    assert all(c["backward"] == 0 for c in counts.values()), counts


@PREFETCH
@CASES
def test_syncs_per_step_do_not_grow_with_dims(
    policy: str, load_factor: float, prefetch: bool
) -> None:
    """Forward, backward and step make the same host reads for 1, 3 and 5 distinct dims (two
    pooling modes per cache): each phase reads every cache's scalars at once (the bags' cut
    points come from the batch's per-key counts, the dedups' sizes in one read, the
    gradients' finite check and the unlocks' lock check in one read each), and the caches
    resolve in lockstep (`resolve_together`: each phase's numbers and ids read once for all
    the caches)."""
    one, three, five = (_dims_counts(d, policy, load_factor, prefetch) for d in (1, 3, 5))
    assert one["forward"] <= MAX_FORWARD and one["step"] <= MAX_STEP, one
    assert one["backward"] <= 1, one
    assert one == three == five, f"1 dim: {one}\n3 dims: {three}\n5 dims: {five}"


@pytest.mark.parametrize(("policy", "load_factor"), [("lru", 0.1), ("lfu", 0.1)])
def test_step_syncs_do_not_grow_with_dims_with_misses(policy: str, load_factor: float) -> None:
    """With misses, dirty victims and scratch rows (no prefetch), the step and the backward
    already make the same host reads for 1, 3 and 5 dims."""
    counts = [_dims_counts(d, policy, load_factor, False) for d in (1, 3, 5)]
    assert len({(c["backward"], c["step"]) for c in counts}) == 1, counts
    assert counts[0]["step"] <= MAX_STEP, counts
