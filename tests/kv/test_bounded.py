"""Bounded tables: at most ``capacity`` rows, evicting the unpinned rows of lowest score (LRU,
LFU), never a pinned one; an evicted row comes back from its initialiser. The index alone
(`BoundedIndex`) against a plain-Python model of the same buckets, then `HostKV` and `TieredKV`
(over HostKV, over a real Redis) with bounded tables, rows in each precision."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from embcache.kv.base import ScorePolicy, Store, TableSpec
from embcache.kv.bounded import BoundedIndex, TierCapacityError
from embcache.kv.errors import TierConfigError, TierFullError
from embcache.kv.host import HostKV
from embcache.kv.redis_kv import RedisKV
from embcache.kv.tiered import TieredKV
from tests.kv.redis_servers import RedisServer, running_server

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


# ----------------------------------------------------------------------------------------------
# BoundedIndex against a model: per bucket, a dict id -> (score, pins)
# ----------------------------------------------------------------------------------------------


class ModelIndex:
    """The documented behaviour, written plainly: buckets of ``ways`` ids; a new id takes a
    free way, else evicts the unpinned id of lowest (score, id) that the same call neither
    uses nor brought in; LRU scores are a clock bumped per stamping call, LFU scores count
    uses."""

    def __init__(self, index: BoundedIndex) -> None:
        self.index = index
        self.buckets: dict[int, dict[int, list[int]]] = {}
        self.clock = 0

    def bucket(self, i: int) -> dict[int, list[int]]:
        b = int(self.index.buckets(torch.tensor([i]))[0])
        return self.buckets.setdefault(b, {})

    def insert(self, ids: list[int], guard: set[int]) -> list[int]:
        evicted = []
        guard = guard | set(ids)
        lru = self.index.policy is ScorePolicy.LRU
        if lru:
            self.clock += 1
        for i in sorted(ids, key=lambda i: int(self.index.buckets(torch.tensor([i]))[0])):
            b = self.bucket(i)
            if len(b) == self.index.ways:
                victims = [(s, k) for k, (s, p) in b.items() if p == 0 and k not in guard]
                _, victim = min(victims)
                del b[victim]
                evicted.append(victim)
            b[i] = [self.clock if lru else 0, 0]
        return evicted

    def entry(self, i: int) -> list[int]:
        return self.bucket(i)[i]

    def touch(self, ids: list[int]) -> None:
        if self.index.policy is ScorePolicy.LRU:
            self.clock += 1
            for i in ids:
                self.entry(i)[0] = self.clock
        else:
            for i in ids:
                self.entry(i)[0] += 1

    def held(self) -> dict[int, list[int]]:
        return {k: v for b in self.buckets.values() for k, v in b.items()}


@pytest.mark.parametrize("policy", list(ScorePolicy), ids=lambda p: p.value)
def test_bounded_index_matches_its_model(policy: ScorePolicy) -> None:
    """Random calls of find/insert/touch/pin/unpin: the index holds the model's ids with the
    model's scores and pins, evicts what it evicts, and never holds more than its capacity."""
    gen = torch.Generator().manual_seed(int(policy == ScorePolicy.LFU))
    index = BoundedIndex(capacity=24, policy=policy, ways=4)  # 6 buckets of 4
    model = ModelIndex(index)
    universe = torch.randperm(200, generator=gen)[:60] * 1009 + 7
    for _ in range(300):
        batch = universe[torch.randperm(60, generator=gen)[:5]]
        positions = index.find(batch)
        held = positions >= 0
        assert held.tolist() == [int(i) in model.held() for i in batch.tolist()]
        new = batch[~held]
        try:
            _, evicted = index.insert(new, positions[held])
        except TierCapacityError:  # every way of a bucket pinned: refused, nothing changed
            assert index.count == len(model.held())
            continue
        got = sorted(evicted.tolist())
        assert got == sorted(model.insert(new.tolist(), set(batch[held].tolist())))
        positions = index.find(batch)
        action = int(torch.randint(0, 3, (), generator=gen))
        if action == 0:
            index.touch(positions)
            model.touch(batch.tolist())
        elif action == 1:
            index.pin(positions)
            for i in batch.tolist():
                model.entry(i)[1] += 1
        else:
            index.unpin(positions)
            for i in batch.tolist():
                model.entry(i)[1] = max(model.entry(i)[1] - 1, 0)
            model.touch(batch.tolist())
        assert len(index) == len(model.held()) <= index.capacity
        ids, where = index.items()
        assert ids.tolist() == sorted(model.held())
        if policy is ScorePolicy.LFU:
            assert index.scores[where].tolist() == [model.held()[i][0] for i in ids.tolist()]
        assert index.pins[where].tolist() == [model.held()[i][1] for i in ids.tolist()]


