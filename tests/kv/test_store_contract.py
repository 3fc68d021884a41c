"""The `Store` contract (`embcache.kv.contract`), run for every built-in tier.

`HostKV` with a dense table (`TestHostDense`) and an unbounded table of hashed 64-bit ids
(`TestHostHashed`), `HostKV` with a row budget (`TestHostBounded`: tables with
``TableSpec.capacity``), `TieredKV` (a small host row cache in front of a `HostKV`, so its
evictions and write-backs run), `RedisKV` on a real ``redis-server`` (`TestRedis`) and on a
real Redis Cluster (`TestRedisCluster`: the core tests only, it is the slowest). What every
tier promises is in `embcache.kv.base.Store`; a tier's own behaviour has its own test file
beside this one, and the bounded tables' pins are tested below for the tiers that bound them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from embcache.kv.base import Store, TableSpec
from embcache.kv.contract import (
    DIM,
    NUM,
    STATE,
    ContractTier,
    StoreContract,
    StoreCoreContract,
    exported,
    random_rows,
    same,
)
from embcache.kv.host import HostKV
from embcache.kv.tiered import TieredKV
from tests.kv.redis_servers import RedisClusterNodes, RedisServer, running_cluster, running_server


class TestHostDense(StoreContract):
    @pytest.fixture
    def tier(self) -> ContractTier:
        return ContractTier(lambda: HostKV(pin_memory=False))


class TestHostHashed(StoreContract):
    @pytest.fixture
    def tier(self) -> ContractTier:
        return ContractTier(lambda: HostKV(pin_memory=False), hashed=True)


class TestHostBounded(StoreContract):
    @pytest.fixture
    def tier(self) -> ContractTier:
        # A budget above every call's rows here: the contract holds, nothing evicted yet.
        return ContractTier(lambda: HostKV(pin_memory=False), capacity=64)


class TestTiered(StoreContract):
    @pytest.fixture
    def tier(self) -> ContractTier:
        return ContractTier(lambda: TieredKV(HostKV(pin_memory=False), capacity_rows=8))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("contract-redis")) as started:
        yield started


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    with running_cluster(tmp_path_factory.mktemp("contract-cluster")) as started:
        yield started


def _redis_tier(url: str) -> ContractTier:
    """Stores on the Redis at ``url``, a namespace per store opened (every test starts
    empty); reopening keeps the last one's."""
    from embcache.kv.redis_kv import RedisKV

    names: list[str] = []

    def open_store() -> Store:
        names.append(f"contract-{uuid.uuid4().hex[:12]}")
        return RedisKV(url, namespace=names[-1])

    def reopen(old: Store) -> Store:
        old.close()  # releases its leases: the new client takes the tables
        return RedisKV(url, namespace=names[-1])

    return ContractTier(open_store, reopen=reopen)


class TestRedis(StoreContract):
    @pytest.fixture
    def tier(self, redis_server: RedisServer) -> ContractTier:
        return _redis_tier(redis_server.url)


class TestRedisCluster(StoreCoreContract):
    @pytest.fixture
    def tier(self, redis_cluster: RedisClusterNodes) -> ContractTier:
        return _redis_tier(redis_cluster.url)


# -- bounded tables: the tiers that take TableSpec.capacity -------------------------------------


@pytest.mark.parametrize("make", ["host", "tiered"])
def test_a_bounded_table_keeps_its_budget_and_never_drops_a_pinned_row(make: str) -> None:
    store: Store = HostKV(pin_memory=False)
    if make == "tiered":
        store = TieredKV(store, capacity_rows=8)
    spec = TableSpec("t", DIM, NUM, state_dim=STATE, capacity=16)
    store.init_table(spec)
    pinned = torch.arange(4)
    kept = random_rows(spec, 4, seed=24)
    store.put("t", pinned, kept)
    store.get("t", pinned, pin=True)
    for start in range(4, NUM, 6):  # many more rows than the budget
        ids = torch.arange(start, min(start + 6, NUM))
        store.put("t", ids, random_rows(spec, ids.numel(), seed=start))
        assert store.row_count("t") <= 16
    assert same(store.get("t", pinned), kept)
    assert store.io_stats()["tier_evictions"] > 0
    ids, _ = exported(store, "t")
    gone = torch.tensor(sorted(set(range(4, NUM)) - set(ids.tolist()))[:3])
    assert same(store.read("t", gone), spec.initial_rows(gone))  # an evicted row starts over
    store.unpin("t", pinned)
    store.close()


@pytest.mark.parametrize("make", ["host", "tiered"])
def test_a_read_pins_the_bounded_rows_that_exist_only(make: str) -> None:
    """``read(..., pin=True)`` of a bounded table pins the rows that exist (never evicted
    until `unpin`) and creates none; the absent ones stay absent and unpinned."""
    store: Store = HostKV(pin_memory=False)
    if make == "tiered":
        store = TieredKV(store, capacity_rows=8)
    spec = TableSpec("t", DIM, NUM, state_dim=STATE, capacity=16)
    store.init_table(spec)
    kept = random_rows(spec, 4, seed=33)
    store.put("t", torch.arange(4), kept)
    got = store.read("t", torch.arange(8), pin=True)
    assert same(got, torch.cat([kept, spec.initial_rows(torch.arange(4, 8))]))
    assert store.row_count("t") == 4
    for start in range(8, NUM, 6):  # many more rows than the budget: the pinned four stay
        ids = torch.arange(start, min(start + 6, NUM))
        store.put("t", ids, random_rows(spec, ids.numel(), seed=start))
    assert same(store.read("t", torch.arange(4)), kept)
    store.unpin("t", torch.arange(8))
    store.close()
