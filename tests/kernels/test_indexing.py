"""embcache/indexing.py: the cache's 1-D writes and flag counts against advanced indexing and plain
torch reductions, on fresh random tensors of every size around the eight-flag words they use
(views that start off a word boundary, and non-contiguous ones, included)."""

from __future__ import annotations

import pytest
import torch

from embcache.backend import for_device
from embcache.indexing import add_at, copy_rows, count_true, fill_at, or_flags, put, select, true_at

SIZES = [0, 1, 7, 8, 9, 1000, 100003]
DTYPES = [torch.int32, torch.int64, torch.bool, torch.float32]


def _flags(n: int, gen: torch.Generator, p: float = 0.3) -> torch.Tensor:
    return torch.rand(n, generator=gen) < p


def _random(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return _flags(n, gen, 0.5)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=gen).to(dtype)


@pytest.mark.parametrize("n", SIZES)
def test_count_true_counts_every_flag(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    for p in (0.0, 0.3, 1.0):
        flags = _flags(n, gen, p)
        assert count_true(flags) == int(flags.sum())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("start", [1, 3, 8, 11])
def test_count_true_on_views_off_a_word_boundary(n: int, start: int) -> None:
    gen = torch.Generator().manual_seed(1000 + n)
    big = _flags(n + start + 5, gen)
    view = big[start : start + n]
    assert count_true(view) == int(view.sum())
    # Flags around the view are not counted.
    big[:start] = True
    big[start + n :] = True
    assert count_true(big[start : start + n]) == int(view.sum())


@pytest.mark.parametrize("n", SIZES)
def test_count_true_on_non_contiguous_flags(n: int) -> None:
    gen = torch.Generator().manual_seed(2000 + n)
    big = _flags(2 * n, gen)
    strided = big[::2]
    if n > 1:
        assert not strided.is_contiguous()
    assert count_true(strided) == int(strided.sum())
    column = _flags(3 * n, gen).view(max(n, 1), -1)[:, 1] if n else big[:0]
    assert count_true(column) == int(column.sum())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("a_start", "b_start"), [(0, 0), (3, 3), (0, 5), (1, 0), (8, 16)])
def test_or_flags_is_logical_or(n: int, a_start: int, b_start: int) -> None:
    gen = torch.Generator().manual_seed(3000 + n + a_start * 7 + b_start)
    big_a = _flags(n + a_start + 9, gen)
    big_b = _flags(n + b_start + 9, gen)
    a = big_a[a_start : a_start + n]
    b = big_b[b_start : b_start + n]
    expected = a | b
    around = big_a.clone()
    or_flags(a, b)
    assert torch.equal(a, expected)
    # Every flag set by ``other`` reaches ``flags``, the last few too.
    a.fill_(False)
    b.fill_(True)
    or_flags(a, b)
    assert bool(a.all())
    # Nothing outside the view changed.
    assert torch.equal(big_a[:a_start], around[:a_start])
    assert torch.equal(big_a[a_start + n :], around[a_start + n :])


def test_or_flags_on_non_contiguous_other() -> None:
    gen = torch.Generator().manual_seed(4)
    a, big_b = _flags(1001, gen), _flags(2002, gen)
    expected = a | big_b[::2]
    or_flags(a, big_b[::2])
    assert torch.equal(a, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 9, 1000])
