"""HotCache against a dense reference: invariants I1-I4 of docs/design.md.

Each run trains two tables through the cache with random batches (duplicates, batches larger
than the cache) and the same updates on a dense copy of the tables; every resolve must return
the dense copy's current rows (I1), every update lands once (I2), and after `flush()` the tier
equals the dense copy bit for bit (I3) for capacities from one row per set to the whole table.

The cache and the dense copy live on the ``device`` fixture's device (CUDA when present, with
the Triton kernels; `benchmarks/gpu_check.sh` runs this file there): both are updated by the
same row-update kernel, so bit equality holds on a GPU as well.
"""

from __future__ import annotations

import math
import threading
import warnings
import zlib

import pytest
import torch

from embcache.cache.config import CacheConfig, slot_bytes
from embcache.cache.hot_cache import HotCache
from embcache.cache.policy_registry import policy_names
from embcache.cache.sizing import CacheOverflowWarning
from embcache.kernels.optim import OptimRule, RowUpdate, apply_row_update, state_dim
from embcache.kv.base import TableSpec, default_init
from embcache.kv.host import HostKV

FUSION_K = 20
DIM = 5
SIZES = {"t0": 60, "t1": 37}
OFFSETS = {"t0": 0, "t1": 60}
TOTAL = sum(SIZES.values())

UPDATES = {
    "sgd": RowUpdate(OptimRule.SGD, lr=0.1),
    "adagrad": RowUpdate(OptimRule.ADAGRAD, lr=0.1, eps=1e-10),
    "rowwise_adagrad": RowUpdate(OptimRule.ROWWISE_ADAGRAD, lr=0.1, eps=1e-8),
    "adam": RowUpdate(OptimRule.ADAM, lr=0.01, eps=1e-8),
}


def make_specs(rule: OptimRule, unbounded: bool = False) -> list[tuple[int, TableSpec]]:
    specs = []
    for idx, (name, n) in enumerate(SIZES.items()):
        bounded = TableSpec(name, DIM, n, state_dim=state_dim(rule, DIM), state_init=0.0)
        if unbounded:
            # Same initial values as the bounded table, without a row count.
            bounded = TableSpec(
                name, DIM, None, state_dim=bounded.state_dim, init=default_init(bounded)
            )
        specs.append((idx, bounded))
    return specs


def make_cache(
    config: CacheConfig, rule: OptimRule, device: torch.device, store=None, unbounded=False
):
    store = store if store is not None else HostKV()
    specs = make_specs(rule, unbounded)
    for _, spec in specs:
        store.init_table(spec)
    return HotCache(specs, config, store, device, FUSION_K), store, specs


def dense_reference(specs, device: torch.device) -> torch.Tensor:
    """Every row of both tables, ``[TOTAL, DIM + state]`` on ``device``, as first created."""
    rows = [spec.initial_rows(torch.arange(SIZES[spec.name])) for _, spec in specs]
    return torch.cat(rows).to(device)


def random_batch(gen: torch.Generator, n_values: int) -> torch.Tensor:
    """Fused ids of a batch over both tables, Zipf-ish so some rows repeat across batches."""
    table = (torch.rand(n_values, generator=gen) < 0.4).long()
    size = torch.tensor([SIZES["t0"], SIZES["t1"]])[table]
    u = torch.rand(n_values, generator=gen)
    raw = (size.double() * u.pow(2.0)).long().clamp(max=size - 1)
    raw[0] = SIZES["t0"] - 1  # the last row of a table is always exercised
    table[0] = 0
    return raw | (table << FUSION_K)


