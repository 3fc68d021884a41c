"""`IdsOps.direct_rows`, a direct share's ids checked and its distinct rows listed: every
implementation of the ids family against a plain-Python reference, and numba's compiled pass
(`ops.ids.native.BitmapDirectRows`) against the torch specification
(`ops.ids.direct_rows.DirectRows`), exactly, on fresh random inputs.

Batches hold repeats within and across bags, ids at each table's last row, empty bags, one
long bag, or nothing; an id out of its table's range or offsets that do not span the values
give None (the caller's torch path then names what is wrong), after which the next batch is
right again (the compiled pass's bitmap was cleared). Bad arguments give a TypeError or
ValueError naming them.
"""

from __future__ import annotations

import pytest
import torch

import embcache.native as native
from embcache.ops.registry import implementations
from tests.ops.implementations import NO_NUMBA, family_params

# f0 and f1 read one table of 300 rows at slot 0, f2 a table of 201 rows at slot 300.
ROWS, BASES, NUM_ROWS = [300, 300, 201], [0, 0, 300], 501


def _reference(values: list[int], offsets: list[int], B: int) -> list[int] | None:
    """The distinct slots in order of first sight, read value by value; None for a bad id."""
    seen: dict[int, None] = {}
    for f in range(len(ROWS)):
        for i in range(offsets[f * B], offsets[(f + 1) * B]):
            if not 0 <= values[i] < ROWS[f]:
                return None
            seen.setdefault(BASES[f] + values[i], None)
    return list(seen)


def _batch(shape: str, B: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewed raw ids (repeats) of feature-major bags of the named shape, each feature's last
    value at its table's last row."""
    gen = torch.Generator().manual_seed(seed)
    F = len(ROWS)
    if shape == "empty":
        lengths = torch.zeros(F * B, dtype=torch.int64)
    elif shape == "equal":
        lengths = torch.full((F * B,), 3, dtype=torch.int64)
    else:
        lengths = torch.randint(0, 6, (F * B,), generator=gen)
        lengths[0] = 0
        if shape == "long":
            lengths[B] = 700  # one long bag of f1
    limits = torch.tensor(ROWS).repeat_interleave(B).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=gen).pow(3) * limits).long()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    for f in range(F):
        end = int(offsets[(f + 1) * B])
        if end > int(offsets[f * B]):
            values[end - 1] = ROWS[f] - 1
    return values, offsets


SHAPES = ["random", "equal", "long", "empty"]


