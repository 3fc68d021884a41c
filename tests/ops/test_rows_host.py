"""The rows family's host writes (`RowsOps.fill_at`, `add_at`, `copy_rows`) in every
implementation present (the torch specification, the compiled CPU passes, the Triton family's)
against advanced indexing and ``index_copy_``, on fresh random tensors, with poison around
what each write may touch."""

from __future__ import annotations

import pytest
import torch

from embcache.indexing import put
from embcache.ops.registry import implementations
from embcache.ops.rows import RowsOps
from tests.ops.implementations import family_params

DTYPES = [torch.int32, torch.int64, torch.bool, torch.float32]


@pytest.fixture(params=family_params("rows"))
def rows(request: pytest.FixtureRequest) -> RowsOps:
    return implementations("rows")[request.param]


def _random(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) < 0.5
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 9, 1000])
def test_fill_at_takes_repeated_positions(rows: RowsOps, dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(10 + n)
    value = {torch.bool: True, torch.float32: 2.5}.get(dtype, 77)
    for draws in (0, 1, 3 * n):
        t = _random(n, dtype, gen)
        idx = torch.randint(0, n, (draws,), generator=gen)  # repeats when draws > 1
        expected = t.clone()
        expected[idx] = value
        rows.fill_at(t, idx, value)
        assert torch.equal(t, expected)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("n", [1, 9, 1000])
@pytest.mark.parametrize("delta", [1, -1, 5])
def test_add_at_adds_at_distinct_positions(
    rows: RowsOps, dtype: torch.dtype, n: int, delta: int
) -> None:
    gen = torch.Generator().manual_seed(20 + n + delta)
    t = _random(n, dtype, gen)
    idx = torch.randperm(n, generator=gen)[: max(n // 2, 1)]
    expected = t.clone()
    expected[idx] += delta
    rows.add_at(t, idx, delta)
    assert torch.equal(t, expected)


def test_add_at_counts_a_repeated_position_once_per_occurrence(rows: RowsOps) -> None:
    t = torch.zeros(6, dtype=torch.int32)
    rows.add_at(t, torch.tensor([1, 4, 1, 1]), 2)
    assert t.tolist() == [0, 6, 0, 0, 2, 0]


def test_writes_leave_other_positions_alone(rows: RowsOps) -> None:
    """Untouched positions hold a poison value before and after every write."""
    gen = torch.Generator().manual_seed(5)
    poison = -(2**31)
    idx = torch.randperm(100, generator=gen)[:30]
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[idx] = False
    for write in (
        lambda t: put(t, idx, torch.arange(30, dtype=torch.int32)),
        lambda t: rows.fill_at(t, idx, 3),
        lambda t: rows.add_at(t, idx, 1),
    ):
        t = torch.full((100,), poison, dtype=torch.int32)
        t[idx] = 0
        write(t)
        assert bool((t[untouched] == poison).all())
        assert not bool((t[idx] == poison).any())
    f = torch.full((100,), float("nan"))
    rows.fill_at(f, idx, 1.0)
    assert bool(f[untouched].isnan().all()) and bool((f[idx] == 1.0).all())


@pytest.mark.parametrize("bad", [-1, 50], ids=["negative", "past the end"])
def test_a_position_out_of_range_raises_and_writes_nothing(rows: RowsOps, bad: int) -> None:
    """As torch's own ops: ``scatter_`` raises RuntimeError, ``index_add_`` IndexError; the
    compiled pass checks every position before writing any."""
    for write, error in (
        (lambda t, i: rows.fill_at(t, i, 7), RuntimeError),
        (lambda t, i: rows.add_at(t, i, 1), IndexError),
    ):
        t = torch.zeros(50, dtype=torch.int32)
        with pytest.raises(error):
            write(t, torch.tensor([3, 9, bad, 11]))
        if rows.compiled:  # the compiled pass checks every position first
            assert not bool(t.any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-src"])
def test_copy_rows_is_index_copy(rows: RowsOps, dtype: torch.dtype, strided: bool) -> None:
    """Rows land where ``index_copy_`` puts them (a compiled loop on the CPU, float16 as its
    bits; numpy's row assignment without it; the torch op for bfloat16); the other rows keep
    their poison."""
    gen = torch.Generator().manual_seed(11)
    n, width = 50, 7
    poison = torch.iinfo(dtype).min if dtype == torch.int64 else float("nan")
    dst = torch.full((n, width), poison, dtype=dtype)
    idx = torch.randperm(n, generator=gen)[:13]
    wide = (torch.randn(13, width + 3, generator=gen) * 100).to(dtype)
    src = wide[:, 1 : width + 1] if strided else wide[:, :width].contiguous()
    rows.copy_rows(dst, idx, src)
    kept = torch.ones(n, dtype=torch.bool)
    kept[idx] = False
    assert torch.equal(dst[idx], src)
    if dtype == torch.int64:
        assert bool((dst[kept] == poison).all())
    else:
        assert bool(dst[kept].isnan().all())


def test_copy_rows_of_another_dtype_and_no_rows(rows: RowsOps) -> None:
    dst = torch.zeros(4, 3)
    rows.copy_rows(dst, torch.tensor([2, 0]), torch.ones(2, 3, dtype=torch.float64))  # cast first
    assert dst[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    rows.copy_rows(dst, torch.empty(0, dtype=torch.int64), torch.empty(0, 3))
    assert dst.sum().item() == 6.0