def dense_index(fused: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Row of each fused id in the dense reference (on ``device``; default: the ids')."""
    table = fused >> FUSION_K
    raw = fused & ((1 << FUSION_K) - 1)
    return torch.where(table == 0, raw, raw + OFFSETS["t1"]).to(device or fused.device)


def train(
    cache: HotCache,
    dense: torch.Tensor,
    update: RowUpdate,
    steps: int,
    seed: int,
    defer_writeback: bool = False,
):
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        n_values = 200 if step % 4 == 0 else 24  # every 4th batch exceeds small caches
        unique = torch.unique(random_batch(gen, n_values))
        slots = cache.resolve(unique, defer_writeback=defer_writeback)
        rows = dense[dense_index(unique, dense.device)]
        assert torch.equal(cache.rows_of(slots), rows), f"I1: stale rows served at step {step}"
        grads = torch.randn(unique.numel(), DIM, generator=gen).to(dense.device)
        with cache.lock:
            apply_row_update(cache.weights, cache.state, slots, grads, update, step)
        cache.mark_dirty(slots)
        cache.unlock(slots)
        index = dense_index(unique, dense.device)
        apply_row_update(dense[:, :DIM], dense[:, DIM:], index, grads, update, step)


def all_rows(cache: HotCache) -> torch.Tensor:
    """Every slot's row (scratch included), weights then state."""
    return cache.rows_of(torch.arange(cache.weights.shape[0], device=cache.device))


def tier_rows(store, specs, device: torch.device) -> torch.Tensor:
    """Every row of both tables as the tier holds them, on ``device``."""
    rows = [store.get(spec.name, torch.arange(SIZES[spec.name])) for _, spec in specs]
    return torch.cat(rows).to(device)


CAPACITIES = {
    "one_row_per_set": dict(capacity=8, ways=1),
    "tiny_4way": dict(capacity=8, ways=4),
    "quarter": dict(capacity=24, ways=8),
    "half_32way": dict(capacity=48, ways=32),
    "whole_table": dict(capacity=TOTAL),
    "load_factor_1": dict(load_factor=1.0),
}


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("rule", list(UPDATES), ids=list(UPDATES))
@pytest.mark.parametrize("cap", list(CAPACITIES), ids=list(CAPACITIES))
def test_training_through_cache_equals_dense(
    device: torch.device, cap: str, rule: str, policy: str
) -> None:
    update = UPDATES[rule]
    config = CacheConfig(policy=policy, **CAPACITIES[cap])
    cache, store, specs = make_cache(config, update.rule, device)
    dense = dense_reference(specs, device)
    train(cache, dense, update, steps=12, seed=zlib.crc32(f"{cap}{rule}{policy}".encode()) % 1000)
    assert cache.locked_slots() == 0
    cache.flush()
    assert torch.equal(tier_rows(store, specs, device), dense), "I3: tier differs after flush"
    stats = cache.cache_stats()
    assert stats["hits"] + stats["misses"] > 0
    if cache.direct:
        assert stats["evictions"] == 0


def test_sgd_dense_reference_matches_float64(device: torch.device) -> None:
    """The dense float32 reference itself agrees with SGD done in float64."""
    update = UPDATES["sgd"]
    cache, store, specs = make_cache(CacheConfig(capacity=8, ways=2), update.rule, device)
    ref64 = dense_reference(specs, torch.device("cpu")).double()
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 6):
        unique = torch.unique(random_batch(gen, 30))
        slots = cache.resolve(unique)
        grads = torch.randn(unique.numel(), DIM, generator=gen)
        apply_row_update(cache.weights, cache.state, slots, grads.to(device), update, step)
        cache.mark_dirty(slots)
        cache.unlock(slots)
        ref64[dense_index(unique), :DIM] -= update.lr * grads.double()
    cache.flush()
    tier = tier_rows(store, specs, torch.device("cpu")).double()
    torch.testing.assert_close(tier, ref64, rtol=1e-6, atol=1e-6)


def test_training_with_triton_index_kernels(backend: str, device: torch.device) -> None:
    """The same run with the cache-index ops on each backend (Triton via the interpreter)."""
    update = UPDATES["sgd"]
    config = CacheConfig(capacity=12, ways=4, policy="lfu")
    cache, store, specs = make_cache(config, update.rule, device)
    dense = dense_reference(specs, device)
    train(cache, dense, update, steps=5, seed=11)
    cache.flush()
    assert torch.equal(tier_rows(store, specs, device), dense)


@pytest.mark.parametrize("policy", policy_names())
def test_hashed_ids_match_bounded_tables(device: torch.device, policy: str) -> None:
    update = UPDATES["adagrad"]
    results = []
    for unbounded in (False, True):
        config = CacheConfig(capacity=16, ways=4, policy=policy)
        cache, store, specs = make_cache(config, update.rule, device, unbounded=unbounded)
        dense = dense_reference(make_specs(update.rule), device)
        train(cache, dense, update, steps=8, seed=5)
        cache.flush()
        results.append(tier_rows(store, specs, device))
        assert torch.equal(results[-1], dense)
    assert torch.equal(results[0], results[1])


def test_locked_slots_are_never_victims(device: torch.device) -> None:
    cache, _, specs = make_cache(CacheConfig(capacity=8, ways=4), OptimRule.SGD, device)
    dense = dense_reference(specs, device)
    first = torch.arange(8, dtype=torch.int64)
    held = cache.resolve(first)  # locked
    held_keys = cache.slot_keys[held].clone()
    held_rows = cache.rows_of(held).clone()
    # A second batch of 30 other ids, unlocked resolve: all of it must go around the held slots.
    second = torch.arange(8, 38, dtype=torch.int64)
    slots = cache.resolve(second, lock=False)
    assert torch.equal(cache.slot_keys[held], held_keys), "I4: a locked slot was evicted"
    assert torch.equal(cache.rows_of(held), held_rows)
    assert set(slots.tolist()).isdisjoint(held.tolist())
    assert torch.equal(cache.rows_of(slots), dense[second.to(device)]), "overflow rows served wrong"
    assert bool((slots >= cache.num_slots).all()), "every way is locked: all go to scratch"
    # read() finds rows in slots, in scratch and in the tier alike, and changes nothing.
    everywhere = torch.cat([first, second, torch.tensor([50, 7 | (1 << FUSION_K)])])
    keys_before = cache.slot_keys.clone()
    assert torch.equal(cache.read(everywhere), dense[dense_index(everywhere, device)])
    assert torch.equal(cache.slot_keys, keys_before)
    cache.release()
    cache.unlock(held)
    assert cache.locked_slots() == 0
    assert cache._scratch_used == 0


def test_batch_larger_than_cache_is_exact_and_stats_add_up(device: torch.device) -> None:
    update = UPDATES["rowwise_adagrad"]
    cache, store, specs = make_cache(CacheConfig(capacity=4, ways=4), update.rule, device)
    dense = dense_reference(specs, device)
    looked_up = 0
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        unique = torch.unique(random_batch(gen, 300))
        assert unique.numel() > 4 * 5
        looked_up += unique.numel()
        slots = cache.resolve(unique)
        assert torch.equal(cache.rows_of(slots), dense[dense_index(unique, device)])
        grads = torch.randn(unique.numel(), DIM, generator=gen).to(device)
        apply_row_update(cache.weights, cache.state, slots, grads, update, step)
        cache.mark_dirty(slots)
        cache.unlock(slots)
        index = dense_index(unique, device)
        apply_row_update(dense[:, :DIM], dense[:, DIM:], index, grads, update, step)
    stats = cache.cache_stats()
    assert stats["hits"] + stats["misses"] == looked_up
    assert math.isclose(stats["hit_rate"], stats["hits"] / looked_up)
    cache.flush()
    assert torch.equal(tier_rows(store, specs, device), dense)
    cache.reset_stats()
    assert cache.cache_stats()["hits"] == 0


def test_batch_beyond_cache_and_scratch_is_refused_cleanly(device: torch.device) -> None:
    config = CacheConfig(capacity=4, ways=4, max_scratch_rows=3)
    cache, store, _ = make_cache(config, OptimRule.SGD, device)
    cache.resolve(torch.tensor([1, 2]), lock=False)
    before = (cache.slot_keys.clone(), all_rows(cache).clone(), store.io_stats()["rows_read"])
    with pytest.raises(ValueError, match=r"max_scratch_rows>=\d+"):
        cache.resolve(torch.arange(10, 20))
    assert torch.equal(cache.slot_keys, before[0])
    assert torch.equal(all_rows(cache), before[1])
    assert store.io_stats()["rows_read"] == before[2], "no row may be read for a refused batch"
    assert cache.locked_slots() == 0


class FlakyStore(HostKV):
    """HostKV whose writes fail while `down` is set, as a tier that lost its connection."""

    down = False

    def put(self, table, ids, rows):
        if self.down:
            raise ConnectionError("tier unavailable")
        super().put(table, ids, rows)


def test_failed_write_back_loses_nothing(device: torch.device) -> None:
    update = UPDATES["sgd"]
    store = FlakyStore()
    config = CacheConfig(capacity=4, ways=2)
    cache, store, specs = make_cache(config, update.rule, device, store=store)
    dense = dense_reference(specs, device)
    train(cache, dense, update, steps=3, seed=1)
    store.down = True
    state = (cache.slot_keys.clone(), cache.dirty.clone(), all_rows(cache).clone())
    with pytest.raises(ConnectionError):
        cache.resolve(torch.arange(30, 50))  # must evict dirty rows: the write fails
    assert torch.equal(cache.slot_keys, state[0])
    assert torch.equal(cache.dirty, state[1]), "dirty rows must stay dirty"
    assert torch.equal(all_rows(cache), state[2])
    with pytest.raises(ConnectionError):
        cache.flush()
    store.down = False
    cache.flush()
    assert torch.equal(tier_rows(store, specs, device), dense)


@pytest.mark.parametrize("cap", ["one_row_per_set", "tiny_4way", "quarter"])
def test_deferred_write_back_equals_dense(device: torch.device, cap: str) -> None:
    """Resolves that leave their victims' write for later serve the same rows as the dense
    copy (a row evicted by one resolve and read back by the next comes from the staged write,
    made first), and after `flush` the tier equals it (I1, I3)."""
    update = UPDATES["adagrad"]
    cache, store, specs = make_cache(CacheConfig(**CAPACITIES[cap]), update.rule, device)
    dense = dense_reference(specs, device)
    train(cache, dense, update, steps=12, seed=21, defer_writeback=True)
    assert cache.writebacks > 0
    cache.flush()
    assert not cache._deferred
    assert torch.equal(tier_rows(store, specs, device), dense)


def _evict_dirty_rows(cache: HotCache, dense: torch.Tensor, update: RowUpdate):
    """Train a few batches, then resolve (deferring the write) a batch that evicts dirty
    rows; returns the victims' fused ids, read off the slots before the resolve."""
    train(cache, dense, update, steps=3, seed=1)
    cache.release()  # scratch rows of the last batch are written now, not by the resolve
    ways = slice(0, cache.num_slots)
    keys_before = cache.slot_keys[ways].clone()
    dirty_before = cache.dirty[ways].clone()
    slots = cache.resolve(torch.arange(30, 50), defer_writeback=True)
    cache.unlock(slots)
    replaced = (cache.slot_keys[ways] != keys_before) & (keys_before >= 0) & dirty_before
    victims = keys_before[replaced]
    assert victims.numel(), "the batch must evict dirty rows"
    return victims


def test_deferred_write_back_waits_for_write_deferred(device: torch.device) -> None:
    """On a CPU over an in-process tier the victims' rows are in neither the cache nor the
    tier until `write_deferred`, which writes them (once); elsewhere the resolve wrote them."""
    update = UPDATES["sgd"]
    cache, store, specs = make_cache(CacheConfig(capacity=8, ways=2), update.rule, device)
    dense = dense_reference(specs, device)
    victims = _evict_dirty_rows(cache, dense, update)

    def tier_of(ids):
        return torch.cat([
            store.get(specs[int(t)][1].name, ids[ids >> FUSION_K == t] & ((1 << FUSION_K) - 1))
            for t in torch.unique(ids >> FUSION_K)
        ]).to(device)  # fmt: skip

    by_table = [victims[victims >> FUSION_K == t] for t in torch.unique(victims >> FUSION_K)]
    victims = torch.cat(by_table)  # in `tier_of`'s order
    wanted = dense[dense_index(victims, device)]
    if cache.transfer.grouped:
        assert sum(len(staged) for staged in cache._deferred) == victims.numel()
        assert not torch.equal(tier_of(victims), wanted), "the write was not deferred"
        written = store.io_stats()["rows_written"]
        cache.write_deferred()
        assert store.io_stats()["rows_written"] == written + victims.numel()
        cache.write_deferred()  # nothing left: no second write
        assert store.io_stats()["rows_written"] == written + victims.numel()
    assert not cache._deferred
    assert torch.equal(tier_of(victims), wanted)


@pytest.mark.parametrize("reader", ["resolve", "read", "flush"])
def test_deferred_write_back_is_made_before_the_tier_is_read(
    device: torch.device, reader: str
) -> None:
    """Whatever reads the tier through the cache next makes the staged write first: the
    evicted rows come back with their trained values."""
    update = UPDATES["sgd"]
    cache, store, specs = make_cache(CacheConfig(capacity=8, ways=2), update.rule, device)
    dense = dense_reference(specs, device)
    victims = _evict_dirty_rows(cache, dense, update)
    wanted = dense[dense_index(victims, device)]
    if reader == "resolve":
        slots = cache.resolve(torch.unique(victims))
        got = cache.rows_of(slots)
        cache.unlock(slots)
        wanted = dense[dense_index(torch.unique(victims), device)]
    elif reader == "read":
        got = cache.read(victims)
    else:
        cache.flush()
        got = tier_rows(store, specs, device)[dense_index(victims, device)]
    assert not cache._deferred
    assert torch.equal(got, wanted)


def test_failed_deferred_write_back_loses_nothing(device: torch.device) -> None:
    """A staged write that fails stays staged: the next resolve raises before it changes
    anything, and once the tier is back the rows reach it."""
    update = UPDATES["sgd"]
    store = FlakyStore()
    cache, store, specs = make_cache(CacheConfig(capacity=8, ways=2), update.rule, device, store)
    dense = dense_reference(specs, device)
    _evict_dirty_rows(cache, dense, update)
    if not cache.transfer.grouped:
        assert not cache._deferred  # nothing to defer there: the resolve wrote them
        return
    store.down = True
    state = (cache.slot_keys.clone(), cache.dirty.clone(), all_rows(cache).clone())
    with pytest.raises(ConnectionError):
        cache.resolve(torch.arange(0, 12))
    with pytest.raises(ConnectionError):
        cache.write_deferred()
    assert torch.equal(cache.slot_keys, state[0])
    assert torch.equal(cache.dirty, state[1])
    assert torch.equal(all_rows(cache), state[2])
    assert cache._deferred
    store.down = False
    cache.flush()
    assert torch.equal(tier_rows(store, specs, device), dense)


def test_invalidate_and_set_state(device: torch.device) -> None:
    cache, store, specs = make_cache(CacheConfig(capacity=8, ways=4), OptimRule.SGD, device)
    dense = dense_reference(specs, device)
    train(cache, dense, UPDATES["sgd"], steps=3, seed=2)
    cache.invalidate()
    assert bool((cache.slot_keys < 0).all())
    assert torch.equal(tier_rows(store, specs, device), dense)
    cache.set_state(state_dim(OptimRule.ADAGRAD, DIM), 0.5)
    assert cache.width == 2 * DIM
    ids = torch.tensor([3, 7 | (1 << FUSION_K)])
    rows = cache.read(ids)
    assert torch.equal(rows[:, :DIM], dense[dense_index(ids, device), :DIM])
    assert bool((rows[:, DIM:] == 0.5).all())


@pytest.mark.parametrize("cap", ["tiny_4way", "whole_table"])
def test_write_weights_wherever_the_row_lives(device: torch.device, cap: str) -> None:
    """`write_weights` changes a resident row in its slot (dirty, so flush keeps it), a row in
    the scratch area likewise, and any other row in the tier; the state columns stay."""
    cache, store, specs = make_cache(CacheConfig(**CAPACITIES[cap]), OptimRule.ADAGRAD, device)
    dense = dense_reference(specs, device)
    train(cache, dense, UPDATES["adagrad"], steps=6, seed=4)
    locked = cache.resolve(torch.unique(random_batch(torch.Generator().manual_seed(9), 200)))
    gen = torch.Generator().manual_seed(5)
    ids = torch.unique(random_batch(gen, 40))
    resident = torch.isin(ids, cache.slot_keys.cpu())
    assert bool(resident.any()) and (cap == "whole_table" or not bool(resident.all()))
    rows = torch.randn(ids.numel(), DIM, generator=gen)
    cache.write_weights(ids, rows)
    dense[dense_index(ids, device), :DIM] = rows.to(device)
    assert torch.equal(cache.read(ids), dense[dense_index(ids, device)])
    cache.unlock(locked)
    cache.flush()
    assert torch.equal(tier_rows(store, specs, device), dense)


def test_locked_invalidate_and_bad_unlock_raise(device: torch.device) -> None:
    cache, _, _ = make_cache(CacheConfig(capacity=8, ways=4), OptimRule.SGD, device)
    slots = cache.resolve(torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match="locked"):
        cache.invalidate()
    cache.unlock(slots)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(slots)


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["compiled", "torch"])
def test_an_unlock_that_meets_a_slot_not_locked_drops_no_lock(monkeypatch, backend: str) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    cache, _, _ = make_cache(CacheConfig(capacity=8, ways=4), OptimRule.SGD, torch.device("cpu"))
    slots = cache.resolve(torch.tensor([1, 2, 3]))
    free = next(s for s in range(cache.num_slots) if s not in slots.tolist())
    locks = cache.locks.clone()
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(torch.cat([slots[:2], torch.tensor([free])]))
    assert torch.equal(cache.locks, locks)
    cache.unlock(slots)
    assert cache.locked_slots() == 0


