"""HostKV's grouped calls (`get_grouped` / `put_grouped`): several tables in one call, one
compiled pass over dense float32 tables, and in every case what one `get` / `put` per table
gives (`Store`'s own grouped calls): the same rows, the same counters, the same errors, and
nothing changed by a call that raises."""

from __future__ import annotations

import pytest
import torch

import embcache.native as native
from embcache.kv.base import Store, TableSpec
from embcache.kv.host import HostKV

SIZES = {"a": 300, "b": 70, "c": 1000}
DIM, STATE = 5, 2


def _store(layouts: dict[str, str] | None = None) -> HostKV:
    kv = HostKV(pin_memory=False)
    for name, rows in SIZES.items():
        layout = (layouts or {}).get(name, "dense")
        kv.init_table(
            TableSpec(name, DIM, num_embeddings=None if layout == "hashed" else rows,
                      state_dim=STATE, state_init=0.5)
        )  # fmt: skip
    return kv


def _request(gen: torch.Generator, counts: dict[str, int]) -> tuple[list, torch.Tensor, list]:
    """Distinct ids of each table (its first and last rows among them), one table after
    another."""
    parts = []
    for name, n in counts.items():
        perm = torch.randperm(SIZES[name], generator=gen)
        last = SIZES[name] - 1
        ends = torch.tensor([0, last])
        ids = torch.cat([ends, perm[(perm != 0) & (perm != last)]])[:n] if n >= 2 else perm[:n]
        parts.append(ids)
    return list(counts), torch.cat(parts), list(counts.values())


def _fill(kv: HostKV, gen: torch.Generator) -> None:
    """Every row written, so that grouped reads find them all."""
    for name, rows in SIZES.items():
        kv.put(name, torch.arange(rows), torch.randn(rows, DIM + STATE, generator=gen))


def _rows(kv: HostKV) -> dict[str, torch.Tensor]:
    return {name: kv.read(name, torch.arange(rows)) for name, rows in SIZES.items()}


COUNTS = {"three tables": {"a": 40, "b": 7, "c": 300}, "one table": {"c": 50},
          "an empty group": {"a": 0, "c": 9}}  # fmt: skip


@pytest.mark.parametrize("case", list(COUNTS))
def test_grouped_get_and_put_are_the_per_table_calls(case: str) -> None:
    gen = torch.Generator().manual_seed(len(case))
    grouped, by_table = _store(), _store()
    for kv in (grouped, by_table):
        _fill(kv, torch.Generator().manual_seed(0))
        kv.reset_io_stats()
    tables, ids, counts = _request(gen, COUNTS[case])
    got = grouped.get_grouped(tables, ids, counts)
    want = Store.get_grouped(by_table, tables, ids, counts)
    assert torch.equal(got, want)
    rows = torch.randn(ids.numel(), DIM + STATE, generator=gen)
    grouped.put_grouped(tables, ids, counts, rows)
    Store.put_grouped(by_table, tables, ids, counts, rows)
    assert grouped.io_stats() == by_table.io_stats()
    after, expected = _rows(grouped), _rows(by_table)
    for name in SIZES:
        assert torch.equal(after[name], expected[name]), name


def test_rows_never_created_are_created_as_get_creates_them() -> None:
    """A grouped read of rows never touched falls back to `get`, which creates them with the
    table's initialiser; a later grouped read (the compiled pass) sees the same rows."""
    gen = torch.Generator().manual_seed(3)
    kv, twin = _store(), _store()
    tables, ids, counts = _request(gen, COUNTS["three tables"])
    first = kv.get_grouped(tables, ids, counts)
    assert torch.equal(first, Store.get_grouped(twin, tables, ids, counts))
    assert kv.io_stats()["rows_created"] == ids.numel()
    assert torch.equal(kv.get_grouped(tables, ids, counts), first)
    assert kv.io_stats()["rows_created"] == ids.numel()


@pytest.mark.parametrize("call", ["get", "put"])
@pytest.mark.parametrize("bad", [-1, "past"], ids=["negative", "past the table"])
def test_a_bad_id_raises_naming_its_table_and_changes_nothing(call: str, bad) -> None:
    gen = torch.Generator().manual_seed(4)
    kv = _store()
    _fill(kv, gen)
    tables, ids, counts = _request(gen, COUNTS["three tables"])
    ids[counts[0] + 3] = -1 if bad == -1 else SIZES["b"]  # an id of table b
    before, stats = _rows(kv), kv.io_stats()
    with pytest.raises(ValueError, match="'b'"):
        if call == "get":
            kv.get_grouped(tables, ids, counts)
        else:
            kv.put_grouped(tables, ids, counts, torch.randn(ids.numel(), DIM + STATE))
    after = _rows(kv)
    for name in SIZES:
        assert torch.equal(after[name], before[name]), name
    if call == "put":  # the tables before b's were not written either (one pass checks all)
        assert kv.io_stats()["rows_written"] == stats["rows_written"]


