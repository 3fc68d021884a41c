"""embcache/indexing.py: the cache's 1-D writes and flag counts against advanced indexing and plain
torch reductions, on fresh random tensors of every size around the eight-flag words they use
(views that start off a word boundary, and non-contiguous ones, included)."""

from __future__ import annotations

import pytest
import torch

from embcache.indexing import count_true, or_flags, put, select, true_at

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
