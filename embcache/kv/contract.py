"""The `Store` contract as an importable pytest suite: what every tier promises (the docstrings
of `embcache.kv.base.Store`), checked the same way for each.

A tier runs it by subclassing `StoreContract` in a test module and defining the ``tier``
fixture, a `ContractTier` that says how to open its stores and what its tables look like:

    import pytest
    from embcache.kv.contract import ContractTier, StoreContract

    class TestMyTier(StoreContract):
        @pytest.fixture
        def tier(self) -> ContractTier:
            return ContractTier(open=lambda: MyKV())

`tests/kv/test_store_contract.py` runs it for every built-in tier, and
`tests/kv/test_store_registry.py` for a tier defined in the test. `StoreCoreContract` is the
part without the grouped calls, duplicate ids, capabilities and grouped reads, for a tier too
slow to run it all (the test of a Redis Cluster). This module needs pytest (the ``[dev]``
extra); nothing in the package imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from embcache.kv.base import Store, TableSpec

NUM = 40  # rows of a bounded (dense) table
DIM, STATE = 5, 2
HASHED_IDS = torch.tensor([0, 7, 2**40 + 3, 2**62 + 11, 2**63 - 1])  # the largest id too


@dataclass
class ContractTier:
    """How the suite opens stores of the tier under test, and what its tables look like.

    Attributes:
        open: a fresh, empty store (each call its own: a namespace of its own, for a shared
            server).
        reopen: a new client on the data of the store given (closing that one first), for a
            tier whose data outlive a client; None: closing a store ends its data.
        hashed: the tables take unbounded 64-bit ids (``num_embeddings=None``).
        capacity: the tables' row budget (`TableSpec.capacity`), for a tier that bounds them.
    """

    open: Callable[[], Store]
    reopen: Callable[[Store], Store] | None = None
    hashed: bool = False
    capacity: int | None = None

    def spec(self, name: str = "t", **changes: object) -> TableSpec:
        """A table of this tier (``changes``: fields to replace)."""
        spec = TableSpec(
            name,
            DIM,
            None if self.hashed else NUM,
            state_dim=STATE,
            state_init=0.5,
            seed=3,
            capacity=self.capacity,
        )
        return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]

    def ids(self, n: int, seed: int = 0) -> torch.Tensor:
        """``n`` distinct ids of a table (the last row among them when ``n`` allows)."""
        g = torch.Generator().manual_seed(seed)
        if self.hashed:
            pool = torch.cat([HASHED_IDS, torch.randint(0, 2**62, (n,), generator=g)])
            return torch.unique(pool)[torch.randperm(n + HASHED_IDS.numel(), generator=g)[:n]]
        ids = torch.randperm(NUM - 1, generator=g)[: n - 1]
        return torch.cat([ids, torch.tensor([NUM - 1])])[torch.randperm(n, generator=g)]


def random_rows(spec: TableSpec, n: int, seed: int) -> torch.Tensor:
    """``n`` stored rows of ``spec`` (random weights and state)."""
    g = torch.Generator().manual_seed(seed)
    return spec.pack(
        torch.randn(n, spec.dim, generator=g), torch.rand(n, spec.state_dim, generator=g)
    )


def exported(
    store: Store, table: str, chunk_rows: int = 65536
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row `Store.export_rows` lists, ``(ids, rows)`` in one tensor each (each chunk
    checked against ``chunk_rows``)."""
    chunks = list(store.export_rows(table, chunk_rows=chunk_rows))
    if not chunks:
        spec = store.table_spec(table)
        return torch.empty(0, dtype=torch.int64), torch.empty(
            0, spec.stored_width, dtype=spec.dtype
        )
    ids = torch.cat([c[0] for c in chunks])
    assert all(c[0].numel() <= chunk_rows for c in chunks)
    return ids, torch.cat([c[1] for c in chunks])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical rows (NaN-safe, dtype-exact)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