@pytest.mark.parametrize("admit_after", [None, 2], ids=["every id", "admission"])
@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["compiled", "torch"])
def test_unlock_with_dirty_is_mark_dirty_then_unlock(
    monkeypatch, backend: str, admit_after: int | None
) -> None:
    """``unlock(slots, dirty=True)`` (the TBE step's release after its update) leaves the
    locks and dirty flags exactly as `mark_dirty` then `unlock` do, on twin caches fed the same
    batches, and counts the gradients of ids not admitted (slot -1) as dropped as `mark_dirty`
    does; a slot not locked raises and changes neither locks nor flags."""
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    gen = torch.Generator().manual_seed(11)
    config = CacheConfig(capacity=32, ways=4, admit_after=admit_after)
    twins = [make_cache(config, OptimRule.SGD, torch.device("cpu"))[0] for _ in range(2)]
    for _ in range(6):
        ids = torch.randint(0, SIZES["t0"], (12,), generator=gen).unique()
        a, b = (cache.resolve(ids) for cache in twins)
        assert torch.equal(a, b)
        twins[0].mark_dirty(a)
        twins[0].unlock(a)
        twins[1].unlock(b, dirty=True)
        for name in ("locks", "dirty", "slot_keys"):
            assert torch.equal(getattr(twins[0], name), getattr(twins[1], name)), name
        assert twins[0].cache_stats() == twins[1].cache_stats()
    assert bool(twins[1].dirty.any()) and twins[1].locked_slots() == 0
    if admit_after is not None:  # some ids were seen once only: their updates were dropped
        assert twins[1].cache_stats()["gradients_dropped"] > 0
    cache = twins[1]
    slots = cache.resolve(torch.tensor([1, 2, 3]))
    free = next(s for s in range(cache.num_slots) if s not in slots.tolist() and not cache.dirty[s])
    locks, dirty = cache.locks.clone(), cache.dirty.clone()
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(torch.cat([slots[:2], torch.tensor([free])]), dirty=True)
    assert torch.equal(cache.locks, locks) and torch.equal(cache.dirty, dirty)


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["compiled", "torch"])
@pytest.mark.parametrize(
    "bad",
    [SIZES["t0"], (1 << FUSION_K) + SIZES["t1"], 5 << FUSION_K, -3],
    ids=["past t0's rows", "past t1's rows", "no such table", "negative"],
)
def test_resolve_refuses_an_id_that_is_no_row_and_changes_nothing(
    monkeypatch, backend: str, bad: int
) -> None:
    """A fused id past its table's rows, of a table index the cache does not hold, or negative,
    given to `resolve` directly: a ValueError naming it and its position, and the cache is as
    it was (on the compiled path the plan would otherwise read the row index out of bounds)."""
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    cache, _, _ = make_cache(CacheConfig(capacity=32, ways=4), OptimRule.SGD, torch.device("cpu"))
    cache.unlock(cache.resolve(torch.tensor([1, 2, (1 << FUSION_K) + 3])))
    before = {name: getattr(cache, name).clone() for name in ("slot_keys", "locks", "dirty")}
    stats = cache.cache_stats()
    with pytest.raises(ValueError, match=rf"id {bad} at position 2 .* no row"):
        cache.resolve(torch.tensor([4, 5, bad, 6]))
    for name, value in before.items():
        assert torch.equal(getattr(cache, name), value), name
    assert cache.cache_stats() == stats
    cache.unlock(cache.resolve(torch.tensor([SIZES["t0"] - 1, (1 << FUSION_K) + SIZES["t1"] - 1])))


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="capacity or load_factor"):
        CacheConfig(capacity=4, load_factor=0.5)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        CacheConfig(capacity=0)
    with pytest.raises(ValueError, match="'lru' or 'lfu'"):
        CacheConfig(policy="fifo")
    with pytest.raises(ValueError, match="load_factor"):
        CacheConfig(load_factor=1.5)
    with pytest.raises(ValueError, match="explicit capacity"):
        CacheConfig(load_factor=0.5).rows_for(None)


