"""TieredKV: a bounded write-back row cache must be invisible: under any sequence of gets and
puts it returns what the back store alone returns, and after `flush` the back store holds what
it would have held alone. Checked over HostKV (hypothesis) and over a real Redis server."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.kv.base import Store, TableSpec
from embcache.kv.host import HostKV
from embcache.kv.redis_kv import RedisKV
from embcache.kv.tiered import TieredKV
from tests.kv.redis_servers import RedisServer, running_server

SPECS = (
    TableSpec("a", dim=3, num_embeddings=40, state_dim=1, state_init=0.5),
    TableSpec("b", dim=5, num_embeddings=None, seed=2),  # unbounded: any int64 id
)
B_IDS = torch.tensor([0, 7, 2**40, 2**62 + 3, 12345, 99, 5, 2**33])  # b's id universe


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path) as started:
        yield started


def _host() -> HostKV:
    return HostKV(pin_memory=False)


def _declared(store: Store) -> Store:
    for spec in SPECS:
        store.init_table(spec)
    return store


def _export(kv: Store, table: str) -> tuple[torch.Tensor, torch.Tensor]:
    chunks = list(kv.export_rows(table, chunk_rows=7))
    if not chunks:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, kv.table_spec(table).row_width)
    return torch.cat([ids for ids, _ in chunks]), torch.cat([rows for _, rows in chunks])


def _ids(table: str, picks: list[int]) -> torch.Tensor:
    """Distinct ids of ``table`` from a list of small numbers."""
    universe = 40 if table == "a" else B_IDS.numel()
    distinct = list(dict.fromkeys(p % universe for p in picks))
    ids = torch.tensor(distinct, dtype=torch.int64)
    return ids if table == "a" else B_IDS[ids]


def _replay(ops: list[tuple[str, str, list[int], float]], tiered: TieredKV, alone: Store) -> None:
    """Apply ``ops`` to both stores, comparing every get; then flush and compare the tiers."""
    for step, (op, table, picks, value) in enumerate(ops):
        ids = _ids(table, picks)
        if op == "get":
            assert torch.equal(tiered.get(table, ids), alone.get(table, ids)), step
        elif op == "read":  # creates nothing: the exports below would differ
            assert torch.equal(tiered.read(table, ids), alone.read(table, ids)), step
        else:
            width = tiered.table_spec(table).row_width
            rows = value + torch.arange(ids.numel() * width, dtype=torch.float32).view(-1, width)
            tiered.put(table, ids, rows)
            alone.put(table, ids, rows)
        assert tiered.held_rows() <= tiered.capacity_rows, step
    tiered.flush()
    assert tiered.dirty_rows() == 0
    for spec in SPECS:
        got, want = _export(tiered.back, spec.name), _export(alone, spec.name)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), spec.name
        assert torch.equal(tiered.get(spec.name, want[0]), want[1])


OPS = st.lists(
    st.tuples(
        st.sampled_from(["get", "read", "put"]),
        st.sampled_from(["a", "b"]),
        st.lists(st.integers(0, 60), min_size=0, max_size=12),
        st.floats(-4, 4, allow_nan=False, width=32),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, capacity=st.sampled_from([1, 2, 5, 17, 1000]))
def test_equals_the_back_store_alone_over_hostkv(
    ops: list[tuple[str, str, list[int], float]], capacity: int
) -> None:
    _replay(ops, TieredKV(_declared(_host()), capacity_rows=capacity), _declared(_host()))


@pytest.mark.parametrize("capacity", [1, 6, 50], ids=["cap1", "cap6", "cap50"])
def test_equals_the_back_store_alone_over_redis(server: RedisServer, capacity: int) -> None:
    rng = random.Random(capacity)
    ops = [
        (
            rng.choice(["get", "read", "put"]),
            rng.choice(["a", "b"]),
            [rng.randrange(60) for _ in range(rng.randrange(13))],
            rng.uniform(-4, 4),
        )
        for _ in range(120)
    ]
    back = _declared(RedisKV(server.url, namespace=f"tiered{capacity}", chunk_rows=4))
    _replay(ops, TieredKV(back, capacity_rows=capacity), _declared(_host()))


def test_eviction_writes_back_the_least_recently_used() -> None:
    back = _declared(_host())
    tiered = TieredKV(back, capacity_rows=4)
    tiered.put("a", torch.tensor([1, 2]), torch.ones(2, 4))
    tiered.put("a", torch.tensor([3]), torch.full((1, 4), 2.0))
    tiered.put("a", torch.tensor([4]), torch.full((1, 4), 2.5))
    assert _export(back, "a")[0].numel() == 0  # all still held, dirty
    tiered.get("a", torch.tensor([1]))  # 1 is now more recent than 2, 3, 4
    tiered.put("a", torch.tensor([5, 6]), torch.full((2, 4), 3.0))  # 2 and 3 must go
    ids, rows = _export(back, "a")
    assert ids.tolist() == [2, 3]
    assert torch.equal(rows, torch.tensor([[1.0] * 4, [2.0] * 4]))
    stats = tiered.io_stats()
    assert (stats["evictions"], stats["writebacks"], tiered.held_rows()) == (2, 2, 4)
    # Clean rows are dropped without a write.
    tiered.flush()
    tiered.get("a", torch.tensor([10, 11, 12, 13]))
    assert tiered.io_stats()["writebacks"] == 2 + 4  # the flush, then no eviction write


def test_capacity_is_shared_by_tables_and_a_large_get_is_served() -> None:
    host = _declared(_host())
    tiered = TieredKV(_declared(_host()), capacity_rows=8)
    ids = torch.arange(30)
    assert torch.equal(tiered.get("a", ids), host.get("a", ids))  # more than the capacity
    assert tiered.held_rows() == 8
    tiered.put("b", B_IDS[:5], torch.ones(5, 5))
    assert tiered.held_rows("b") == 5 and tiered.held_rows() == 8  # a's oldest rows went
    stats = tiered.io_stats()
    assert (stats["misses"], stats["hits"]) == (30, 0)
    tiered.get("b", B_IDS[:6])
    assert (tiered.io_stats()["hits"], tiered.io_stats()["misses"]) == (5, 31)


def test_flush_and_export_write_every_dirty_row() -> None:
    back = _declared(_host())
    tiered = TieredKV(back, capacity_rows=100)
    tiered.put("a", torch.tensor([3, 1]), torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]]))
    assert tiered.dirty_rows() == 2 and tiered.dirty_rows("b") == 0
    ids, rows = _export(tiered, "a")  # export flushes first
    assert ids.tolist() == [1, 3] and rows[0].tolist() == [5, 6, 7, 8]
    assert tiered.dirty_rows() == 0
    writes = back.io_stats()["put_calls"]
    tiered.flush()
    assert back.io_stats()["put_calls"] == writes  # nothing dirty, nothing written


def test_redeclare_keeps_held_weights_and_resets_state() -> None:
    back = _declared(_host())
    tiered = TieredKV(back, capacity_rows=100)
    tiered.put("a", torch.tensor([2]), torch.tensor([[1.0, 2.0, 3.0, 9.0]]))
    tiered.init_table(TableSpec("a", dim=3, num_embeddings=40, state_dim=2, state_init=0.25))
    assert tiered.get("a", torch.tensor([2])).tolist() == [[1.0, 2.0, 3.0, 0.25, 0.25]]
    with pytest.raises(ValueError, match="dim=3"):
        tiered.init_table(TableSpec("a", dim=4, num_embeddings=40))


def test_import_updates_held_rows_and_adopts_back_tables() -> None:
    back = _declared(_host())
    back.init_table(TableSpec("c", dim=2, num_embeddings=10))  # not declared through tiered
    tiered = TieredKV(back, capacity_rows=100)
    tiered.put("a", torch.tensor([4]), torch.zeros(1, 4))
    tiered.import_rows("a", torch.tensor([4, 5]), torch.ones(2, 4))
    assert torch.equal(tiered.get("a", torch.tensor([4, 5])), torch.ones(2, 4))
    assert tiered.dirty_rows() == 0
    assert tiered.get("c", torch.tensor([9])).shape == (1, 2)
    assert sorted(tiered.tables()) == ["a", "b", "c"]


def test_threads_share_one_store() -> None:
    tiered = TieredKV(_declared(_host()), capacity_rows=7)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            ids = torch.arange(k, 40, 4)
            for round_ in range(20):
                rows = torch.full((ids.numel(), 4), float(k * 100 + round_))
                tiered.put("a", ids, rows)
                assert torch.equal(tiered.get("a", ids), rows)
        except BaseException as err:  # reported below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    tiered.flush()
    ids, rows = _export(tiered.back, "a")
    assert torch.equal(rows[:, 0], (ids % 4 * 100 + 19).float())


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="capacity_rows"):
        TieredKV(_host(), capacity_rows=0)
    with pytest.raises(TypeError, match="Store"):
        TieredKV(object(), capacity_rows=4)  # type: ignore[arg-type]
    tiered = TieredKV(_declared(_host()), capacity_rows=4)
    with pytest.raises(ValueError, match="out of range"):
        tiered.put("a", torch.tensor([40]), torch.zeros(1, 4))
    with pytest.raises(KeyError, match="zzz"):
        tiered.get("zzz", torch.tensor([0]))
    tiered.close()
    with pytest.raises(RuntimeError, match="closed"):
        tiered.get("a", torch.tensor([0]))


class _FailingHost(HostKV):
    """A HostKV whose writes to the tables in ``failing`` raise, as a lost server would."""

    def __init__(self) -> None:
        super().__init__(pin_memory=False)
        self.failing: set[str] = set()

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if table in self.failing:
            raise ConnectionError(f"table {table}: the write was lost")
        super().put(table, ids, rows)


def test_a_failed_write_back_drops_no_row_of_any_table() -> None:
    """Victims in two tables (the oldest rows, ties by id): table a's write succeeds, b's
    fails; nothing of either is dropped (a's written rows stay, clean), and once the store is
    back a flush saves every row."""
    back = _declared(_FailingHost())
    tiered = TieredKV(back, capacity_rows=4)
    tiered.put("a", torch.tensor([1, 2]), torch.ones(2, 4))
    tiered.put("b", B_IDS[[3, 1]], torch.full((2, 5), 2.0))
    back.failing.add("b")
    with pytest.raises(ConnectionError, match="lost"):
        tiered.put("a", torch.tensor([3, 4, 5]), torch.full((3, 4), 3.0))  # a1, a2, b[1] go
    assert (tiered.held_rows("a"), tiered.held_rows("b")) == (5, 2)
    assert (tiered.dirty_rows("a"), tiered.dirty_rows("b")) == (3, 2)
    assert _export(back, "a")[0].tolist() == [1, 2] and _export(back, "b")[0].numel() == 0
    assert tiered.io_stats()["evictions"] == 0
    back.failing.clear()
    tiered.put("b", B_IDS[[0]], torch.zeros(1, 5))  # 8 held: a1, a2 and both b rows go
    assert (tiered.held_rows(), tiered.io_stats()["evictions"]) == (4, 4)
    assert tiered.held_rows("a") == 3 and tiered.get("a", torch.tensor([3])).sum() == 12
    assert _export(back, "b")[0].tolist() == B_IDS[[1, 3]].tolist()
    tiered.flush()
    assert _export(back, "a")[0].tolist() == [1, 2, 3, 4, 5]
    assert sorted(_export(back, "b")[0].tolist()) == sorted(B_IDS[[0, 1, 3]].tolist())


def test_many_held_rows_grow_the_index_and_leave_by_lru() -> None:
    """Thousands of rows of random 64-bit ids: the held index grows to take them, every row
    reads back, and a second wave pushes out exactly the first one's rows (least recent)."""
    g = torch.Generator().manual_seed(7)
    tiered = TieredKV(_declared(_host()), capacity_rows=3000)
    ids = torch.unique(torch.randint(0, 2**62, (6000,), generator=g))[:6000]
    first, second = ids[::2], ids[1::2]
    rows = torch.randn(first.numel(), 5, generator=g)
    for part, values in zip(first.split(500), rows.split(500), strict=True):
        tiered.put("b", part, values)
    assert tiered.held_rows() == first.numel() <= 3000 and tiered.dirty_rows() == first.numel()
    assert torch.equal(tiered.get("b", first), rows)
    assert tiered.io_stats()["hits"] == first.numel()
    for part in second.split(500):
        tiered.get("b", part)
    assert tiered.held_rows() <= 3000 and tiered.io_stats()["writebacks"] == first.numel()
    assert torch.equal(tiered.back.read("b", first), rows)  # written back when evicted


def test_a_bounded_get_with_a_repeated_id_creates_its_row_once() -> None:
    tiered = TieredKV(_host(), capacity_rows=10)
    spec = TableSpec("c", dim=2, num_embeddings=None, capacity=64)
    tiered.init_table(spec)
    got = tiered.get("c", torch.tensor([5, 9, 5]))
    assert torch.equal(got, spec.initial_rows(torch.tensor([5, 9, 5])))
    assert tiered.io_stats()["rows_created"] == 2 and tiered.held_rows("c") == 2