class StoreCoreContract:
    """The calls every tier must get right: declaring tables, first touches, round trips,
    refused ids, export and import, closing. A subclass defines the ``tier`` fixture."""

    @pytest.fixture
    def stores(self) -> Iterator[list[Store]]:
        """Stores a test opened, closed at its end."""
        opened: list[Store] = []
        yield opened
        for store in opened:
            with contextlib.suppress(Exception):
                store.close()

    @staticmethod
    def fresh_store(tier: ContractTier, stores: list[Store], *specs: TableSpec) -> Store:
        """A fresh store of ``tier`` with ``specs`` declared (one table ``t`` by default)."""
        store = tier.open()
        stores.append(store)
        for spec in specs or (tier.spec(),):
            store.init_table(spec)
        return store

    def test_init_table_is_idempotent_and_refuses_a_conflicting_spec(
        self, tier: ContractTier, stores: list[Store]
    ) -> None:
        spec = tier.spec()
        store = self.fresh_store(tier, stores, spec)
        ids = tier.ids(4)
        rows = random_rows(spec, 4, seed=1)
        store.put("t", ids, rows)
        store.init_table(spec)  # the same spec again: nothing changes
        assert same(store.get("t", ids), rows)
        assert store.tables() == ["t"]
        got = store.table_spec("t")
        assert (got.dim, got.num_embeddings, got.state_dim, got.dtype) == (
            spec.dim, spec.num_embeddings, spec.state_dim, spec.dtype,
        )  # fmt: skip
        changes: list[dict[str, object]] = [{"dim": DIM + 1}, {"dtype": torch.float16}]
        changes.append({"num_embeddings": NUM + 1} if not tier.hashed else {"num_embeddings": NUM})
        for change in changes:
            with pytest.raises(ValueError):
                store.init_table(dataclasses.replace(spec, **change))  # type: ignore[arg-type]
        assert same(store.get("t", ids), rows)  # a refused declaration changed nothing
        with pytest.raises(KeyError):
            store.table_spec("no-such-table")

    def test_untouched_rows_come_from_the_init_in_any_order(
        self, tier: ContractTier, stores: list[Store]
    ) -> None:
        spec = tier.spec()
        ids = tier.ids(12, seed=2)
        first = self.fresh_store(tier, stores, spec)
        second = self.fresh_store(tier, stores, spec)
        assert first.row_count("t") == 0
        ahead = first.get("t", ids)
        behind = torch.cat([second.get("t", ids.flip(0)[:5]), second.get("t", ids.flip(0)[5:])])
        assert same(ahead, behind.flip(0))
        assert same(ahead, spec.initial_rows(ids))
        assert first.row_count("t") == ids.numel()
        fresh = tier.ids(3, seed=99)
        fresh = fresh[~torch.isin(fresh, ids)]
        assert same(first.read("t", fresh), spec.initial_rows(fresh))  # read creates nothing
        assert first.row_count("t") == ids.numel()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                             ids=["float32", "float16", "bfloat16"])  # fmt: skip
    def test_put_then_get_round_trips_exactly(
        self, tier: ContractTier, stores: list[Store], dtype: torch.dtype
    ) -> None:
        spec = tier.spec(dtype=dtype)
        store = self.fresh_store(tier, stores, spec)
        ids = tier.ids(10, seed=3)
        rows = random_rows(spec, 10, seed=4)
        store.put("t", ids, rows)
        assert same(store.get("t", ids), rows)
        assert same(store.read("t", ids.flip(0)), rows.flip(0))
        # The float32 view is accepted too, rounded to nearest into the table's dtype.
        view = torch.randn(3, spec.row_width, generator=torch.Generator().manual_seed(5))
        store.put("t", ids[:3], view)
        assert same(store.get("t", ids[:3]), spec.from_float(view))

    def test_ids_out_of_range_are_refused_changing_nothing(
        self, tier: ContractTier, stores: list[Store]
    ) -> None:
        spec = tier.spec()
        store = self.fresh_store(tier, stores, spec)
        ids = tier.ids(4, seed=12)
        rows = random_rows(spec, 4, seed=13)
        store.put("t", ids, rows)
        before = exported(store, "t")
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
                store.put("t", mixed, random_rows(spec, 3, seed=14))
            with pytest.raises(ValueError):  # table b's bad id: table a is not written either
                store.put_grouped(["t", "t"], torch.cat([last, mixed]), [1, 3],
                                  random_rows(spec, 4, seed=15))  # fmt: skip
        after = exported(store, "t")
        assert all(same(x, y) for x, y in zip(after, before, strict=True))
        store.put("t", last, rows[:1])  # the last row is a row
        assert same(store.get("t", last), rows[:1])

    def test_export_import_round_trip(self, tier: ContractTier, stores: list[Store]) -> None:
        spec = tier.spec()
        store = self.fresh_store(tier, stores, spec)
        written, touched = tier.ids(7, seed=16), tier.ids(12, seed=17)
        store.put("t", written, random_rows(spec, 7, seed=18))
        store.get("t", touched)
        store.read("t", tier.ids(3, seed=19))  # reads list nothing
        ids, rows = exported(store, "t", chunk_rows=3)
        expected = torch.unique(torch.cat([written, touched]))
        assert torch.equal(ids, expected)  # every existing row, ascending, once
        assert same(rows, store.read("t", ids))
        restored = self.fresh_store(tier, stores, spec)
        for start in range(0, ids.numel(), 4):
            restored.import_rows("t", ids[start : start + 4], rows[start : start + 4])
        back_ids, back_rows = exported(restored, "t")
        assert torch.equal(back_ids, ids) and same(back_rows, rows)

    def test_close_then_reopen_where_persistent(
        self, tier: ContractTier, stores: list[Store]
    ) -> None:
        spec = tier.spec()
        store = self.fresh_store(tier, stores, spec)
        ids = tier.ids(5, seed=22)
        rows = random_rows(spec, 5, seed=23)
        store.put("t", ids, rows)
        if tier.reopen is None:  # in-process: closed is gone
            store.close()
            with pytest.raises(RuntimeError):
                store.get("t", ids)
            return
        again = tier.reopen(store)
        stores.append(again)
        again.init_table(spec)
        assert same(again.get("t", ids), rows)
        with pytest.raises(RuntimeError):
            store.get("t", ids)