def test_a_bucket_of_pinned_rows_refuses_new_ones_and_changes_nothing() -> None:
    index = BoundedIndex(capacity=4, policy=ScorePolicy.LRU, ways=4)  # one bucket
    first = torch.tensor([1, 2, 3, 4])
    positions, _ = index.insert(first, first[:0])
    index.pin(positions)
    before = (index.keys.clone(), index.scores.clone(), index.pins.clone())
    with pytest.raises(TierCapacityError, match="4 of its rows are pinned by readers"):
        index.insert(torch.tensor([5]), first[:0])
    with pytest.raises(TierCapacityError, match="no room for the 5 new rows one call brings"):
        BoundedIndex(capacity=4, policy=ScorePolicy.LFU, ways=4).insert(
            torch.arange(10, 15), first[:0]
        )
    after = (index.keys, index.scores, index.pins)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    index.unpin(positions[:1])  # id 1 released: it goes first
    _, evicted = index.insert(torch.tensor([5]), first[:0])
    assert evicted.tolist() == [1]


# ----------------------------------------------------------------------------------------------
# stores with bounded tables
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path) as started:
        yield started


def make_store(kind: str, request: pytest.FixtureRequest) -> Store:
    if kind == "host":
        return HostKV(pin_memory=False)
    if kind == "tiered-host":
        return TieredKV(HostKV(pin_memory=False), capacity_rows=16)
    redis = request.getfixturevalue("server")
    return TieredKV(RedisKV(redis.url, namespace="bounded"), capacity_rows=16)


KINDS = ["host", "tiered-host", "tiered-redis"]


def bounded_spec(dtype: torch.dtype = torch.float32, **kwargs: object) -> TableSpec:
    fields = {"dim": 3, "num_embeddings": None, "state_dim": 2, "state_init": 0.5,
              "capacity": 64, "score": "lru", "dtype": dtype, **kwargs}  # fmt: skip
    return TableSpec("t", **fields)  # type: ignore[arg-type]


