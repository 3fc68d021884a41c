"""The `Store` contract, one suite over every tier.

Each test runs over: `HostKV` with a dense table (``host-dense``) and an unbounded table of
hashed 64-bit ids (``host-hashed``), `HostKV` with a row budget (``host-bounded``: a table with
``TableSpec.capacity``), `RedisKV` on a real ``redis-server`` (``redis``) and on a real Redis
Cluster (``redis-cluster``: fewer tests, it is the slowest), and `TieredKV` (a small host row
cache in front of a `HostKV`, so its evictions and write-backs run). What every tier promises
is in `embcache.kv.base.Store`; a tier's own behaviour has its own test file beside this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from embcache.kv.base import Store, TableSpec
from embcache.kv.host import HostKV
from embcache.kv.tiered import TieredKV
from tests.kv.redis_servers import RedisClusterNodes, RedisServer, running_cluster, running_server

NUM = 40  # rows of a bounded (dense) table
DIM, STATE = 5, 2
HASHED_IDS = torch.tensor([0, 7, 2**40 + 3, 2**62 + 11, 2**63 - 1])  # the largest id too


@dataclass
class Tier:
    """How to open a store of one kind, and what its tables look like."""

    name: str
    open: Callable[[], Store]  # a fresh, empty store (its own namespace)
    reopen: Callable[[Store], Store] | None = None  # a new client on the same data
    hashed: bool = False  # tables of unbounded 64-bit ids
    capacity: int | None = None  # the tables' row budget

    def spec(self, name: str = "t", **changes: object) -> TableSpec:
        spec = TableSpec(
            name,
            DIM,
            None if self.hashed else NUM,
            state_dim=STATE,
            state_init=0.5,
            seed=3,
            capacity=self.capacity,
        )
        return dataclasses.replace(spec, **changes)

    def ids(self, n: int, seed: int = 0) -> torch.Tensor:
        """``n`` distinct ids of a table (the last row among them when ``n`` allows)."""
        g = torch.Generator().manual_seed(seed)
        if self.hashed:
            pool = torch.cat([HASHED_IDS, torch.randint(0, 2**62, (n,), generator=g)])
            return torch.unique(pool)[torch.randperm(n + HASHED_IDS.numel(), generator=g)[:n]]
        ids = torch.randperm(NUM - 1, generator=g)[: n - 1]
        return torch.cat([ids, torch.tensor([NUM - 1])])[torch.randperm(n, generator=g)]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("contract-redis")) as started:
        yield started


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    with running_cluster(tmp_path_factory.mktemp("contract-cluster")) as started:
        yield started


def _fresh_redis(url: str, namespace: str) -> Store:
    from embcache.kv.redis_kv import RedisKV

    return RedisKV(url, namespace=namespace)


ALL = ["host-dense", "host-hashed", "host-bounded", "redis", "tiered", "redis-cluster"]
FEW = [name for name in ALL if name != "redis-cluster"]  # the cluster runs the core tests only


def _tier(request: pytest.FixtureRequest, name: str) -> Tier:
    if name == "host-dense":
        return Tier(name, lambda: HostKV(pin_memory=False))
    if name == "host-hashed":
        return Tier(name, lambda: HostKV(pin_memory=False), hashed=True)
    if name == "host-bounded":
        # A budget above every call's rows here: the contract holds, nothing evicted yet.
        return Tier(name, lambda: HostKV(pin_memory=False), capacity=64)
    if name == "tiered":
        return Tier(name, lambda: TieredKV(HostKV(pin_memory=False), capacity_rows=8))
    fixture = "redis_server" if name == "redis" else "redis_cluster"
    url = request.getfixturevalue(fixture).url
    # A namespace per store opened: every test starts empty; reopen keeps the last one's.
    names: list[str] = []

    def open_store() -> Store:
        names.append(f"contract-{uuid.uuid4().hex[:12]}")
        return _fresh_redis(url, names[-1])

    def reopen(old: Store) -> Store:
        old.close()  # releases its leases: the new client takes the tables
        return _fresh_redis(url, names[-1])

    return Tier(name, open_store, reopen=reopen)


@pytest.fixture(params=ALL)
def tier(request: pytest.FixtureRequest) -> Tier:
    return _tier(request, request.param)


@pytest.fixture(params=FEW)
def tier_few(request: pytest.FixtureRequest) -> Tier:
    return _tier(request, request.param)


@pytest.fixture
def stores() -> Iterator[list[Store]]:
    """Stores a test opened, closed at its end."""
    opened: list[Store] = []
    yield opened
    for store in opened:
        with contextlib.suppress(Exception):
            store.close()


def _open(tier: Tier, stores: list[Store], *specs: TableSpec) -> Store:
    store = tier.open()
    stores.append(store)
    for spec in specs or (tier.spec(),):
        store.init_table(spec)
    return store


def _random_rows(spec: TableSpec, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return spec.pack(
        torch.randn(n, spec.dim, generator=g), torch.rand(n, spec.state_dim, generator=g)
    )


def _export(store: Store, table: str, chunk_rows: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    chunks = list(store.export_rows(table, chunk_rows=chunk_rows))
    if not chunks:
        spec = store.table_spec(table)
        return torch.empty(0, dtype=torch.int64), torch.empty(
            0, spec.stored_width, dtype=spec.dtype
        )
    ids = torch.cat([c[0] for c in chunks])
    assert all(c[0].numel() <= chunk_rows for c in chunks)
    return ids, torch.cat([c[1] for c in chunks])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical rows (NaN-safe, dtype-exact)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


# ----------------------------------------------------------------------------------------------


def test_init_table_is_idempotent_and_refuses_a_conflicting_spec(tier: Tier, stores) -> None:
    spec = tier.spec()
    store = _open(tier, stores, spec)
    ids = tier.ids(4)
    rows = _random_rows(spec, 4, seed=1)
    store.put("t", ids, rows)
    store.init_table(spec)  # the same spec again: nothing changes
    assert _same(store.get("t", ids), rows)
    assert store.tables() == ["t"]
    got = store.table_spec("t")
    assert (got.dim, got.num_embeddings, got.state_dim, got.dtype) == (
        spec.dim, spec.num_embeddings, spec.state_dim, spec.dtype,
    )  # fmt: skip
    changes = [{"dim": DIM + 1}, {"dtype": torch.float16}]
    changes.append({"num_embeddings": NUM + 1} if not tier.hashed else {"num_embeddings": NUM})
    for change in changes:
        with pytest.raises(ValueError):
            store.init_table(dataclasses.replace(spec, **change))
    assert _same(store.get("t", ids), rows)  # a refused declaration changed nothing
    with pytest.raises(KeyError):
        store.table_spec("no-such-table")


def test_untouched_rows_come_from_the_init_in_any_order(tier: Tier, stores) -> None:
    spec = tier.spec()
    ids = tier.ids(12, seed=2)
    first = _open(tier, stores, spec)
    second = _open(tier, stores, spec)
    assert first.row_count("t") == 0
    ahead = first.get("t", ids)
    behind = torch.cat([second.get("t", ids.flip(0)[:5]), second.get("t", ids.flip(0)[5:])])
    assert _same(ahead, behind.flip(0))
    assert _same(ahead, spec.initial_rows(ids))
    assert first.row_count("t") == ids.numel()
    fresh = tier.ids(3, seed=99)
    fresh = fresh[~torch.isin(fresh, ids)]
    assert _same(first.read("t", fresh), spec.initial_rows(fresh))  # read creates nothing
    assert first.row_count("t") == ids.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32", "float16", "bfloat16"])  # fmt: skip
def test_put_then_get_round_trips_exactly(tier: Tier, stores, dtype: torch.dtype) -> None:
    spec = tier.spec(dtype=dtype)
    store = _open(tier, stores, spec)
    ids = tier.ids(10, seed=3)
    rows = _random_rows(spec, 10, seed=4)
    store.put("t", ids, rows)
    assert _same(store.get("t", ids), rows)
    assert _same(store.read("t", ids.flip(0)), rows.flip(0))
    # The float32 view is accepted too, rounded to nearest into the table's dtype.
    view = torch.randn(3, spec.row_width, generator=torch.Generator().manual_seed(5))
    store.put("t", ids[:3], view)
    assert _same(store.get("t", ids[:3]), spec.from_float(view))


def test_grouped_calls_equal_per_table_calls(tier_few: Tier, stores) -> None:
    tier = tier_few
    specs = [tier.spec("a"), tier.spec("b", seed=9)]
    grouped = _open(tier, stores, *specs)
    alone = _open(tier, stores, *specs)
    ids_a, ids_b = tier.ids(6, seed=6), tier.ids(4, seed=7)
    ids, counts = torch.cat([ids_a, ids_b]), [6, 4]
    rows = grouped.get_grouped(["a", "b"], ids, counts)
    assert _same(rows, torch.cat([alone.get("a", ids_a), alone.get("b", ids_b)]))
    new = _random_rows(specs[0], 10, seed=8)
    grouped.put_grouped(["a", "b"], ids, counts, new)
    assert _same(grouped.get("a", ids_a), new[:6])
    assert _same(grouped.get("b", ids_b), new[6:])
    # Straight into / out of a CPU cache's slot storage: True with every row moved, or False
    # with nothing moved (the caller then takes the grouped calls).
    slots = torch.randperm(16)[:10]
    weights = torch.full((16, DIM), float("nan"))
    state = torch.full((16, STATE), float("nan"))
    if grouped.get_grouped_into(["a", "b"], ids, counts, weights, state, slots):
        assert _same(torch.cat([weights[slots], state[slots]], 1), new)
    else:
        assert bool(weights.isnan().all()) and bool(state.isnan().all())
    weights[slots], state[slots] = new[:, :DIM], new[:, DIM:]
    weights[slots[0]] += 1.0
    before = _export(alone, "a")
    if alone.put_grouped_from(["a", "b"], ids, counts, weights, state, slots):
        assert _same(alone.get("a", ids_a), torch.cat([weights, state], 1)[slots[:6]])
    else:
        assert all(_same(x, y) for x, y in zip(_export(alone, "a"), before, strict=True))


def test_duplicate_ids_in_one_call_read_one_row(tier_few: Tier, stores) -> None:
    tier = tier_few
    spec = tier.spec()
    store = _open(tier, stores, spec)
    ids = tier.ids(5, seed=10)
    doubled = torch.cat([ids, ids[:3], ids[:1]])
    rows = store.get("t", doubled)  # first touch, each created once
    assert _same(rows, spec.initial_rows(doubled))
    assert store.row_count("t") == ids.numel()
    written = _random_rows(spec, 5, seed=11)
    store.put("t", ids, written)
    assert _same(store.get("t", doubled), torch.cat([written, written[:3], written[:1]]))


def test_ids_out_of_range_are_refused_changing_nothing(tier: Tier, stores) -> None:
    spec = tier.spec()
    store = _open(tier, stores, spec)
    ids = tier.ids(4, seed=12)
    rows = _random_rows(spec, 4, seed=13)
    store.put("t", ids, rows)
    before = _export(store, "t")
    last = torch.tensor([2**63 - 1 if tier.hashed else NUM - 1])
    bad = [torch.tensor([-1])] + (
        [] if tier.hashed else [torch.tensor([NUM]), torch.tensor([2**40])]
    )
    for wrong in bad:
        mixed = torch.cat([ids[:2], wrong])
        with pytest.raises(ValueError):
            store.get("t", mixed)
        with pytest.raises(ValueError):
            store.read("t", mixed)
        with pytest.raises(ValueError):
            store.put("t", mixed, _random_rows(spec, 3, seed=14))
        with pytest.raises(ValueError):  # table b's bad id: table a is not written either
            store.put_grouped(["t", "t"], torch.cat([last, mixed]), [1, 3],
                              _random_rows(spec, 4, seed=15))  # fmt: skip
    after = _export(store, "t")
    assert all(_same(x, y) for x, y in zip(after, before, strict=True))
    store.put("t", last, rows[:1])  # the last row is a row
    assert _same(store.get("t", last), rows[:1])


def test_export_import_round_trip(tier: Tier, stores) -> None:
    spec = tier.spec()
    store = _open(tier, stores, spec)
    written, touched = tier.ids(7, seed=16), tier.ids(12, seed=17)
    store.put("t", written, _random_rows(spec, 7, seed=18))
    store.get("t", touched)
    store.read("t", tier.ids(3, seed=19))  # reads list nothing
    ids, rows = _export(store, "t", chunk_rows=3)
    expected = torch.unique(torch.cat([written, touched]))
    assert torch.equal(ids, expected)  # every existing row, ascending, once
    assert _same(rows, store.read("t", ids))
    restored = _open(tier, stores, spec)
    for start in range(0, ids.numel(), 4):
        restored.import_rows("t", ids[start : start + 4], rows[start : start + 4])
    back_ids, back_rows = _export(restored, "t")
    assert torch.equal(back_ids, ids) and _same(back_rows, rows)


def test_declared_capabilities_behave_as_declared(tier_few: Tier, stores) -> None:
    tier = tier_few
    spec = tier.spec()
    store = _open(tier, stores, spec)
    assert isinstance(store.parallel_io, bool)
    assert store.lease_owner is None or isinstance(store.lease_owner, str)
    assert store.keeps_scores("t") == (spec.capacity is not None) or tier.name == "tiered"
    store.reset_io_stats()
    stats = store.io_stats()
    assert all(value == 0 for value in stats.values())
    ids = tier.ids(6, seed=20)
    store.get("t", ids)
    store.put("t", ids[:4], _random_rows(spec, 4, seed=21))
    stats = store.io_stats()
    if "rows_read" in stats and tier.name != "tiered":
        assert stats["rows_read"] == 6 and stats["rows_written"] == 4
        assert stats["bytes_read"] == 6 * spec.row_bytes
        assert stats["bytes_written"] == 4 * spec.row_bytes
        assert stats["get_calls"] >= 1 and stats["put_calls"] >= 1
    if tier.name == "tiered":  # counted at the host cache: ids served or fetched
        assert stats["hits"] + stats["misses"] == 6
    store.flush()
    store.flush()  # idempotent
    assert store.row_count("t") == 6
    store.reset_io_stats()
    assert all(value == 0 for value in store.io_stats().values())


def test_close_then_reopen_where_persistent(tier: Tier, stores) -> None:
    spec = tier.spec()
    store = _open(tier, stores, spec)
    ids = tier.ids(5, seed=22)
    rows = _random_rows(spec, 5, seed=23)
    store.put("t", ids, rows)
    if tier.reopen is None:  # in-process: closed is gone
        store.close()
        with pytest.raises(RuntimeError):
            store.get("t", ids)
        return
    again = tier.reopen(store)
    stores.append(again)
    again.init_table(spec)
    assert _same(again.get("t", ids), rows)
    with pytest.raises(RuntimeError):
        store.get("t", ids)


@pytest.mark.parametrize("make", ["host", "tiered"])
def test_a_bounded_table_keeps_its_budget_and_never_drops_a_pinned_row(make: str) -> None:
    store = HostKV(pin_memory=False)
    if make == "tiered":
        store = TieredKV(store, capacity_rows=8)
    spec = TableSpec("t", DIM, NUM, state_dim=STATE, capacity=16)
    store.init_table(spec)
    pinned = torch.arange(4)
    kept = _random_rows(spec, 4, seed=24)
    store.put("t", pinned, kept)
    store.get("t", pinned, pin=True)
    for start in range(4, NUM, 6):  # many more rows than the budget
        ids = torch.arange(start, min(start + 6, NUM))
        store.put("t", ids, _random_rows(spec, ids.numel(), seed=start))
        assert store.row_count("t") <= 16
    assert _same(store.get("t", pinned), kept)
    assert store.io_stats()["tier_evictions"] > 0
    ids, _ = _export(store, "t")
    gone = torch.tensor(sorted(set(range(4, NUM)) - set(ids.tolist()))[:3])
    assert _same(store.read("t", gone), spec.initial_rows(gone))  # an evicted row starts over
    store.unpin("t", pinned)
    store.close()


def test_read_grouped_creates_nothing(tier_few: Tier, stores) -> None:
    """`Store.read_grouped` (the cache's reads under ``torch.no_grad()``): the rows a tier
    holds and the initial rows of the others, none of which it creates; pinning (bounded
    tables) creates nothing either."""
    tier = tier_few
    specs = [tier.spec("a"), tier.spec("b", seed=9)]
    store = _open(tier, stores, *specs)
    ids_a, ids_b = tier.ids(6, seed=30), tier.ids(4, seed=31)
    written = _random_rows(specs[0], 3, seed=32)
    store.put("a", ids_a[:3], written)
    ids, counts = torch.cat([ids_a, ids_b]), [6, 4]
    pins = [True, True] if tier.capacity is not None else None
    rows = store.read_grouped(["a", "b"], ids, counts, pins)
    expected = torch.cat([written, specs[0].initial_rows(ids_a[3:]), specs[1].initial_rows(ids_b)])
    assert _same(rows, expected)
    assert store.row_count("a") == 3 and store.row_count("b") == 0
    if pins is not None:
        store.unpin("a", ids_a)  # the absent ones were not pinned: ignored
        store.unpin("b", ids_b)


@pytest.mark.parametrize("make", ["host", "tiered"])
def test_a_read_pins_the_bounded_rows_that_exist_only(make: str) -> None:
    """``read(..., pin=True)`` of a bounded table pins the rows that exist (never evicted
    until `unpin`) and creates none; the absent ones stay absent and unpinned."""
    store: Store = HostKV(pin_memory=False)
    if make == "tiered":
        store = TieredKV(store, capacity_rows=8)
    spec = TableSpec("t", DIM, NUM, state_dim=STATE, capacity=16)
    store.init_table(spec)
    kept = _random_rows(spec, 4, seed=33)
    store.put("t", torch.arange(4), kept)
    got = store.read("t", torch.arange(8), pin=True)
    assert _same(got, torch.cat([kept, spec.initial_rows(torch.arange(4, 8))]))
    assert store.row_count("t") == 4
    for start in range(8, NUM, 6):  # many more rows than the budget: the pinned four stay
        ids = torch.arange(start, min(start + 6, NUM))
        store.put("t", ids, _random_rows(spec, ids.numel(), seed=start))
    assert _same(store.read("t", torch.arange(4)), kept)
    store.unpin("t", torch.arange(8))
    store.close()