def test_tables_of_other_layouts_take_the_per_table_calls() -> None:
    gen = torch.Generator().manual_seed(5)
    kv, twin = _store({"b": "hashed"}), _store({"b": "hashed"})
    tables, ids, counts = _request(gen, COUNTS["three tables"])
    rows = torch.randn(ids.numel(), DIM + STATE, generator=gen)
    kv.put_grouped(tables, ids, counts, rows)
    Store.put_grouped(twin, tables, ids, counts, rows)
    assert torch.equal(kv.get_grouped(tables, ids, counts), rows)
    assert torch.equal(Store.get_grouped(twin, tables, ids, counts), rows)


def test_a_subclass_that_overrides_put_sees_every_grouped_write() -> None:
    seen = []

    class Logged(HostKV):
        def put(self, table, ids, rows):
            seen.append((table, ids.numel()))
            super().put(table, ids, rows)

    kv = Logged(pin_memory=False)
    for name, rows in SIZES.items():
        kv.init_table(TableSpec(name, DIM, num_embeddings=rows, state_dim=STATE))
    tables, ids, counts = _request(torch.Generator().manual_seed(6), COUNTS["three tables"])
    kv.put_grouped(tables, ids, counts, torch.randn(ids.numel(), DIM + STATE))
    assert seen == list(zip(tables, counts, strict=True))


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_the_compiled_pass_keeps_up_with_reallocated_tables() -> None:
    """The kernels' lists of a group's arrays follow a table that re-declares with wider
    state (a new array): a grouped read after it sees the new layout."""
    gen = torch.Generator().manual_seed(7)
    kv = _store()
    _fill(kv, gen)
    tables, ids, counts = _request(gen, COUNTS["three tables"])
    kv.get_grouped(tables, ids, counts)  # lists made for the old arrays
    for name, rows in SIZES.items():
        kv.init_table(TableSpec(name, DIM, num_embeddings=rows, state_dim=STATE + 1,
                                state_init=0.25))  # fmt: skip
    got = kv.get_grouped(tables, ids, counts)
    assert got.shape == (ids.numel(), DIM + STATE + 1)
    assert bool((got[:, DIM:] == 0.25).all())
    assert torch.equal(got, Store.get_grouped(kv, tables, ids, counts))
    kv.close()
    assert not kv._grouped.typed, "a closed store keeps no table's arrays alive"


# -- straight between the tables and a cache's slots (`get_grouped_into`, `put_grouped_from`) --

SLOTS = 2000  # rows of the test slot storage (more than a request's ids)