def ids_of(store: Store) -> list[int]:
    return sorted(i for chunk in store.export_rows("t") for i in chunk[0].tolist())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_bounded_table_stays_under_capacity_and_never_evicts_pinned_rows(
    kind: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    """A stream of 2,000 new ids through a table of 64 rows: it never holds more, counts its
    evictions, keeps the rows a reader pinned (with the values written to them), and an evicted
    row read or touched again is its initial row."""
    store = make_store(kind, request)
    spec = bounded_spec(dtype)
    store.init_table(spec)
    pinned = torch.tensor([10, 11, 12])
    store.get("t", pinned, pin=True)
    written = spec.pack(torch.full((3, 3), 7.0), torch.full((3, 2), -1.0))
    store.put("t", pinned, written)
    first = torch.arange(1000, 1040)
    trained = spec.pack(torch.full((40, 3), 3.0), torch.zeros(40, 2))
    store.put("t", first, trained)
    for lo in range(2000, 4000, 50):
        store.get("t", torch.arange(lo, lo + 50))
        assert store.row_count("t") <= 64
    assert store.io_stats()["tier_evictions"] >= 2000 + 40 - 64 + 3
    held = ids_of(store)
    assert set(pinned.tolist()) <= set(held) and len(held) == store.row_count("t")
    assert torch.equal(store.read("t", pinned).view(torch.uint8), written.view(torch.uint8))
    gone = [i for i in first.tolist() if i not in held]
    assert gone, "the stream should have evicted rows written earlier"
    back = torch.tensor(gone[:5])
    expected = spec.initial_rows(back)
    assert torch.equal(store.read("t", back).view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(store.get("t", back).view(torch.uint8), expected.view(torch.uint8))
    store.unpin("t", pinned)  # released: now evictable like any other row
    for lo in range(5000, 6000, 50):
        store.get("t", torch.arange(lo, lo + 50))
    assert not set(pinned.tolist()) & set(ids_of(store))
    store.close()


@pytest.mark.parametrize("kind", KINDS)
def test_lfu_keeps_the_rows_used_most(kind: str, request: pytest.FixtureRequest) -> None:
    store = make_store(kind, request)
    store.init_table(bounded_spec(score="lfu", capacity=32))
    hot = torch.arange(8)
    for _ in range(5):
        store.get("t", hot)  # each use counts
    for lo in range(100, 1100, 20):
        store.get("t", torch.arange(lo, lo + 20))
    assert set(hot.tolist()) <= set(ids_of(store))
    store.close()


@pytest.mark.parametrize("kind", ["host", "tiered-host"])
def test_scores_survive_export_and_import(kind: str, request: pytest.FixtureRequest) -> None:
    """A table restored from its rows and scores evicts exactly what the original evicts."""
    stores = [make_store(kind, request) for _ in range(2)]
    for store in stores:
        store.init_table(bounded_spec(capacity=48, dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        stores[0].get("t", torch.randint(0, 300, (40,), generator=gen).unique())
    assert stores[0].keeps_scores("t")
    for ids, rows, scores in stores[0].export_rows("t", chunk_rows=7, scores=True):
        stores[1].import_rows("t", ids, rows, scores)
    for _ in range(20):
        ids = torch.randint(0, 300, (40,), generator=gen).unique()
        for store in stores:
            store.get("t", ids)
        assert ids_of(stores[0]) == ids_of(stores[1])
    a, b = (torch.cat([c[2] for c in s.export_rows("t", scores=True)]) for s in stores)
    assert torch.equal(a.argsort(), b.argsort())  # the same order, so the same victims


def test_redis_refuses_a_capacity_of_its_own(server: RedisServer) -> None:
    kv = RedisKV(server.url, namespace="cap")
    with pytest.raises(ValueError, match=r"does not bound a table's rows.*TieredKV"):
        kv.init_table(bounded_spec())
    kv.close()


def test_half_precision_rows_move_half_the_weight_bytes(server: RedisServer) -> None:
    """The same rows as float32 and as bfloat16: bytes on every tier count the stored row, and
    Redis returns the bits it was given."""
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        for store in (HostKV(pin_memory=False), RedisKV(server.url, namespace=f"h{dtype}")):
            spec = TableSpec("t", dim=16, num_embeddings=100, state_dim=1, dtype=dtype)
            store.init_table(spec)
            rows = spec.pack(torch.randn(10, 16), torch.rand(10, 1))
            store.put("t", torch.arange(10), rows)
            got = store.get("t", torch.arange(10))
            assert got.dtype == dtype
            assert torch.equal(got.view(torch.uint8), rows.view(torch.uint8))
            sizes[(type(store).__name__, dtype)] = store.io_stats()["bytes_read"]
            store.close()
    for name in ("HostKV", "RedisKV"):
        assert sizes[(name, torch.float32)] == 10 * (16 + 1) * 4
        assert sizes[(name, torch.bfloat16)] == 10 * (16 * 2 + 4)


# ----------------------------------------------------------------------------------------------
# Redis: what bounds it, and what a full server does
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "drops"),
    [("allkeys-lru", "rows of the model"), ("allkeys-random", "rows of the model"),
     ("volatile-lru", "owner leases"), ("volatile-ttl", "owner leases")],
)  # fmt: skip
def test_redis_that_may_evict_keys_is_refused(tmp_path: Path, policy: str, drops: str) -> None:
    """Under a maxmemory, ``allkeys-*`` would drop rows (and maybe the write marks that reveal
    it) and ``volatile-*`` the owner leases (the keys with a TTL): refused at declaration,
    naming what would be dropped and the fix, with nothing declared."""
    args = ("--maxmemory", "64mb", "--maxmemory-policy", policy)
    with running_server(tmp_path, extra_args=args) as server:
        kv = RedisKV(server.url, namespace="evicting")
        with pytest.raises(TierConfigError, match=rf"{policy}.*{drops}.*policy noeviction"):
            kv.init_table(TableSpec("t", dim=4, num_embeddings=10))
        kv.close()
        assert server.client().keys("evicting:*") == []


def test_redis_under_noeviction_or_without_maxmemory_is_accepted(tmp_path: Path) -> None:
    """``noeviction`` refuses writes when full instead of evicting; without a maxmemory no
    policy ever applies. Both declare the table and take its lease."""
    for name, args in [("noevict", ("--maxmemory", "64mb", "--maxmemory-policy", "noeviction")),
                       ("unbounded", ("--maxmemory-policy", "volatile-lru"))]:  # fmt: skip
        with running_server(tmp_path / name, extra_args=args) as server:
            kv = RedisKV(server.url, namespace=name)
            kv.init_table(TableSpec("t", dim=4, num_embeddings=10))
            assert server.client().exists(f"{name}:lease:t") == 1
            kv.close()


def test_a_full_redis_refuses_writes_loudly_and_loses_nothing(tmp_path: Path) -> None:
    args = ("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    with running_server(tmp_path, extra_args=args) as server:
        kv = RedisKV(server.url, namespace="full")
        spec = TableSpec("t", dim=64, num_embeddings=None)
        kv.init_table(spec)
        kept = torch.arange(100)
        kv.put("t", kept, torch.ones(100, 64))
        with pytest.raises(TierFullError, match=r"is full.*Nothing was lost.*maxmemory"):
            for lo in range(1000, 200_000, 4096):
                kv.put("t", torch.arange(lo, lo + 4096), torch.zeros(4096, 64))
        assert torch.equal(kv.read("t", kept), torch.ones(100, 64))
        kv.close()


def test_redis_remove_deletes_rows_as_a_write(server: RedisServer) -> None:
    kv = RedisKV(server.url, namespace="rm")
    spec = TableSpec("t", dim=2, num_embeddings=None, state_dim=1)
    kv.init_table(spec)
    kv.put("t", torch.tensor([1, 2, 3]), torch.ones(3, 3))
    kv.remove("t", torch.tensor([2, 9]))  # an absent id is ignored
    assert ids_of(kv) == [1, 3]
    assert torch.equal(kv.get("t", torch.tensor([2])), spec.initial_rows(torch.tensor([2])))
    kv.close()