@pytest.mark.parametrize("B", [1, 16, 37], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("impl", family_params("ids"))
def test_distinct_rows_in_order_of_first_sight(impl: str, shape: str, B: int) -> None:
    distinct = implementations("ids")[impl].direct_rows(ROWS, BASES, NUM_ROWS)
    for seed in range(3):  # batch after batch through one object
        values, offsets = _batch(shape, B, seed=seed * 7 + B)
        found = distinct(values, offsets, B)
        assert found is not None and found.dtype == torch.int64
        assert found.tolist() == _reference(values.tolist(), offsets.tolist(), B)


@pytest.mark.parametrize("impl", family_params("ids"))
def test_bad_ids_and_offsets_give_none(impl: str) -> None:
    """An id one past its table's last row or negative, offsets one short, of the wrong length
    or with a feature ending before it starts: None, and the next batch is found right."""
    B = 16
    distinct = implementations("ids")[impl].direct_rows(ROWS, BASES, NUM_ROWS)
    gen = torch.Generator().manual_seed(5)
    for seed in range(4):
        values, offsets = _batch("random", B, seed=seed)
        feature = torch.arange(len(ROWS)).repeat_interleave(offsets[B::B] - offsets[:-1:B])
        pos = int(torch.randint(0, values.numel(), (1,), generator=gen))
        for bad_id in (ROWS[int(feature[pos])], -1):
            bad = values.clone()
            bad[pos] = bad_id
            assert distinct(bad, offsets, B) is None
        short = offsets.clone()
        short[-1] -= 1
        assert distinct(values, short, B) is None
        assert distinct(values, offsets[:-1], B) is None
        crossed = offsets.clone()
        crossed[B] = values.numel() + 5  # f0 would end past the batch, f1 before it starts
        assert distinct(values, crossed, B) is None
        found = distinct(values, offsets, B)
        assert found is not None
        assert found.tolist() == _reference(values.tolist(), offsets.tolist(), B)


@pytest.mark.skipif(not native.importable(), reason=NO_NUMBA)
@pytest.mark.parametrize("seed", range(8))
def test_the_compiled_pass_is_the_specification(seed: int) -> None:
    """Fresh random tables, bases, batch sizes and ids (some out of range): numba's pass gives
    what the specification gives, exactly (None included)."""
    gen = torch.Generator().manual_seed(2000 + seed)
    F = int(torch.randint(1, 6, (1,), generator=gen))
    rows = torch.randint(1, 400, (F,), generator=gen).tolist()
    bases, at = [], 0
    for r in rows:  # tables one after another, a feature now and then sharing the last one
        if bases and bool(torch.rand(1, generator=gen) < 0.3) and r <= rows[len(bases) - 1]:
            bases.append(bases[-1])
        else:
            bases.append(at)
            at += r
    num_rows = max(b + r for b, r in zip(bases, rows, strict=True)) + 3
    ids = implementations("ids")
    compiled = ids["native"].direct_rows(rows, bases, num_rows)
    spec = ids["spec"].direct_rows(rows, bases, num_rows)
    for _ in range(5):
        B = int(torch.randint(1, 30, (1,), generator=gen))
        lengths = torch.randint(0, 8, (F * B,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        limits = torch.tensor(rows).repeat_interleave(B).repeat_interleave(lengths)
        # Now and then one id past its table (the torch.rand draw says which batches).
        over = 1.0 + 0.01 * float(torch.rand(1, generator=gen) < 0.3)
        values = (torch.rand(limits.numel(), generator=gen) * limits * over).long()
        got, want = compiled(values, offsets, B), spec(values, offsets, B)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert torch.equal(got, want)


def test_only_the_compiled_family_says_compiled() -> None:
    """The engine takes `direct_rows` in place of its torch path where `IdsOps.compiled`."""
    found = {name: impl.compiled for name, impl in implementations("ids").items()}
    assert found == {name: name == "native" for name in found}


@pytest.mark.parametrize(
    ("args", "error", "names"),
    [
        pytest.param(([300, 200], [0], 500), ValueError, "2 feature_rows, 1 bases", id="lengths"),
        pytest.param(([300], [250], 500), ValueError, "run past", id="past-the-cache"),
        pytest.param(([300], [-1], 500), ValueError, "feature_bases", id="negative-base"),
        pytest.param(([300.0], [0], 500), TypeError, "feature_rows", id="float-rows"),
        pytest.param(([300], [0], None), TypeError, "num_rows", id="no-num-rows"),
    ],
)
@pytest.mark.parametrize("impl", family_params("ids"))
def test_bad_tables_are_named(impl: str, args: tuple, error: type, names: str) -> None:
    with pytest.raises(error, match=names):
        implementations("ids")[impl].direct_rows(*args)


@pytest.mark.parametrize(
    ("call", "error", "names"),
    [
        pytest.param(lambda v, o: (v.int(), o, 16), TypeError, "values", id="values-int32"),
        pytest.param(lambda v, o: (v, o.tolist(), 16), TypeError, "offsets", id="offsets-list"),
        pytest.param(lambda v, o: (v.view(1, -1), o, 16), ValueError, "values", id="values-2d"),
        pytest.param(lambda v, o: (v, o, 16.0), TypeError, "batch_size", id="batch-float"),
        pytest.param(lambda v, o: (v, o, -1), ValueError, "batch_size", id="batch-negative"),
    ],
)
@pytest.mark.parametrize("impl", family_params("ids"))
def test_bad_batches_are_named(impl: str, call, error: type, names: str) -> None:
    values, offsets = _batch("random", 16, seed=3)
    distinct = implementations("ids")[impl].direct_rows(ROWS, BASES, NUM_ROWS)
    with pytest.raises(error, match=names):
        distinct(*call(values, offsets))


@pytest.mark.parametrize("impl", family_params("ids"))
def test_the_documented_example(impl: str) -> None:
    """`direct_rows.DirectRows`' example: B = 1, f0 and f1 of one table, f2 of another."""
    distinct = implementations("ids")[impl].direct_rows([300, 300, 200], [0, 0, 300], 500)
    found = distinct(torch.tensor([7, 3, 7, 5]), torch.tensor([0, 2, 3, 4]), 1)
    assert found is not None and found.tolist() == [7, 3, 305]
