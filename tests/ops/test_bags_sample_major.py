"""`IdsOps.bags_sample_major`, the TBE step's indices: every implementation of the ids family
against reading each bag in sample-major order in plain Python, and numba's compiled pass
against the torch specification, bit for bit, on fresh random inputs.

Bags of one length (a transpose, empty bags included) and of mixed lengths (a permutation), one
huge bag, a single feature (nothing moves), weights following their values; bad arguments give
a TypeError or ValueError naming them, in every implementation.
"""

from __future__ import annotations

import pytest
import torch

import embcache.native as native
from embcache.ops.registry import implementations
from tests.ops.implementations import NO_NUMBA, family_params


def _reference(values: list, offsets: list[int], F: int, B: int) -> tuple[list, list[int]]:
    """Bag (b, f) at b * F + f: the values and offsets by reading each bag in that order."""
    out, out_offsets = [], [0]
    for bag in (f * B + b for b in range(B) for f in range(F)):
        out += values[offsets[bag] : offsets[bag + 1]]
        out_offsets.append(len(out))
    return out, out_offsets


def _bags(lengths: str, F: int, B: int, weights: torch.dtype | None, seed: int):
    """Unique slots (one at the storage's last row), each value's unique index, feature-major
    offsets of the named bag lengths, and per-sample weights of ``weights``' dtype."""
    gen = torch.Generator().manual_seed(seed)
    sizes = {
        "zero": torch.zeros(F * B, dtype=torch.int64),
        "one": torch.ones(F * B, dtype=torch.int64),
        "three": torch.full((F * B,), 3, dtype=torch.int64),
        "mixed": torch.randint(0, 5, (F * B,), generator=gen),
        "huge": torch.randint(0, 3, (F * B,), generator=gen),
    }[lengths]
    if lengths == "huge":
        sizes[F * B // 2] = 1000  # one bag far longer than the others
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    nnz = int(offsets[-1])
    slots = torch.cat([torch.randperm(999, generator=gen)[:10], torch.tensor([999])])
    inverse = torch.randint(0, slots.numel(), (nnz,), generator=gen)
    w = None if weights is None else torch.rand(nnz, generator=gen).to(weights)
    return slots, inverse, offsets, w


LENGTHS = ["zero", "one", "three", "mixed", "huge"]
SHAPES = [pytest.param(3, 5, id="F3B5"), pytest.param(1, 7, id="F1B7"),
          pytest.param(4, 1, id="F4B1"), pytest.param(2, 123, id="F2B123")]  # fmt: skip
WEIGHTS = [pytest.param(None, id="plain"), pytest.param(torch.float32, id="float32"),
           pytest.param(torch.float64, id="float64")]  # fmt: skip


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize(("F", "B"), SHAPES)
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("impl", family_params("ids"))
def test_bags_move_to_sample_major_order(
    impl: str, lengths: str, F: int, B: int, weights: torch.dtype | None
) -> None:
    slots, inverse, offsets, w = _bags(lengths, F, B, weights, seed=F * 31 + B)
    got, got_offsets, got_weights = implementations("ids")[impl].bags_sample_major(
        slots, inverse, offsets, w, B
    )
    want, want_offsets = _reference(slots[inverse].tolist(), offsets.tolist(), F, B)
    assert got.dtype == got_offsets.dtype == torch.int64
    assert got.tolist() == want
    assert got_offsets.tolist() == want_offsets
    if w is None:
        assert got_weights is None
    else:  # weights travel with their values: read by position
        positions, _ = _reference(list(range(inverse.numel())), offsets.tolist(), F, B)
        assert got_weights is not None and got_weights.dtype == w.dtype
        assert torch.equal(got_weights, w[torch.tensor(positions, dtype=torch.int64)])


@pytest.mark.skipif(not native.importable(), reason=NO_NUMBA)
@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_pass_is_the_specification(seed: int) -> None:
    """Fresh random features, batch sizes, bag lengths and weights: numba's pass gives the
    specification's tensors exactly (values, dtypes and shapes)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    F = int(torch.randint(1, 6, (1,), generator=gen))
    B = int(torch.randint(1, 40, (1,), generator=gen))
    lengths = LENGTHS[seed % len(LENGTHS)]
    weights = [None, torch.float32][seed % 2]
    slots, inverse, offsets, w = _bags(lengths, F, B, weights, seed=seed)
    ids = implementations("ids")
    got = ids["native"].bags_sample_major(slots, inverse, offsets, w, B)
    want = ids["spec"].bags_sample_major(slots, inverse, offsets, w, B)
    for g, x in zip(got, want, strict=True):
        assert (g is None) == (x is None)
        if g is not None:
            assert g.dtype == x.dtype and torch.equal(g, x)


def _bad_arguments() -> list:
    slots, inverse = torch.arange(4), torch.tensor([0, 1, 3, 2, 2, 1])
    offsets = torch.tensor([0, 2, 3, 3, 6])  # F = 2, B = 2
    w = torch.ones(6)
    return [
        pytest.param((slots.int(), inverse, offsets, None, 2), TypeError, "slots",
                     id="slots-int32"),
        pytest.param((slots, inverse.float(), offsets, None, 2), TypeError, "inverse",
                     id="inverse-float"),
        pytest.param((slots, inverse, offsets.tolist(), None, 2), TypeError, "offsets",
                     id="offsets-list"),
        pytest.param((slots, inverse, offsets, w.long(), 2), TypeError, "weights",
                     id="weights-int"),
        pytest.param((slots, inverse, offsets, None, 2.0), TypeError, "batch_size",
                     id="batch-float"),
        pytest.param((slots.view(2, 2), inverse, offsets, None, 2), ValueError, "slots",
                     id="slots-2d"),
        pytest.param((slots, inverse, offsets, w[:5], 2), ValueError, "5 weights",
                     id="weights-short"),
        pytest.param((slots, inverse, offsets, None, 3), ValueError, "batch_size=3",
                     id="bags-not-F-by-B"),
        pytest.param((slots, inverse, offsets, None, 0), ValueError, "batch_size=0",
                     id="bags-of-no-batch"),
        pytest.param((slots, inverse, offsets, None, -1), ValueError, "batch_size",
                     id="batch-negative"),
        pytest.param((slots, inverse, offsets[:0], None, 2), ValueError, "offsets",
                     id="offsets-empty"),
    ]  # fmt: skip


@pytest.mark.parametrize(("args", "error", "names"), _bad_arguments())
@pytest.mark.parametrize("impl", family_params("ids"))
def test_bad_arguments_are_named(impl: str, args: tuple, error: type, names: str) -> None:
    with pytest.raises(error, match=names):
        implementations("ids")[impl].bags_sample_major(*args)


@pytest.mark.parametrize("impl", family_params("ids"))
def test_the_documented_example(impl: str) -> None:
    """`IdsOps.bags_sample_major`'s example: F = 2, B = 2."""
    slots, inverse = torch.tensor([40, 50]), torch.tensor([0, 1, 1, 0])
    offsets = torch.tensor([0, 1, 2, 4, 4])
    got, got_offsets, none = implementations("ids")[impl].bags_sample_major(
        slots, inverse, offsets, None, 2
    )
    assert got.tolist() == [40, 50, 40, 50] and got_offsets.tolist() == [0, 1, 3, 4, 4]
    assert none is None