class StoreContract(StoreCoreContract):
    """The whole contract: the core calls, and the grouped calls, duplicate ids, the declared
    capabilities and grouped reads. A subclass defines the ``tier`` fixture."""

    def test_grouped_calls_equal_per_table_calls(
        self, tier: ContractTier, stores: list[Store]
    ) -> None:
        specs = [tier.spec("a"), tier.spec("b", seed=9)]
        grouped = self.fresh_store(tier, stores, *specs)
        alone = self.fresh_store(tier, stores, *specs)
        ids_a, ids_b = tier.ids(6, seed=6), tier.ids(4, seed=7)
        ids, counts = torch.cat([ids_a, ids_b]), [6, 4]
        rows = grouped.get_grouped(["a", "b"], ids, counts)
        assert same(rows, torch.cat([alone.get("a", ids_a), alone.get("b", ids_b)]))
        new = random_rows(specs[0], 10, seed=8)
        grouped.put_grouped(["a", "b"], ids, counts, new)
        assert same(grouped.get("a", ids_a), new[:6])
        assert same(grouped.get("b", ids_b), new[6:])
        # Straight into / out of a CPU cache's slot storage: True with every row moved, or
        # False with nothing moved (the caller then takes the grouped calls).
        slots = torch.randperm(16)[:10]
        weights = torch.full((16, DIM), float("nan"))
        state = torch.full((16, STATE), float("nan"))
        if grouped.get_grouped_into(["a", "b"], ids, counts, weights, state, slots):
            assert same(torch.cat([weights[slots], state[slots]], 1), new)
        else:
            assert bool(weights.isnan().all()) and bool(state.isnan().all())
        weights[slots], state[slots] = new[:, :DIM], new[:, DIM:]
        weights[slots[0]] += 1.0
        before = exported(alone, "a")
        if alone.put_grouped_from(["a", "b"], ids, counts, weights, state, slots):
            assert same(alone.get("a", ids_a), torch.cat([weights, state], 1)[slots[:6]])
        else:
            assert all(same(x, y) for x, y in zip(exported(alone, "a"), before, strict=True))

    def test_duplicate_ids_in_one_call_read_one_row(
        self, tier: ContractTier, stores: list[Store]
    ) -> None:
        spec = tier.spec()
        store = self.fresh_store(tier, stores, spec)
        ids = tier.ids(5, seed=10)
        doubled = torch.cat([ids, ids[:3], ids[:1]])
        rows = store.get("t", doubled)  # first touch, each created once
        assert same(rows, spec.initial_rows(doubled))
        assert store.row_count("t") == ids.numel()
        written = random_rows(spec, 5, seed=11)
        store.put("t", ids, written)
        assert same(store.get("t", doubled), torch.cat([written, written[:3], written[:1]]))

    def test_declared_capabilities_behave_as_declared(
        self, tier: ContractTier, stores: list[Store]
    ) -> None:
        spec = tier.spec()
        store = self.fresh_store(tier, stores, spec)
        assert isinstance(store.parallel_io, bool)
        assert store.lease_owner is None or isinstance(store.lease_owner, str)
        assert store.keeps_scores("t") == (spec.capacity is not None)
        store.reset_io_stats()
        stats = store.io_stats()
        assert all(value == 0 for value in stats.values())
        ids = tier.ids(6, seed=20)
        store.get("t", ids)
        store.put("t", ids[:4], random_rows(spec, 4, seed=21))
        stats = store.io_stats()
        if "rows_read" in stats:  # the traffic through get, read and put
            assert stats["rows_read"] == 6 and stats["rows_written"] == 4
            assert stats["bytes_read"] == 6 * spec.row_bytes
            assert stats["bytes_written"] == 4 * spec.row_bytes
            assert stats["get_calls"] >= 1 and stats["put_calls"] >= 1
        if "hits" in stats:  # a row cache of its own: ids served or fetched
            assert stats["hits"] + stats["misses"] == 6
        store.flush()
        store.flush()  # idempotent
        assert store.row_count("t") == 6
        store.reset_io_stats()
        assert all(value == 0 for value in store.io_stats().values())

    def test_read_grouped_creates_nothing(self, tier: ContractTier, stores: list[Store]) -> None:
        """`Store.read_grouped` (the cache's reads under ``torch.no_grad()``): the rows a tier
        holds and the initial rows of the others, none of which it creates; pinning (bounded
        tables) creates nothing either."""
        specs = [tier.spec("a"), tier.spec("b", seed=9)]
        store = self.fresh_store(tier, stores, *specs)
        ids_a, ids_b = tier.ids(6, seed=30), tier.ids(4, seed=31)
        written = random_rows(specs[0], 3, seed=32)
        store.put("a", ids_a[:3], written)
        ids, counts = torch.cat([ids_a, ids_b]), [6, 4]
        pins = [True, True] if tier.capacity is not None else None
        rows = store.read_grouped(["a", "b"], ids, counts, pins)
        expected = torch.cat(
            [written, specs[0].initial_rows(ids_a[3:]), specs[1].initial_rows(ids_b)]
        )
        assert same(rows, expected)
        assert store.row_count("a") == 3 and store.row_count("b") == 0
        if pins is not None:
            store.unpin("a", ids_a)  # the absent ones were not pinned: ignored
            store.unpin("b", ids_b)