def _storage(gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot storage: random rows of ``gen``, or without one poisoned with NaN (a slot a call
    should have filled and did not shows)."""
    if gen is None:
        return torch.full((SLOTS, DIM), float("nan")), torch.full((SLOTS, STATE), float("nan"))
    return torch.randn(SLOTS, DIM, generator=gen), torch.randn(SLOTS, STATE, generator=gen)


def _slots(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(SLOTS, generator=gen)[:n]


def _filled_pair(seed: int, case: str) -> tuple[HostKV, HostKV, tuple, torch.Generator]:
    """Two stores with the same rows, stats reset, and a request of ``COUNTS[case]`` with a
    slot for each id: ``(kv, twin, (tables, ids, counts, slots), gen)``."""
    gen = torch.Generator().manual_seed(seed)
    kv, twin = _store(), _store()
    for store in (kv, twin):
        _fill(store, torch.Generator().manual_seed(0))
        store.reset_io_stats()
    tables, ids, counts = _request(gen, COUNTS[case])
    return kv, twin, (tables, ids, counts, _slots(gen, ids.numel())), gen


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
@pytest.mark.parametrize("case", list(COUNTS))
def test_a_grouped_read_into_slots_lands_where_get_grouped_and_a_copy_put_it(case: str) -> None:
    kv, twin, (tables, ids, counts, slots), _ = _filled_pair(10 + len(case), case)
    weights, state = _storage()
    assert kv.get_grouped_into(tables, ids, counts, weights, state, slots)
    rows = twin.get_grouped(tables, ids, counts)
    want_w, want_s = _storage()
    want_w[slots], want_s[slots] = rows[:, :DIM], rows[:, DIM:]
    assert torch.equal(weights.isnan(), want_w.isnan())  # no other slot written
    assert torch.equal(weights.nan_to_num(), want_w.nan_to_num())
    assert torch.equal(state.nan_to_num(), want_s.nan_to_num())
    assert kv.io_stats() == twin.io_stats()


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
@pytest.mark.parametrize("case", list(COUNTS))
def test_a_grouped_write_from_slots_is_put_grouped_of_their_rows(case: str) -> None:
    kv, twin, (tables, ids, counts, slots), gen = _filled_pair(20 + len(case), case)
    weights, state = _storage(gen)
    assert kv.put_grouped_from(tables, ids, counts, weights, state, slots)
    twin.put_grouped(tables, ids, counts, torch.cat([weights[slots], state[slots]], dim=1))
    assert kv.io_stats() == twin.io_stats()
    after, expected = _rows(kv), _rows(twin)
    for name in SIZES:
        assert torch.equal(after[name], expected[name]), name


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_a_grouped_write_from_slots_creates_the_rows_it_writes() -> None:
    gen = torch.Generator().manual_seed(30)
    kv = _store()
    tables, ids, counts = _request(gen, COUNTS["three tables"])
    slots = _slots(gen, ids.numel())
    weights, state = _storage(gen)
    assert kv.put_grouped_from(tables, ids, counts, weights, state, slots)
    assert sum(kv.row_count(name) for name in SIZES) == ids.numel()
    got = kv.get_grouped(tables, ids, counts)  # the compiled read: every row exists now
    assert torch.equal(got, torch.cat([weights[slots], state[slots]], dim=1))


def _refusals(gen: torch.Generator) -> dict[str, tuple]:
    """Calls the straight moves must refuse, changing nothing: ``name -> (kv, args, also a
    write)``."""
    cases: dict[str, tuple] = {}
    for name in ("uncreated row", "bad id", "bad slot", "float64 storage", "other width",
                 "hashed table", "storage with grad"):  # fmt: skip
        kv = _store({"b": "hashed"} if name == "hashed table" else None)
        _fill(kv, gen)
        tables, ids, counts = _request(gen, COUNTS["three tables"])
        slots = _slots(gen, ids.numel())
        weights, state = torch.randn(SLOTS, DIM), torch.randn(SLOTS, STATE)
        if name == "uncreated row":
            kv.remove("c", ids[counts[0] + counts[1] + 5 :][:1])
        elif name == "bad id":
            ids[counts[0] + 3] = SIZES["b"]
        elif name == "bad slot":
            slots[-1] = SLOTS
        elif name == "float64 storage":
            weights, state = weights.double(), state.double()
        elif name == "other width":
            state = torch.randn(SLOTS, STATE + 1)
        elif name == "storage with grad":
            weights.requires_grad_(True)
        cases[name] = (kv, (tables, ids, counts, weights, state, slots), name != "uncreated row")
    return cases


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
@pytest.mark.parametrize("call", ["read", "write"])
def test_straight_moves_refuse_what_they_cannot_take_and_change_nothing(call: str) -> None:
    for name, (kv, args, writes) in _refusals(torch.Generator().manual_seed(40)).items():
        if call == "write" and not writes:
            continue  # a write creates rows: one never created is no reason to refuse
        weights, state = args[3].detach().clone(), args[4].detach().clone()
        before, stats = _rows(kv), kv.io_stats()
        if call == "read":
            assert not kv.get_grouped_into(*args), name
        else:
            assert not kv.put_grouped_from(*args), name
        assert kv.io_stats() == stats, name
        after = _rows(kv)
        for table in SIZES:
            assert torch.equal(after[table], before[table]), (name, table)
        assert torch.equal(args[3].detach(), weights) and torch.equal(args[4], state), name


def test_a_tier_without_straight_moves_says_so() -> None:
    """`Store`'s own straight moves take no call: the caller uses the grouped calls."""
    kv = _store()
    _fill(kv, torch.Generator().manual_seed(0))
    tables, ids, counts = _request(torch.Generator().manual_seed(50), COUNTS["one table"])
    weights, state = _storage()
    slots = torch.arange(ids.numel())
    assert not Store.get_grouped_into(kv, tables, ids, counts, weights, state, slots)
    assert not Store.put_grouped_from(kv, tables, ids, counts, weights, state, slots)
    assert bool(weights.isnan().all())
