"""TierTransfer on a CPU: the rows `exchange` reads come back in parts that cover every id
once, whatever the order of the ids and the tables' sizes; the rows it writes land under their
ids; `place` copies the parts into the slots given for the ids."""

from __future__ import annotations

import pytest
import torch

import embcache.native as native
from embcache.backend import for_device
from embcache.cache.transfer import _PLACE_ROWS, SlotStorage, TierTransfer, take
from embcache.kv.base import TableSpec
from embcache.kv.host import HostKV

K = 40  # fusion bits
DIM, STATE = 5, 1


def _setup(sizes: list[int]) -> tuple[HostKV, TierTransfer]:
    store = HostKV()
    specs = {}
    for idx, rows in enumerate(sizes):
        spec = TableSpec(f"t{idx}", DIM, num_embeddings=rows, state_dim=STATE, state_init=0.5)
        store.init_table(spec)
        specs[idx] = spec
    return store, TierTransfer(store, specs, K, torch.device("cpu"), for_device("cpu"))


def _fused(table: int, raw: torch.Tensor) -> torch.Tensor:
    return raw | (table << K)


def _ids(sizes: list[int], counts: list[int], gen: torch.Generator) -> torch.Tensor:
    return torch.cat(
        [
            _fused(i, torch.randperm(rows, generator=gen)[:n])
            for i, (rows, n) in enumerate(zip(sizes, counts, strict=True))
        ]
    )


def _stored(store: HostKV, fused: torch.Tensor) -> torch.Tensor:
    return torch.stack(
        [store.read(f"t{int(f) >> K}", torch.tensor([int(f) & ((1 << K) - 1)]))[0] for f in fused]
    )


# Many small tables (joined into parts), one large one (a part of its own), and both.
CASES = {
    "small tables": ([50] * 9, [7, 0, 3, 12, 1, 9, 4, 2, 30]),
    "large table": ([3 * _PLACE_ROWS], [_PLACE_ROWS + 100]),
    "mixed": ([40, 3 * _PLACE_ROWS, 30, 20], [10, 2 * _PLACE_ROWS, 25, 3]),
}


def _case(
    name: str, seed: int, in_order: bool
) -> tuple[HostKV, TierTransfer, torch.Tensor, torch.Generator]:
    """The store and transfer of ``CASES[name]``, and fresh random ids of its tables, sorted
    or shuffled."""
    sizes, counts = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    store, transfer = _setup(sizes)
    ids = _ids(sizes, counts, gen)
    ids = ids.sort().values if in_order else ids[torch.randperm(ids.numel(), generator=gen)]
    return store, transfer, ids, gen


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("in_order", [True, False], ids=["sorted ids", "shuffled ids"])
def test_reads_cover_every_id_once_with_its_row(case: str, in_order: bool) -> None:
    store, transfer, ids, gen = _case(case, len(case) + in_order, in_order)
    # Rows the tier holds already (written), others created on this read.
    written = ids[::3]
    rows = torch.randn(written.numel(), DIM + STATE, generator=gen)
    transfer.write(written, rows)

    parts = transfer.exchange(ids[:0], lambda p: torch.empty(0), ids)
    seen = torch.zeros(ids.numel(), dtype=torch.int64)
    got = torch.full((ids.numel(), DIM + STATE), float("nan"))
    for positions, part in parts:
        at = torch.arange(ids.numel())[positions] if isinstance(positions, slice) else positions
        seen[at] += 1
        got[at] = part
    assert seen.tolist() == [1] * ids.numel()
    assert torch.equal(got, _stored(store, ids))
    assert torch.equal(got[::3], rows)
    if case == "small tables":
        assert len(parts) == 1  # joined: fewer than _PLACE_ROWS rows in all
    if case == "large table":
        assert len(parts) == 1 and parts[0][1].shape[0] == ids.numel()


@pytest.mark.parametrize("in_order", [True, False], ids=["sorted ids", "shuffled ids"])
def test_writes_land_under_their_ids_and_place_fills_the_slots(in_order: bool) -> None:
    store, transfer, ids, gen = _case("mixed", 7 + in_order, in_order)
    source = torch.randn(ids.numel(), DIM + STATE, generator=gen)
    asked = []

    def write_rows(positions: torch.Tensor | slice) -> torch.Tensor:
        asked.append(positions)
        return take(source, positions)

    assert transfer.exchange(ids, write_rows, ids[:0]) == []
    assert len(asked) == 1  # one gather of all the rows
    assert torch.equal(_stored(store, ids), source)

    # Read them back into slots of a cache, poisoned with NaN.
    n_slots = ids.numel() + 17
    weights = torch.full((n_slots, DIM), float("nan"))
    state = torch.full((n_slots, STATE), float("nan"))
    slots = torch.randperm(n_slots, generator=gen)[: ids.numel()]
    transfer.place(weights, state, slots, transfer.exchange(ids[:0], write_rows, ids))
    assert torch.equal(weights[slots], source[:, :DIM])
    assert torch.equal(state[slots], source[:, DIM:])
    others = torch.ones(n_slots, dtype=torch.bool)
    others[slots] = False
    assert bool(weights[others].isnan().all())


