"""HostKV: the embedded tier, dense bounded tables and hash-indexed unbounded ones."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.kv.base import Store, TableSpec
from embcache.kv.host import HostKV

N = 1000  # rows of the bounded test tables
BIG = 2**62  # largest id the unbounded tests use

LAYOUTS = ["bounded", "unbounded"]


def spec_for(layout: str, name: str = "t", dim: int = 5, **kwargs: object) -> TableSpec:
    """A test table: dim 5 (not a power of two), N rows when bounded."""
    num_embeddings = N if layout == "bounded" else None
    return TableSpec(name, dim=dim, num_embeddings=num_embeddings, **kwargs)  # type: ignore[arg-type]


def make_store(*specs: TableSpec) -> HostKV:
    kv = HostKV(pin_memory=False)
    for spec in specs:
        kv.init_table(spec)
    return kv


def affine_init(ids: torch.Tensor, dim: int) -> torch.Tensor:
    """A plain, exactly representable init: row ``i`` is ``[i + 0.25 c for c < dim]``."""
    return (ids.to(torch.float64).unsqueeze(1) + 0.25 * torch.arange(dim)).float()


def export_all(kv: HostKV, table: str, chunk_rows: int = 65536) -> tuple[torch.Tensor, ...]:
    chunks = list(kv.export_rows(table, chunk_rows=chunk_rows))
    if not chunks:
        width = kv.table_spec(table).row_width
        return torch.empty(0, dtype=torch.int64), torch.empty(0, width)
    return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])


def snapshot(kv: HostKV) -> dict[str, object]:
    """Everything observable about a store, for before/after comparisons."""
    state: dict[str, object] = {
        "tables": kv.tables(),
        "stats": kv.io_stats(),
        "memory": kv.memory_bytes(),
    }
    for name in kv.tables():
        ids, rows = export_all(kv, name)
        state[name] = (kv.table_spec(name), ids.tolist(), rows.tolist())
    return state


def sample_ids(layout: str, n: int, seed: int) -> torch.Tensor:
    """``n`` distinct ids valid for the layout; always includes the last row when bounded."""
    g = torch.Generator().manual_seed(seed)
    if layout == "bounded":
        ids = torch.randperm(N, generator=g)[: n - 1]
        ids = torch.cat([ids[ids != N - 1], torch.tensor([N - 1])])
    else:
        ids = torch.randint(0, BIG, (n,), generator=g).unique()
        ids = torch.cat([ids[(ids != 0) & (ids != BIG)][: n - 2], torch.tensor([0, BIG])])
    return ids[torch.randperm(ids.numel(), generator=g)]


# ------------------------------------------------------------------------------------------
# first touch: created once, by the spec's initialiser, independent of access order
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("init", [None, affine_init], ids=["default_init", "affine_init"])
def test_initial_rows_independent_of_access_order(layout: str, init: Callable | None) -> None:
    spec = spec_for(layout, state_dim=2, state_init=0.125, init=init)
    ids = sample_ids(layout, 300, seed=0)

    forward = make_store(spec)
    for batch in ids.split(7):
        forward.get("t", batch)
    backward = make_store(spec)
    for batch in ids.flip(0).split(64):
        backward.get("t", batch)
    whole = make_store(spec)

    expected = spec.initial_rows(ids)
    assert expected[:, 5:].eq(0.125).all()
    for kv in (forward, backward, whole):
        assert torch.equal(kv.get("t", ids), expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_initialiser_runs_once_per_batch_on_missing_ids_only(layout: str) -> None:
    calls: list[list[int]] = []

    def recording_init(ids: torch.Tensor, dim: int) -> torch.Tensor:
        calls.append(sorted(ids.tolist()))
        return affine_init(ids, dim)

    kv = make_store(spec_for(layout, init=recording_init))
    kv.get("t", torch.tensor([3, 9, 4]))
    kv.put("t", torch.tensor([7]), torch.zeros(1, 5))
    kv.get("t", torch.tensor([9, 7, 11, 3, 12]))
    kv.get("t", torch.tensor([12, 11]))
    assert calls == [[3, 4, 9], [11, 12]]
    assert kv.io_stats()["rows_created"] == 5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_put_then_get_returns_put_rows_not_the_initialiser(layout: str) -> None:
    kv = make_store(spec_for(layout, state_dim=3))
    ids = sample_ids(layout, 200, seed=1)
    rows = torch.randn(ids.numel(), 8)
    kv.put("t", ids, rows)
    perm = torch.randperm(ids.numel())
    assert torch.equal(kv.get("t", ids[perm]), rows[perm])
    assert kv.io_stats()["rows_created"] == 0

    # Rows that were read first, then written, also keep the written value.
    more = sample_ids(layout, 50, seed=2)
    kv.get("t", more)
    new_rows = torch.randn(more.numel(), 8)
    kv.put("t", more, new_rows)
    assert torch.equal(kv.get("t", more), new_rows)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_get_returns_a_copy(layout: str) -> None:
    kv = make_store(spec_for(layout))
    ids = torch.tensor([1, 2])
    rows = kv.get("t", ids)
    rows += 100.0
    assert torch.equal(kv.get("t", ids), kv.table_spec("t").initial_rows(ids))


def test_bounded_and_unbounded_agree_with_the_same_init() -> None:
    bounded = make_store(spec_for("bounded", init=affine_init, state_dim=1, state_init=0.5))
    unbounded = make_store(spec_for("unbounded", init=affine_init, state_dim=1, state_init=0.5))
    ids = sample_ids("bounded", 400, seed=3)
    for kv in (bounded, unbounded):
        kv.get("t", ids[:150])
        kv.put("t", ids[100:200], torch.full((100, 6), -2.0))
    a, b = bounded.get("t", ids), unbounded.get("t", ids)
    assert torch.equal(a, b)
    assert torch.equal(a[:100, :5], affine_init(ids[:100], 5))
    assert torch.equal(a[100:200], torch.full((100, 6), -2.0))
    assert torch.equal(export_all(bounded, "t")[1], export_all(unbounded, "t")[1])


def test_unbounded_large_ids_survive_many_grows() -> None:
    spec = spec_for("unbounded", dim=3)
    kv = make_store(spec)
    ids = sample_ids("unbounded", 200_000, seed=4)
    n = ids.numel()
    half = n // 2
    for batch in ids[:half].split(25_000):  # first half created by get, in batches
        kv.get("t", batch)
    written = torch.randn(n - half, 3)
    kv.put("t", ids[half:], written)  # second half created by put, in one call

    index = kv._tables["t"].index  # the table's HashIndex: it grew, and stays half empty
    assert len(index) == n
    assert index.num_slots >= 2 * n

    perm = torch.randperm(n)
    expected = torch.cat([spec.initial_rows(ids[:half]), written])
    assert torch.equal(kv.get("t", ids[perm]), expected[perm])

    exported_ids, exported_rows = export_all(kv, "t", chunk_rows=50_000)
    order = ids.argsort()
    assert torch.equal(exported_ids, ids[order])
    assert torch.equal(exported_rows, expected[order])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_other_integer_id_dtypes_are_converted(layout: str, dtype: torch.dtype) -> None:
    kv = make_store(spec_for(layout))
    ids = torch.tensor([0, 5, 99], dtype=dtype)
    rows = torch.randn(3, 5)
    kv.put("t", ids, rows)
    assert torch.equal(kv.get("t", ids.long()), rows)
    assert torch.equal(kv.get("t", ids), rows)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_empty_ids(layout: str) -> None:
    kv = make_store(spec_for(layout, state_dim=2))
    empty = torch.empty(0, dtype=torch.int64)
    assert kv.get("t", empty).shape == (0, 7)
    kv.put("t", empty, torch.empty(0, 7))
    assert export_all(kv, "t")[0].numel() == 0


def test_unbounded_get_tolerates_repeated_new_ids() -> None:
    kv = make_store(spec_for("unbounded"))
    ids = torch.tensor([BIG, 3, BIG, 3, 8])
    rows = kv.get("t", ids)
    assert torch.equal(rows[0], rows[2]) and torch.equal(rows[1], rows[3])
    assert export_all(kv, "t")[0].tolist() == [3, 8, BIG]
    assert kv.io_stats()["rows_created"] == 3


# ------------------------------------------------------------------------------------------
# declaring tables
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_redeclare_with_state_keeps_weights_and_sets_state(layout: str) -> None:
    kv = make_store(spec_for(layout))
    ids = sample_ids(layout, 100, seed=5)
    read, written = ids[:60], ids[60:]
    kv.get("t", read)
    kv.put("t", written, torch.randn(40, 5))
    weights = kv.get("t", ids)

    # An optimizer attaches two state columns.
    kv.init_table(spec_for(layout, state_dim=2, state_init=0.1))
    rows = kv.get("t", ids)
    assert rows.shape == (100, 7)
    assert torch.equal(rows[:, :5], weights)
    assert torch.equal(rows[:, 5:], torch.full((100, 2), 0.1))
    fresh = sample_ids(layout, 30, seed=6)
    fresh = fresh[~torch.isin(fresh, ids)]
    assert kv.get("t", fresh)[:, 5:].eq(0.1).all()

    # Training writes state; declaring the same spec again keeps it...
    trained = torch.randn(100, 7)
    kv.put("t", ids, trained)
    kv.init_table(spec_for(layout, state_dim=2, state_init=0.1))
    assert torch.equal(kv.get("t", ids), trained)

    # ... another state_init resets it, another state_dim re-sizes it, weights always kept.
    kv.init_table(spec_for(layout, state_dim=2, state_init=0.5))
    rows = kv.get("t", ids)
    assert torch.equal(rows[:, :5], trained[:, :5]) and rows[:, 5:].eq(0.5).all()
    kv.init_table(spec_for(layout, state_dim=0))
    assert torch.equal(kv.get("t", ids), trained[:, :5])
    assert kv.table_spec("t").state_dim == 0


def test_redeclare_before_any_touch_uses_the_new_state() -> None:
    kv = make_store(spec_for("bounded"))
    kv.init_table(spec_for("bounded", state_dim=1, state_init=3.0))
    assert kv.memory_bytes() == 0  # dense array not allocated before the first touch
    assert kv.get("t", torch.tensor([N - 1]))[:, 5].eq(3.0).all()
    assert kv.memory_bytes() >= N * 6 * 4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("field", "new_value"),
    [("dim", 6), ("num_embeddings", 2 * N), ("num_embeddings", None)],
    ids=["dim", "more_rows", "unbounded"],
)
def test_redeclare_with_another_shape_raises(layout: str, field: str, new_value: object) -> None:
    kv = make_store(spec_for(layout))
    kv.get("t", torch.tensor([1, 2, 3]))
    old = getattr(kv.table_spec("t"), field)
    if old == new_value:
        new_value = N
    before = snapshot(kv)
    bad = spec_for(layout)
    setattr(bad, field, new_value)
    with pytest.raises(ValueError, match=f"'t'.*{field}={old}.*{field}={new_value}"):
        kv.init_table(bad)
    assert snapshot(kv) == before


def test_tables_and_specs() -> None:
    a, b = spec_for("bounded", "a"), spec_for("unbounded", "b", state_dim=1)
    kv = make_store(a, b)
    assert isinstance(kv, Store)
    assert kv.tables() == ["a", "b"]
    assert kv.table_spec("a") == a and kv.table_spec("b") == b
    a.dim = 99  # the store keeps its own copy
    assert kv.table_spec("a").dim == 5


# ------------------------------------------------------------------------------------------
# checkpoints and accounting
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_import_round_trip(layout: str) -> None:
    spec = spec_for(layout, state_dim=1)
    kv = make_store(spec)
    ids = sample_ids(layout, 500, seed=7)
    kv.get("t", ids[:300])
    kv.put("t", ids[250:], torch.randn(ids.numel() - 250, 6))

    chunks = list(kv.export_rows("t", chunk_rows=77))
    assert all(0 < c[0].numel() <= 77 for c in chunks)
    exported_ids = torch.cat([c[0] for c in chunks])
    assert torch.equal(exported_ids, ids.sort().values)  # ascending, created rows only

    restored = make_store(spec)
    for chunk_ids, chunk_rows in chunks:
        restored.import_rows("t", chunk_ids, chunk_rows)
    assert restored.io_stats()["rows_written"] == 0  # checkpoint traffic is not tier I/O
    a, b = export_all(kv, "t"), export_all(restored, "t")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    untouched = sample_ids(layout, 40, seed=8)
    probe = torch.cat([ids, untouched[~torch.isin(untouched, ids)]])
    assert torch.equal(kv.get("t", probe), restored.get("t", probe))


def test_export_lists_created_rows_only() -> None:
    kv = make_store(spec_for("bounded"))
    assert export_all(kv, "t")[0].numel() == 0
    kv.get("t", torch.tensor([N - 1, 0]))
    kv.put("t", torch.tensor([500]), torch.ones(1, 5))
    assert export_all(kv, "t")[0].tolist() == [0, 500, N - 1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_creates_nothing_and_sees_written_rows(layout: str) -> None:
    kv = make_store(spec_for(layout, state_dim=2, state_init=0.5))
    fresh = make_store(spec_for(layout, state_dim=2, state_init=0.5))
    ids = torch.tensor([N - 1, 0, 17, 3]) if layout == "bounded" else torch.tensor([BIG, 0, 17, 3])
    # Untouched rows read as the initialiser's, and stay absent: nothing to export.
    assert torch.equal(kv.read("t", ids), fresh.get("t", ids))
    assert export_all(kv, "t")[0].numel() == 0
    assert kv.io_stats()["rows_created"] == 0
    assert kv.io_stats()["rows_read"] == ids.numel()
    # Rows that exist read as stored; the others still as the initialiser's, still absent.
    kv.put("t", ids[:1], torch.full((1, 7), 3.0))
    kv.get("t", ids[1:2])
    got = kv.read("t", ids)
    assert torch.equal(got[0], torch.full((7,), 3.0))
    assert torch.equal(got[1:], fresh.get("t", ids[1:]))
    assert sorted(export_all(kv, "t")[0].tolist()) == sorted(ids[:2].tolist())
    assert kv.read("t", torch.empty(0, dtype=torch.int64)).shape == (0, 7)
    with pytest.raises(ValueError, match="negative"):
        kv.read("t", torch.tensor([-1]))


def test_a_dense_table_larger_than_memory_is_refused_before_anything_changes() -> None:
    """2**32 rows x 64: declaring allocates nothing (a meta-device model may); reading creates
    nothing; the first write is refused with a ValueError before anything is allocated."""
    kv = make_store(
        spec_for("bounded", name="small"), TableSpec("huge", dim=64, num_embeddings=2**32)
    )
    ids = torch.tensor([0, 2**32 - 1])
    assert kv.read("huge", ids).shape == (2, 64)
    message = r"'huge': 4,294,967,296 rows of 64 float32 need [\d,]+ bytes as a dense host array"
    with pytest.raises(ValueError, match=message):
        kv.get("huge", ids)
    with pytest.raises(ValueError, match="dense host array"):
        kv.put("huge", ids, torch.ones(2, 64))
    assert kv.memory_bytes() == 0 and kv.io_stats()["rows_created"] == 0
    assert export_all(kv, "huge")[0].numel() == 0
    kv.get("small", torch.arange(3))
    with pytest.raises(ValueError, match="dense host array"):  # state columns that cannot fit
        kv.init_table(spec_for("bounded", name="small", state_dim=2**40))
    assert kv.table_spec("small").state_dim == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_io_stats_add_up(layout: str) -> None:
    kv = make_store(spec_for(layout, state_dim=3))
    kv.get("t", torch.arange(10))
    kv.get("t", torch.arange(5, 25))
    kv.put("t", torch.arange(7), torch.zeros(7, 8))
    kv.get("t", torch.empty(0, dtype=torch.int64))
    assert kv.io_stats() == {
        "rows_read": 30,
        "rows_written": 7,
        "bytes_read": 30 * 8 * 4,
        "bytes_written": 7 * 8 * 4,
        "get_calls": 3,
        "put_calls": 1,
        "rows_created": 25,
    }
    kv.reset_io_stats()
    assert set(kv.io_stats().values()) == {0}


# ------------------------------------------------------------------------------------------
# bad input: a clear error naming what is wrong, and nothing changes
# ------------------------------------------------------------------------------------------

I64 = torch.int64
BAD_CALLS: list[tuple[str, str, Callable[[HostKV], object], type[Exception], str]] = [
    # (id, layout, call, exception, message pattern)
    ("negative", "bounded", lambda kv: kv.get("t", torch.tensor([1, -4, 2])), ValueError,
     r"'t'.*id -4 at position 1.*\[0, 1000\)"),
    ("too_big", "bounded", lambda kv: kv.get("t", torch.tensor([7, N])), ValueError,
     r"'t'.*id 1000 at position 1.*\[0, 1000\)"),
    ("put_too_big", "bounded", lambda kv: kv.put("t", torch.tensor([2, 10**12]), torch.ones(2, 5)),
     ValueError, r"'t'.*id 1000000000000.*\[0, 1000\)"),
    ("negative_unbounded", "unbounded", lambda kv: kv.get("t", torch.tensor([5, -(2**40)])),
     ValueError, r"'t'.*id -1099511627776.*>= 0"),
    ("put_negative_unbounded", "unbounded",
     lambda kv: kv.put("t", torch.tensor([77, -1]), torch.ones(2, 5)), ValueError, r"'t'.*id -1"),
    ("float_ids", "bounded", lambda kv: kv.get("t", torch.tensor([1.0, 2.0])), TypeError,
     r"'t'.*integer dtype.*float32"),
    ("bool_ids", "unbounded", lambda kv: kv.get("t", torch.tensor([True])), TypeError,
     r"'t'.*integer dtype.*bool"),
    ("list_ids", "bounded", lambda kv: kv.get("t", [1, 2]), TypeError, r"'t'.*torch.Tensor.*list"),
    ("2d_ids", "bounded", lambda kv: kv.get("t", torch.ones(2, 2, dtype=I64)), ValueError,
     r"'t'.*1-D.*\(2, 2\)"),
    ("row_width", "bounded", lambda kv: kv.put("t", torch.tensor([1, 2]), torch.ones(2, 4)),
     ValueError, r"'t'.*shape \(2, 4\).*\(2, 5\)"),
    ("row_count", "unbounded", lambda kv: kv.put("t", torch.tensor([1, 2]), torch.ones(3, 5)),
     ValueError, r"'t'.*shape \(3, 5\).*\(2, 5\)"),
    ("int_rows", "unbounded",
     lambda kv: kv.put("t", torch.tensor([1]), torch.ones(1, 5, dtype=I64)), TypeError,
     r"'t'.*floating.*int64"),
    ("import_bad_id", "bounded",
     lambda kv: kv.import_rows("t", torch.tensor([N]), torch.ones(1, 5)), ValueError,
     r"'t'.*id 1000"),
    ("unknown_get", "bounded", lambda kv: kv.get("nope", torch.tensor([1])), KeyError,
     r"'nope'.*known tables: \['other', 't'\]"),
    ("unknown_put", "unbounded", lambda kv: kv.put("nope", torch.tensor([1]), torch.ones(1, 5)),
     KeyError, r"'nope'.*\['other', 't'\]"),
    ("unknown_export", "bounded", lambda kv: kv.export_rows("nope"), KeyError, r"'nope'"),
    ("unknown_spec", "bounded", lambda kv: kv.table_spec("nope"), KeyError, r"'nope'"),
    ("bad_chunk_rows", "bounded", lambda kv: kv.export_rows("t", chunk_rows=0), ValueError,
     r"chunk_rows"),
    ("not_a_spec", "bounded", lambda kv: kv.init_table("t"), TypeError, r"TableSpec"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "call", "exception", "pattern"),
    [case[1:] for case in BAD_CALLS],
    ids=[case[0] for case in BAD_CALLS],
)
def test_bad_input_raises_and_changes_nothing(
    layout: str, call: Callable[[HostKV], object], exception: type[Exception], pattern: str
) -> None:
    kv = make_store(spec_for(layout), spec_for(layout, "other", state_dim=1))
    kv.get("t", torch.tensor([1, 2, 3]))
    kv.put("other", torch.tensor([4]), torch.ones(1, 6))
    before = snapshot(kv)
    with pytest.raises(exception, match=pattern):
        call(kv)
    assert snapshot(kv) == before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_init_that_raises_changes_nothing(layout: str) -> None:
    def broken_init(ids: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.zeros(ids.numel(), dim + 1)

    kv = make_store(spec_for(layout, init=broken_init))
    before = snapshot(kv)
    with pytest.raises(ValueError, match="init returned shape"):
        kv.get("t", torch.tensor([1, 2]))
    assert snapshot(kv) == before


def test_closed_store_refuses_calls() -> None:
    kv = make_store(spec_for("bounded"))
    chunks = kv.export_rows("t")
    kv.close()
    kv.close()
    with pytest.raises(RuntimeError, match="closed"):
        kv.get("t", torch.tensor([1]))
    with pytest.raises(RuntimeError, match="closed"):
        kv.init_table(spec_for("bounded"))
    assert list(chunks) == []  # nothing was created, so nothing to read after close


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_pin_memory_without_cuda_is_refused() -> None:
    assert HostKV().pin_memory is False
    with pytest.raises(ValueError, match=r"pin_memory=True\) needs CUDA"):
        HostKV(pin_memory=True)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pinned_rows_on_cuda_machines(layout: str) -> None:
    kv = HostKV()
    kv.init_table(spec_for(layout))
    assert kv.pin_memory
    assert kv.get("t", torch.tensor([1, 2])).is_pinned()


# ------------------------------------------------------------------------------------------
# concurrency
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_threads_on_disjoint_ids(layout: str) -> None:
    spec = spec_for(layout, dim=4)
    kv = make_store(spec)
    ids = sample_ids(layout, 400, seed=9)
    own = [ids[0::2], ids[1::2]]
    increments = [torch.zeros(own[k].numel()) for k in range(2)]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        g = torch.Generator().manual_seed(k)
        try:
            for _ in range(300):
                pick = torch.randperm(own[k].numel(), generator=g)[:32]
                rows = kv.get("t", own[k][pick])
                kv.put("t", own[k][pick], rows + 1.0)
                increments[k][pick] += 1.0
        except BaseException as error:  # surfaced by the main thread below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for k in range(2):
        expected = spec.initial_rows(own[k]) + increments[k].unsqueeze(1)
        torch.testing.assert_close(kv.get("t", own[k]), expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------
# the hash index against a dict model
# ------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, BIG), max_size=80, unique=True)),
        max_size=8,
    ),
    small=st.lists(st.integers(0, 40), max_size=40, unique=True),
)
def test_unbounded_table_matches_a_dict(
    ops: list[tuple[bool, list[int]]], small: list[int]
) -> None:
    """Random get/put batches (mixing huge and clashing small ids) against a dict of rows."""
    spec = TableSpec("h", dim=3, state_dim=1, state_init=0.5)
    kv = make_store(spec)
    model: dict[int, list[float]] = {}
    for step, (is_put, batch) in enumerate([*ops, (False, small), (True, small)]):
        ids = torch.tensor(batch, dtype=torch.int64)
        if is_put:
            rows = torch.full((len(batch), 4), float(step)) + torch.arange(len(batch)).unsqueeze(1)
            kv.put("h", ids, rows)
            model.update(zip(batch, rows.tolist(), strict=True))
        else:
            rows = kv.get("h", ids)
            for k, row in zip(batch, rows.tolist(), strict=True):
                model.setdefault(k, spec.initial_rows(torch.tensor([k])).squeeze(0).tolist())
                assert row == model[k]
    exported_ids, exported_rows = export_all(kv, "h", chunk_rows=13)
    assert exported_ids.tolist() == sorted(model)
    assert exported_rows.tolist() == [model[k] for k in sorted(model)]