class RemoteLikeStore(HostKV):
    """HostKV that declares ``parallel_io`` (as RedisKV does) and records the calling threads."""

    parallel_io = True

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()

    def get(self, table, ids):
        self.threads.add(threading.current_thread().name)
        return super().get(table, ids)

    def put(self, table, ids, rows):
        self.threads.add(threading.current_thread().name)
        super().put(table, ids, rows)


@pytest.mark.parametrize("policy", policy_names())
def test_concurrent_tier_calls_are_exact(device: torch.device, policy: str) -> None:
    """With a tier whose calls overlap, write-backs and reads of all tables go out together,
    on the cache's I/O threads; the numbers are the dense reference's."""
    update = UPDATES["adam"]
    store = RemoteLikeStore()
    config = CacheConfig(capacity=8, ways=2, policy=policy)
    cache, store, specs = make_cache(config, update.rule, device, store=store)
    dense = dense_reference(specs, device)
    train(cache, dense, update, steps=10, seed=4)
    cache.flush()
    assert torch.equal(tier_rows(store, specs, device), dense)
    assert any(name.startswith("embcache-tier") for name in store.threads), store.threads


# -- sizes at real scale ------------------------------------------------------------------------


def _one_table(rows: int, dim: int) -> tuple[list[tuple[int, TableSpec]], HostKV]:
    store = HostKV()
    spec = TableSpec("big", dim, rows)
    store.init_table(spec)
    return [(0, spec)], store