BACKENDS = pytest.mark.parametrize(
    "backend", ["auto", "torch"], ids=["compiled grouping", "torch grouping"]
)


@BACKENDS
def test_sorted_ids_are_grouped_without_a_permutation(monkeypatch, backend: str) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    _, transfer = _setup([100, 100, 100])
    ids = torch.cat([_fused(0, torch.tensor([3, 9])), _fused(2, torch.tensor([1, 2, 50]))])
    expected = [(0, 0, [3, 9]), (2, 2, [1, 2, 50])]
    order, groups, _ = transfer._grouped(ids)
    assert order is None
    assert [(idx, start, raw.tolist()) for idx, start, raw in groups] == expected
    order, groups, _ = transfer._grouped(ids.flip(0))
    assert order is not None and torch.equal(ids.flip(0)[order], ids)
    assert [(idx, start, raw.tolist()) for idx, start, raw in groups] == expected


@BACKENDS
@pytest.mark.parametrize("tables", [3, 300], ids=["8-bit table keys", "16-bit table keys"])
def test_writes_are_grouped_by_table_in_their_own_order(
    monkeypatch, tables: int, backend: str
) -> None:
    """Grouping for a write keeps each table's ids in the order given (no sort of the ids),
    and sorted ids need no permutation."""
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    _, transfer = _setup([100] * tables)
    gen = torch.Generator().manual_seed(tables)
    table = torch.randint(0, tables, (500,), generator=gen)
    raw = torch.randint(0, 100, (500,), generator=gen)
    ids = torch.unique(_fused(table, raw))
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    order, groups, _ = transfer._grouped(ids, ascending=False)
    assert order is not None
    grouped = ids[order]
    assert torch.equal(grouped >> K, (grouped >> K).sort().values)  # by table
    for idx, start, raw_ids in groups:
        given = ids[(ids >> K) == idx] & ((1 << K) - 1)  # that table's ids, in given order
        assert torch.equal(raw_ids, given)
        assert torch.equal(grouped[start : start + raw_ids.numel()], _fused(idx, raw_ids))
    assert sum(r.numel() for _, _, r in groups) == ids.numel()
    ids = ids.sort().values
    order, sorted_groups, _ = transfer._grouped(ids, ascending=False)
    assert order is None
    assert torch.equal(torch.cat([_fused(idx, raw) for idx, _, raw in sorted_groups]), ids)


@pytest.mark.parametrize("in_order", [True, False], ids=["sorted ids", "shuffled ids"])
def test_read_gives_each_id_its_row_and_creates_none(in_order: bool) -> None:
    store, transfer, ids, gen = _case("mixed", 21 + in_order, in_order)
    written = ids[1::2]
    rows = torch.randn(written.numel(), DIM + STATE, generator=gen)
    transfer.write(written, rows)
    before = {name: len(table) for name, table in store._tables.items()}

    got = transfer.read(ids)
    assert torch.equal(got[1::2], rows)
    assert torch.equal(got, _stored(store, ids))  # the others: their initial values
    assert {name: len(table) for name, table in store._tables.items()} == before
    assert transfer.read(ids[:0]).shape == (0, DIM + STATE)


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
@pytest.mark.parametrize("in_order", [True, False], ids=["sorted", "shuffled"])
def test_rows_move_straight_between_the_tier_and_the_slots(in_order: bool) -> None:
    """Given the cache's storage (`SlotStorage`), a grouped exchange writes each id's row from
    its slot and reads each id's row into its slot, returning no parts, and asks ``write_rows``
    for nothing; the tier's rows and the slots end as the path through rows tensors leaves
    them."""
    store, transfer, ids, gen = _case("mixed", 11 + in_order, in_order)
    twin, twin_transfer = _setup(CASES["mixed"][0])
    half = ids.numel() // 2
    write_ids, read_ids = ids[:half], ids[half:]
    source = torch.randn(read_ids.numel(), DIM + STATE, generator=gen)
    for t in (transfer, twin_transfer):  # the rows to read exist: the straight read takes them
        t.exchange(read_ids, lambda positions: take(source, positions), read_ids[:0])
    n_slots = ids.numel() + 17
    weights = torch.randn(n_slots, DIM, generator=gen)
    state = torch.randn(n_slots, STATE, generator=gen)
    perm = torch.randperm(n_slots, generator=gen)
    write_slots, read_slots = perm[:half], perm[half : ids.numel()]
    twin_weights, twin_state = weights.clone(), state.clone()
    weights[read_slots] = state[read_slots] = float("nan")  # filled by the read, or it shows
    asked = []

    def write_rows(positions: torch.Tensor | slice) -> torch.Tensor:
        asked.append(positions)
        return torch.cat([take(twin_weights, take(write_slots, positions)),
                          take(twin_state, take(write_slots, positions))], dim=1)  # fmt: skip

    slots = SlotStorage(weights, state, write_slots, read_slots)
    assert transfer.exchange(write_ids, write_rows, read_ids, slots=slots) == []
    assert asked == []
    parts = twin_transfer.exchange(write_ids, write_rows, read_ids)
    twin_transfer.place(twin_weights, twin_state, read_slots, parts)
    assert torch.equal(weights, twin_weights) and torch.equal(state, twin_state)
    assert torch.equal(_stored(store, ids), _stored(twin, ids))
    assert store.io_stats() == twin.io_stats()


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_a_read_of_rows_never_created_goes_through_rows_and_creates_them() -> None:
    """Rows the tier must create first are read as before (the tier's initialiser, through a
    part to place): the straight read refuses them and changes nothing."""
    store, transfer, ids, gen = _case("small tables", 13, True)
    _, twin_transfer = _setup(CASES["small tables"][0])
    weights = torch.full((ids.numel(), DIM), float("nan"))
    state = torch.full((ids.numel(), STATE), float("nan"))
    slots = torch.randperm(ids.numel(), generator=gen)
    parts = transfer.exchange(ids[:0], None, ids, slots=SlotStorage(weights, state, None, slots))
    assert parts and bool(weights.isnan().all())
    transfer.place(weights, state, slots, parts)
    assert torch.equal(weights[slots], twin_transfer.read(ids)[:, :DIM])
    assert store.io_stats()["rows_created"] == ids.numel()


