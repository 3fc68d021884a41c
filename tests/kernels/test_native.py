"""The compiled CPU kernels (`embcache.native`) against the torch ops they stand for, on fresh
random inputs, outputs poisoned with NaN: the row moves between a cache's slots, its stored
rows and a dense tier table, and the TBE step's sample-major slots. (The plan kernels are
checked against the torch plan in ``tests/cache/test_native_plan.py``, the dedup in
``tests/cache/test_row_index.py``.)"""

from __future__ import annotations

import pytest
import torch

import embcache.native as native
from embcache.kv import host_tables

pytestmark = pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")

DIM, STATE, SLOTS = 12, 3, 200


def _row_kernels():
    """numba's row kernels (imported once numba is known to import here)."""
    from embcache.native import row_kernels

    return row_kernels


def _storage(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weights = torch.randn(SLOTS, DIM, generator=gen)
    state = torch.rand(SLOTS, STATE, generator=gen)
    slots = torch.randperm(SLOTS, generator=gen)[:57]
    return weights, state, slots


@pytest.mark.parametrize("seed", [0, 1])
def test_gather_join_is_cat_of_index_select(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    weights, state, slots = _storage(gen)
    out = torch.full((slots.numel(), DIM + STATE), float("nan"))
    _row_kernels().gather_join(weights.numpy(), state.numpy(), slots.numpy(), out.numpy())
    expected = torch.cat([weights[slots], state[slots]], dim=1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided rows"])
def test_scatter_split_writes_the_slots_and_nothing_else(strided: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    _, _, slots = _storage(gen)
    weights = torch.full((SLOTS, DIM), float("nan"))
    state = torch.full((SLOTS, STATE), float("nan"))
    wide = torch.randn(slots.numel(), DIM + STATE + 2, generator=gen)
    rows = wide[:, 1 : DIM + STATE + 1] if strided else wide[:, : DIM + STATE].contiguous()
    _row_kernels().scatter_split(weights.numpy(), state.numpy(), slots.numpy(), rows.numpy())
    torch.testing.assert_close(weights[slots], rows[:, :DIM], rtol=0, atol=0)
    torch.testing.assert_close(state[slots], rows[:, DIM:], rtol=0, atol=0)
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[slots] = False
    assert bool(weights[others].isnan().all()) and bool(state[others].isnan().all())


def test_dense_table_gather_counts_rows_never_created() -> None:
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(300, DIM + STATE, generator=gen)
    created = torch.rand(300, generator=gen) < 0.7
    ids = torch.randperm(300, generator=gen)[:80]
    out = torch.full((80, DIM + STATE), float("nan"))
    absent = host_tables.gather_created(rows.numpy(), created.numpy(), ids.numpy(), out.numpy())
    assert absent == int((~created[ids]).sum()) > 0
    torch.testing.assert_close(out, rows[ids], rtol=0, atol=0)


def test_dense_table_scatter_marks_the_rows_created() -> None:
    gen = torch.Generator().manual_seed(5)
    rows = torch.full((300, DIM + STATE), float("nan"))
    created = torch.zeros(300, dtype=torch.bool)
    ids = torch.randperm(300, generator=gen)[:80]
    src = torch.randn(80, DIM + STATE, generator=gen)
    host_tables.scatter_created(rows.numpy(), created.numpy(), ids.numpy(), src.numpy())
    torch.testing.assert_close(rows[ids], src, rtol=0, atol=0)
    expected = torch.zeros(300, dtype=torch.bool)
    expected[ids] = True
    assert torch.equal(created, expected)
    assert bool(rows[~expected].isnan().all())


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("features", "batch_size"), [(3, 5), (1, 7), (4, 6)])
def test_bags_sample_major_moves_each_bag_with_its_slots_and_weights(
    features: int, batch_size: int, weighted: bool
) -> None:
    gen = torch.Generator().manual_seed(features * 100 + batch_size)
    lengths = torch.randint(0, 4, (features * batch_size,), generator=gen)
    lengths[0] = 0  # an empty bag
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    slots = torch.randperm(SLOTS, generator=gen)[:40]
    inverse = torch.randint(0, slots.numel(), (int(offsets[-1]),), generator=gen)
    weights = torch.rand(inverse.numel(), generator=gen) if weighted else torch.empty(0)
    out = torch.full((inverse.numel(),), -1, dtype=torch.int64)
    out_offsets = torch.full((offsets.numel(),), -1, dtype=torch.int64)
    out_weights = torch.full((weights.numel(),), float("nan"))
    from embcache.native import row_kernels

    row_kernels.bags_sample_major(
        slots.numpy(), inverse.numpy(), offsets.numpy(), batch_size, weights.numpy(),
        out.numpy(), out_offsets.numpy(), out_weights.numpy(),
    )  # fmt: skip
    bags = [(f * batch_size + b) for b in range(batch_size) for f in range(features)]
    positions = torch.cat([torch.arange(offsets[k], offsets[k + 1]) for k in bags])
    assert torch.equal(out, slots[inverse[positions]])
    want = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[bags].cumsum(0)])
    assert torch.equal(out_offsets, want)
    if weighted:
        assert torch.equal(out_weights, weights[positions])


def test_popcount_counts_the_bits_of_any_word() -> None:
    """`native.bits.popcount` against Python's count of a word's bits, on the edge words (0,
    one bit at either end, all bits) and fresh random ones."""
    import numpy as np
    from numba import njit

    from embcache.native.bits import popcount

    @njit
    def counts(words, out):
        for i in range(words.shape[0]):
            out[i] = popcount(words[i])

    rng = np.random.default_rng()
    words = np.concatenate([
        np.array([0, 1, 1 << 63, (1 << 64) - 1, 0x5555555555555555], dtype=np.uint64),
        rng.integers(0, 1 << 64, 200, dtype=np.uint64, endpoint=False),
    ])  # fmt: skip
    out = np.full(words.size, 99, dtype=np.uint64)
    counts(words, out)
    assert out.tolist() == [bin(int(w)).count("1") for w in words]