def test_default_cache_keeps_to_its_memory_budget_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 2**22 x 64 table does not fit the 1 GiB default budget (slots counted with Adam's
    state): the cache takes the rows that fit, and one log line says which load factor."""
    specs, store = _one_table(1 << 22, 64)
    with caplog.at_level("WARNING", logger="embcache.cache"):
        cache = HotCache(specs, CacheConfig(), store, "cpu", 30)
    assert not cache.direct
    assert cache.num_slots < 1 << 22
    assert cache.num_slots * slot_bytes(3 * 64) <= (1 << 30) + cache.ways * slot_bytes(3 * 64)
    assert cache.weights.nbytes + cache.state.nbytes < 1 << 30
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "memory budget" in said[0] and "load factor 0.32" in said[0], said
    # A budget of one's own; a table that fits it is cached whole, silently.
    caplog.clear()
    specs, store = _one_table(10_000, 8)
    with caplog.at_level("WARNING", logger="embcache.cache"):
        small = HotCache(specs, CacheConfig(memory_budget=1 << 20), store, "cpu", 30)
        whole = HotCache(specs, CacheConfig(), store, "cpu", 30)
    assert small.num_slots * slot_bytes(24) <= (1 << 20) + small.ways * slot_bytes(24)
    assert not small.direct and whole.direct and whole.num_slots == 10_000
    assert len(caplog.records) == 1


def test_a_cache_the_device_cannot_hold_is_refused_before_allocating() -> None:
    specs = [(0, TableSpec("big", 64, 1 << 40))]  # never declared: the store is not asked
    store = HostKV()
    with pytest.raises(ValueError, match=r"needs [\d,]+ bytes of cpu memory .* more than"):
        HotCache(specs, CacheConfig(capacity=1 << 36), store, "cpu", 41)
    exact = CacheConfig(capacity=1024, policy="lfu", lfu_counters="exact")
    with pytest.raises(ValueError, match="LFU counts"):  # LFU counts one per row of the table
        HotCache(specs, exact, store, "cpu", 41)
    # By default a table that large counts in a count-min sketch of bounded size instead.
    sketched = HotCache(specs, CacheConfig(capacity=1024, policy="lfu"), store, "cpu", 41)
    assert sketched.counter_bytes == 4 * 4 * (1 << 20)
    with pytest.raises(ValueError, match="memory_budget must be an int >= 1"):
        CacheConfig(memory_budget=0)


def test_a_batch_wider_than_the_cache_warns_once(device: torch.device) -> None:
    cache, _, _ = make_cache(CacheConfig(capacity=8, ways=4), OptimRule.SGD, device)
    with pytest.warns(CacheOverflowWarning, match=r"20 unique rows .* 8 slots"):
        cache.unlock(cache.resolve(torch.arange(20)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.unlock(cache.resolve(torch.arange(20, 40)))  # said once per cache
        cache.unlock(cache.resolve(torch.arange(4)))


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("capacity", [8, 32], ids=["cap8", "cap32"])
def test_stats_and_rows_are_the_same_with_and_without_prefetch(
    device: torch.device, policy: str, capacity: int
) -> None:
    """Prefetch resolves batch i+1 before batch i's step (i's rows still locked); without it
    batch i is stepped first. Each counter must come out the same either way, as the rows do."""
    update = UPDATES["adagrad"]
    gen = torch.Generator().manual_seed(3)
    batches = [torch.unique(random_batch(gen, 40 if i % 3 else 120)) for i in range(12)]
    grads = [torch.randn(b.numel(), DIM, generator=gen).to(device) for b in batches]

    def step(cache: HotCache, i: int, slots: torch.Tensor) -> None:
        with cache.lock:
            apply_row_update(cache.weights, cache.state, slots, grads[i], update, i + 1)
        cache.mark_dirty(slots)
        cache.unlock(slots)

    def run(prefetch: bool) -> tuple[dict[str, float], torch.Tensor]:
        config = CacheConfig(capacity=capacity, ways=4, policy=policy)
        cache, store, specs = make_cache(config, update.rule, device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheOverflowWarning)
            ahead = cache.resolve(batches[0]) if prefetch else None
            for i in range(len(batches)):
                slots = ahead if prefetch else cache.resolve(batches[i])
                if prefetch and i + 1 < len(batches):
                    ahead = cache.resolve(batches[i + 1])  # while batch i is in flight
                step(cache, i, slots)
        stats = cache.cache_stats()
        cache.flush()
        return stats, tier_rows(store, specs, device)

    (with_stats, with_rows), (without_stats, without_rows) = run(True), run(False)
    assert torch.equal(with_rows, without_rows)
    assert with_stats == without_stats
    assert with_stats["evictions"] > 0 and with_stats["writebacks"] > 0
    assert with_stats["writebacks"] <= with_stats["evictions"], "a write-back is of an eviction"


@pytest.mark.parametrize("n_values", [50, 5], ids=["map", "few-values"])
def test_serve_direct_counts_and_marks_the_rows_of_each_batch(
    device: torch.device, n_values: int
) -> None:
    """`serve_direct` loads every row once and counts a batch's distinct rows as hits (through
    a map of the cache's slots, or for a batch of few values through the values alone);
    `mark_dirty_direct` marks exactly that batch's rows, also once another batch was served
    since (then from its slots); `hold` locks like a resolve."""
    cache, store, _ = make_cache(CacheConfig(), OptimRule.SGD, device)
    assert cache.direct and cache.direct_bases() == {0: 0, 1: SIZES["t0"]}
    gen = torch.Generator().manual_seed(8)
    first, second = (
        torch.randint(0, TOTAL, (n_values,), generator=gen).to(device) for _ in range(2)
    )
    first[-1] = first[0]  # a repeat in each
    second[-1] = second[0]
    n_first = cache.serve_direct(first)
    n_second = cache.serve_direct(second)
    assert (cache.direct_map.seen_batch == n_second) == (n_values * 8 >= TOTAL)
    distinct = torch.unique(first).numel() + torch.unique(second).numel()
    assert cache.cache_stats()["hits"] == distinct and cache.cache_stats()["misses"] == 0
    assert torch.equal(cache.slot_keys[: SIZES["t0"]].cpu(), torch.arange(SIZES["t0"]))
    assert store.row_count("t0") == store.row_count("t1") == 0  # loaded, nothing created
    assert not bool(cache.dirty.any())
    cache.mark_dirty_direct(first, n_first)  # another batch was served since
    assert cache.dirty.nonzero().squeeze(1).tolist() == torch.unique(first).tolist()
    cache.mark_dirty_direct(second, n_second)
    both = torch.unique(torch.cat([first, second]))
    assert cache.dirty.nonzero().squeeze(1).tolist() == both.tolist()
    cache.flush()
    assert cache.cache_stats()["writebacks"] == both.numel()
    assert store.row_count("t0") + store.row_count("t1") == both.numel()
    cache.hold(torch.unique(second))
    assert cache.locked_slots() == torch.unique(second).numel()
    cache.unlock(torch.unique(second))
    assert cache.locked_slots() == 0
    small, _, _ = make_cache(CacheConfig(capacity=8, ways=4), OptimRule.SGD, device)
    with pytest.raises(RuntimeError, match="directly"):
        small.serve_direct(first)