class _Counted(HostKV):
    """HostKV recording whether each straight move was taken (True) or refused."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[tuple[str, bool]] = []

    def get_grouped_into(self, *args: object) -> bool:
        self.moves.append(("read", super().get_grouped_into(*args)))
        return self.moves[-1][1]

    def put_grouped_from(self, *args: object) -> bool:
        self.moves.append(("write", super().put_grouped_from(*args)))
        return self.moves[-1][1]


class _Refusing(HostKV):
    """HostKV without straight moves (as `Store` has none): rows go through rows tensors."""

    def get_grouped_into(self, *args: object) -> bool:
        return False

    def put_grouped_from(self, *args: object) -> bool:
        return False


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_a_cache_moves_its_rows_straight_and_ends_as_through_rows() -> None:
    """A CPU cache's resolves (victims out, misses in) and its release of scratch rows move
    rows straight between the tier and the slots, and end with the same slots, rows and tier
    as over a tier that has no straight moves."""
    from embcache.cache.config import CacheConfig
    from embcache.cache.hot_cache import HotCache

    sizes = [400, 900]
    caches = []
    for store in (_Counted(), _Refusing()):
        tables = []
        for idx, rows in enumerate(sizes):
            spec = TableSpec(f"t{idx}", DIM, num_embeddings=rows, state_dim=STATE, seed=idx)
            store.init_table(spec)
            store.put(spec.name, torch.arange(rows), torch.randn(rows, DIM + STATE,
                      generator=torch.Generator().manual_seed(idx)))  # fmt: skip
            tables.append((idx, spec))
        config = CacheConfig(capacity=128, ways=8, max_scratch_rows=1024)
        caches.append(HotCache(tables, config, store, "cpu", K))
    gen = torch.Generator().manual_seed(17)
    for step in range(12):
        table = torch.randint(0, 2, (200,), generator=gen)
        raw = (torch.rand(200, generator=gen) ** 2 * torch.tensor(sizes)[table]).long()
        ids = torch.unique(raw | (table << K))
        delta = torch.randn(ids.numel(), DIM, generator=gen)
        got = []
        for cache in caches:
            slots = cache.resolve(ids)
            cache.weights[slots] += delta
            cache.mark_dirty(slots)
            cache.unlock(slots)
            got.append(slots)
        assert torch.equal(got[0], got[1]), step
        assert torch.equal(caches[0].weights, caches[1].weights), step
    for cache in caches:
        cache.flush()
    for idx, rows in enumerate(sizes):
        ours, theirs = (c.store.read(f"t{idx}", torch.arange(rows)) for c in caches)
        assert torch.equal(ours, theirs), idx
    moves = caches[0].store.moves
    assert ("read", True) in moves and ("write", True) in moves
    assert all(taken for _, taken in moves), "every row exists: no move refused"
    assert caches[0].scratch_rows > 0  # batches wider than the cache: scratch rows written too