def test_put_is_an_indexed_assignment(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    t = _random(n, dtype, gen)
    k = max(n // 3, 1)
    idx = torch.randperm(n, generator=gen)[:k]
    src = _random(k, dtype, gen)
    expected = t.clone()
    expected[idx] = src
    put(t, idx, src)
    assert torch.equal(t, expected)


def test_put_casts_its_source_to_the_target_dtype() -> None:
    t = torch.full((10,), -1, dtype=torch.int32)
    idx = torch.tensor([2, 7, 0])
    put(t, idx, torch.tensor([5, 6, 9], dtype=torch.int64))
    expected = torch.full((10,), -1, dtype=torch.int32)
    expected[idx] = torch.tensor([5, 6, 9], dtype=torch.int32)
    assert t.dtype == torch.int32 and torch.equal(t, expected)


@pytest.fixture
def backend(monkeypatch, request) -> str:
    monkeypatch.setenv("EMBCACHE_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("backend", ["auto", "torch"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 9, 1000])
def test_fill_at_takes_repeated_positions(backend: str, dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(10 + n)
    value = {torch.bool: True, torch.float32: 2.5}.get(dtype, 77)
    for draws in (0, 1, 3 * n):
        t = _random(n, dtype, gen)
        idx = torch.randint(0, n, (draws,), generator=gen)  # repeats when draws > 1
        expected = t.clone()
        expected[idx] = value
        fill_at(t, idx, value)
        assert torch.equal(t, expected)


@pytest.mark.parametrize("backend", ["auto", "torch"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("n", [1, 9, 1000])
@pytest.mark.parametrize("delta", [1, -1, 5])
def test_add_at_adds_at_distinct_positions(
    backend: str, dtype: torch.dtype, n: int, delta: int
) -> None:
    gen = torch.Generator().manual_seed(20 + n + delta)
    t = _random(n, dtype, gen)
    idx = torch.randperm(n, generator=gen)[: max(n // 2, 1)]
    expected = t.clone()
    expected[idx] += delta
    add_at(t, idx, delta)
    assert torch.equal(t, expected)


@pytest.mark.parametrize("backend", ["auto", "torch"], indirect=True)
def test_add_at_counts_a_repeated_position_once_per_occurrence(backend: str) -> None:
    t = torch.zeros(6, dtype=torch.int32)
    add_at(t, torch.tensor([1, 4, 1, 1]), 2)
    assert t.tolist() == [0, 6, 0, 0, 2, 0]


@pytest.mark.parametrize("backend", ["auto", "torch"], indirect=True)
def test_writes_leave_other_positions_alone(backend: str) -> None:
    """Untouched positions hold a poison value before and after every write."""
    gen = torch.Generator().manual_seed(5)
    poison = -(2**31)
    idx = torch.randperm(100, generator=gen)[:30]
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[idx] = False
    for write in (
        lambda t: put(t, idx, torch.arange(30, dtype=torch.int32)),
        lambda t: fill_at(t, idx, 3),
        lambda t: add_at(t, idx, 1),
    ):
        t = torch.full((100,), poison, dtype=torch.int32)
        t[idx] = 0
        write(t)
        assert bool((t[untouched] == poison).all())
        assert not bool((t[idx] == poison).any())
    f = torch.full((100,), float("nan"))
    fill_at(f, idx, 1.0)
    assert bool(f[untouched].isnan().all()) and bool((f[idx] == 1.0).all())


@pytest.mark.parametrize("backend", ["auto", "torch"], indirect=True)
@pytest.mark.parametrize("bad", [-1, 50], ids=["negative", "past the end"])
def test_a_position_out_of_range_raises_and_writes_nothing(backend: str, bad: int) -> None:
    """As torch's own ops: ``scatter_`` raises RuntimeError, ``index_add_`` IndexError; the
    compiled pass checks every position before writing any."""
    for write, error in (
        (lambda t, i: fill_at(t, i, 7), RuntimeError),
        (lambda t, i: add_at(t, i, 1), IndexError),
    ):
        t = torch.zeros(50, dtype=torch.int32)
        with pytest.raises(error):
            write(t, torch.tensor([3, 9, bad, 11]))
        if for_device("cpu").compiled:  # the compiled pass (absent where numba is)
            assert not bool(t.any())


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["compiled", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-src"])
def test_copy_rows_is_index_copy(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, strided: bool, backend: str
) -> None:
    """Rows land where ``index_copy_`` puts them (a compiled loop on the CPU, float16 as its
    bits; numpy's row assignment without it; the torch op for bfloat16); the other rows keep
    their poison."""
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    gen = torch.Generator().manual_seed(11)
    n, width = 50, 7
    poison = torch.iinfo(dtype).min if dtype == torch.int64 else float("nan")
    dst = torch.full((n, width), poison, dtype=dtype)
    idx = torch.randperm(n, generator=gen)[:13]
    wide = (torch.randn(13, width + 3, generator=gen) * 100).to(dtype)
    src = wide[:, 1 : width + 1] if strided else wide[:, :width].contiguous()
    copy_rows(dst, idx, src)
    kept = torch.ones(n, dtype=torch.bool)
    kept[idx] = False
    assert torch.equal(dst[idx], src)
    if dtype == torch.int64:
        assert bool((dst[kept] == poison).all())
    else:
        assert bool(dst[kept].isnan().all())


def test_copy_rows_of_another_dtype_and_no_rows() -> None:
    dst = torch.zeros(4, 3)
    copy_rows(dst, torch.tensor([2, 0]), torch.ones(2, 3, dtype=torch.float64))  # cast first
    assert dst[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    copy_rows(dst, torch.empty(0, dtype=torch.int64), torch.empty(0, 3))
    assert dst.sum().item() == 6.0


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_true_at_and_select_are_nonzero_and_a_mask_read(n: int, p: float) -> None:
    gen = torch.Generator().manual_seed(n + int(p * 10))
    flags = _flags(n, gen, p)
    values = torch.randn(n, 3, generator=gen)
    at = true_at(flags)
    assert at.dtype == torch.int64
    assert torch.equal(at, flags.nonzero().squeeze(1))
    assert torch.equal(select(values, flags), values[flags])
    view = _flags(2 * n + 3, gen, p)[1::2]  # non-contiguous, off a word boundary
    assert torch.equal(true_at(view), view.nonzero().squeeze(1))
