"""kernels/gather: the unpooled row gather and its backward against float64 references, on both
backends.

The forward reference is a plain loop over values in float64 (a gather is a copy, so the
float32 result must match it exactly); the backward reference sums each unique id's gradient
rows in float64. Outputs are pre-filled with NaN, and the cache rows' columns beyond ``dim``
are NaN, so that an element a kernel never writes, or a column it should never read, fails
loudly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from embcache.kernels.gather import gather_backward, gather_rows
from embcache.kernels.ids import dedup_grouped

# (atol, rtol) of a float32 backward against the float64 reference: the hot id sums HOT rows.
BACKWARD_TOLERANCE = (2e-5, 2e-5)

DIMS = [pytest.param(d, id=f"dim{d}") for d in (3, 8, 33)]
ROW_DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
STATE_COLS = 3  # optimizer-state columns after the weights in a cache row, never read
NUM_ROWS = 30
NUM_UNIQUE = 12
HOT = 70  # occurrences of one id: more than BLOCK_N (64 up to dim 64), so its walk takes tiles


@dataclasses.dataclass
class Values:
    """One table's unpooled inputs: cache rows, the slot of each unique id, and each value's
    unique index."""

    rows: torch.Tensor  # [R, W >= dim]
    slots: torch.Tensor  # [U]
    inverse: torch.Tensor  # [nnz]
    dim: int

    @property
    def nnz(self) -> int:
        return self.inverse.numel()

    @property
    def num_unique(self) -> int:
        return self.slots.numel()


def make_values(
    seed: int,
    dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    strided: bool = True,
    num_values: int = 40,
    hot: int = 0,
) -> Values:
    """Random values over NUM_UNIQUE ids: duplicates, two ids not admitted (slot -1), one id at
    the cache's last row, one id that no value uses, and ``hot`` extra values of id 0."""
    gen = torch.Generator().manual_seed(seed)
    width = dim + STATE_COLS if strided else dim
    storage = torch.randn(NUM_ROWS, width, generator=gen).to(dtype)
    storage[:, dim:] = math.nan  # state columns: a read of them shows as NaN
    slots = torch.randperm(NUM_ROWS - 1, generator=gen)[:NUM_UNIQUE]
    slots[1] = NUM_ROWS - 1  # the cache's last row
    slots[2] = slots[5] = -1  # ids the cache did not admit
    inverse = torch.randint(0, NUM_UNIQUE - 1, (num_values,), generator=gen)  # id U-1 unused
    inverse[:3] = torch.tensor([1, 2, 5])
    inverse = torch.cat([inverse, torch.zeros(hot, dtype=torch.int64)])
    inverse = inverse[torch.randperm(inverse.numel(), generator=gen)]
    rows = storage.to(device)
    return Values(rows[:, :dim], slots.to(device), inverse.to(device), dim)


def reference_rows(v: Values) -> torch.Tensor:
    """float64 ``[nnz, dim]`` by a plain loop: each value's row, zeros for a negative slot."""
    rows = v.rows.double().cpu()
    slots = v.slots.tolist()
    out = torch.zeros(v.nnz, v.dim, dtype=torch.float64)
    for j, u in enumerate(v.inverse.tolist()):
        if slots[u] >= 0:
            out[j] = rows[slots[u]]
    return out


def reference_backward(grad_out: torch.Tensor, inverse: torch.Tensor, num_unique: int):
    """float64 ``[U, dim]``: each unique id's gradient rows summed by a plain loop."""
    g = grad_out.double().cpu()
    grad = torch.zeros(num_unique, g.shape[1], dtype=torch.float64)
    for j, u in enumerate(inverse.tolist()):
        grad[u] += g[j]
    return grad


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, exact: bool = False):
    atol, rtol = (0.0, 0.0) if exact else BACKWARD_TOLERANCE
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}"
    torch.testing.assert_close(
        actual.cpu().double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def seed_of(*parts: object) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(repr(parts))) % 2**31


def nan_out(v: Values) -> torch.Tensor:
    return torch.full((v.nnz, v.dim), math.nan, device=v.rows.device)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strided", [True, False], ids=["strided", "contiguous"])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_gather_rows_matches_float64_reference(
    backend: str, device: torch.device, dtype: torch.dtype, dim: int, strided: bool
) -> None:
    """Each value gets its row exactly (half rows widened to float32); a negative slot gives
    zeros; ``out`` given is written in place and returned, else one is allocated."""
    v = make_values(seed_of("fwd", dtype, dim, strided), dim, device, dtype, strided)
    assert v.rows.is_contiguous() != strided
    out = nan_out(v)
    got = gather_rows(v.rows, dim, v.slots, v.inverse, out)
    assert got is out
    expected = reference_rows(v)
    assert_close(out, expected, "gather_rows", exact=True)
    not_admitted = (v.slots.cpu() < 0)[v.inverse.cpu()]
    assert not_admitted.any() and (out.cpu()[not_admitted] == 0).all()

    allocated = gather_rows(v.rows, dim, v.slots, v.inverse)
    assert allocated.shape == (v.nnz, dim) and allocated.device == out.device
    assert allocated.is_contiguous() and torch.equal(allocated, out)


def test_gather_rows_takes_int32_indices(backend: str, device: torch.device) -> None:
    v = make_values(seed_of("int32"), 8, device)
    got = gather_rows(v.rows, 8, v.slots.int(), v.inverse.int(), nan_out(v))
    assert_close(got, reference_rows(v), "gather_rows over int32 indices", exact=True)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


def make_grad(seed: int, nnz: int, dim: int, layout: str, device: torch.device) -> torch.Tensor:
    """``[nnz, dim]`` gradient in ``layout``: float32 contiguous, a column slice of a wider
    buffer whose other columns are NaN, a transpose, or float16 / float64."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "column-slice":
        wide = torch.randn(nnz, dim + 2, generator=gen)
        wide[:, dim:] = math.nan
        return wide.to(device)[:, :dim]
    if layout == "transposed":
        return torch.randn(dim, nnz, generator=gen).to(device).t()
    dtype = {"fp16": torch.float16, "fp64": torch.float64}.get(layout, torch.float32)
    return torch.randn(nnz, dim, generator=gen).to(dtype).to(device)


GRAD_LAYOUTS = ["contiguous", "column-slice", "transposed", "fp16", "fp64"]


@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
@pytest.mark.parametrize("dim", DIMS)
def test_gather_backward_matches_float64_reference(
    backend: str, device: torch.device, dim: int, layout: str
) -> None:
    """Duplicates are summed (a hot id over several tiles), an id no value uses gets zeros,
    and grad_out of any float dtype and strides is read as it is."""
    v = make_values(seed_of("bwd", dim, layout), dim, device, hot=HOT)
    grad_out = make_grad(seed_of("grad", dim, layout), v.nnz, dim, layout, device)
    before = grad_out.clone()
    grad = gather_backward(grad_out, v.inverse, v.num_unique)
    assert grad.shape == (v.num_unique, dim) and grad.device == grad_out.device
    assert_close(grad, reference_backward(grad_out, v.inverse, v.num_unique), "gather_backward")
    assert (grad[-1] == 0).all(), "an id that no value uses"
    assert torch.equal(grad_out.isnan(), before.isnan())
    assert torch.equal(grad_out.nan_to_num(), before.nan_to_num()), "grad_out was written"


@pytest.mark.parametrize("dim", [pytest.param(3, id="dim3"), pytest.param(33, id="dim33")])
def test_gather_backward_with_grouping_gives_the_same_result(
    backend: str, device: torch.device, dim: int
) -> None:
    """`dedup_grouped`'s ``(order, segments)`` give the reference's gradient, and the very
    same bits as without them: that grouping is the order the stable sort of ``inverse``
    finds, which both paths walk."""
    gen = torch.Generator().manual_seed(seed_of("grouped", dim))
    ids = torch.randint(0, 9, (45,), generator=gen) * 1009 + (1 << 33)  # hot, spread ids
    ids = ids.to(device)
    _, inverse, order, segments = dedup_grouped(ids)
    num_unique = segments.numel() - 1
    grad_out = torch.randn(ids.numel(), dim, generator=gen).to(device)
    grouped = gather_backward(grad_out, inverse, num_unique, (order, segments))
    plain = gather_backward(grad_out, inverse, num_unique)
    expected = reference_backward(grad_out, inverse, num_unique)
    assert_close(grouped, expected, "grouped")
    assert_close(plain, expected, "plain")
    assert torch.equal(grouped.view(torch.int32), plain.view(torch.int32))


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
def test_gather_backward_is_deterministic(
    backend: str, device: torch.device, grouped: bool
) -> None:
    """Two runs give the same bits: three unique ids, so every row sums dozens of terms."""
    gen = torch.Generator().manual_seed(seed_of("det", grouped))
    ids = torch.randint(0, 3, (150,), generator=gen).to(device)
    _, inverse, order, segments = dedup_grouped(ids)
    grad_out = torch.randn(150, 33, generator=gen).to(device)
    grouping = (order, segments) if grouped else None
    first = gather_backward(grad_out, inverse, 3, grouping)
    second = gather_backward(grad_out, inverse, 3, grouping)
    assert torch.equal(first.view(torch.int32), second.view(torch.int32))


# ----------------------------------------------------------------------------------------------
# empty inputs
# ----------------------------------------------------------------------------------------------


def test_gather_with_no_values(backend: str, device: torch.device) -> None:
    rows = torch.randn(4, 8, device=device)
    slots = torch.tensor([2, -1, 3], device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    assert gather_rows(rows, 5, slots, empty).shape == (0, 5)
    out = torch.empty(0, 5, device=device)
    assert gather_rows(rows, 5, slots, empty, out) is out
    assert gather_rows(rows, 5, empty, empty).shape == (0, 5)

    grad = gather_backward(torch.empty(0, 5, device=device), empty, 3)
    assert grad.shape == (3, 5) and grad.dtype == torch.float32 and (grad == 0).all()
    grouping = (empty, torch.zeros(4, dtype=torch.int64, device=device))
    assert torch.equal(gather_backward(torch.empty(0, 5, device=device), empty, 3, grouping), grad)
    assert gather_backward(torch.empty(0, 5, device=device), empty, 0).shape == (0, 5)


def test_gather_from_an_empty_cache(backend: str, device: torch.device) -> None:
    """No row admitted yet: every slot is -1, every value reads zeros."""
    rows = torch.empty(0, 6, dtype=torch.float16, device=device)
    slots = torch.full((2,), -1, dtype=torch.int64, device=device)
    inverse = torch.tensor([0, 1, 1, 0, 1], device=device)
    out = torch.full((5, 4), math.nan, device=device)
    gather_rows(rows, 4, slots, inverse, out)
    assert torch.equal(out, torch.zeros_like(out))


# ----------------------------------------------------------------------------------------------
# bad arguments
# ----------------------------------------------------------------------------------------------

Call = Callable[[Values, torch.Tensor, torch.Tensor], object]

BAD_CALLS: dict[str, tuple[type[Exception], str, Call]] = {
    "rows-float64": (TypeError, "rows must be a float32, float16 or bfloat16",
                     lambda v, out, g: gather_rows(v.rows.double(), 4, v.slots, v.inverse, out)),
    "rows-1d": (TypeError, "rows must be",
                lambda v, out, g: gather_rows(v.rows[0], 4, v.slots, v.inverse, out)),
    "dim-too-wide": (ValueError, r"dim=8 must be in \[1, 4\]",
                     lambda v, out, g: gather_rows(v.rows, 8, v.slots, v.inverse, out)),
    "dim-zero": (ValueError, "dim=0 must be",
                 lambda v, out, g: gather_rows(v.rows, 0, v.slots, v.inverse, out)),
    "dim-float": (TypeError, "dim must be an int",
                  lambda v, out, g: gather_rows(v.rows, 4.0, v.slots, v.inverse, out)),
    "slots-float": (TypeError, "slots must be int64 or int32",
                    lambda v, out, g: gather_rows(v.rows, 4, v.slots.float(), v.inverse, out)),
    "inverse-2d": (ValueError, "inverse must be 1-D",
                   lambda v, out, g: gather_rows(v.rows, 4, v.slots, v.inverse[None], out)),
    "out-float16": (TypeError, "out must be a float32",
                    lambda v, out, g: gather_rows(v.rows, 4, v.slots, v.inverse, out.half())),
    "out-shape": (ValueError, r"out has shape \(\d+, 3\), expected \(nnz, dim\)",
                  lambda v, out, g: gather_rows(v.rows, 4, v.slots, v.inverse, out[:, :3])),
    "out-strided": (ValueError, "out must be contiguous",
                    lambda v, out, g: gather_rows(v.rows, 4, v.slots, v.inverse,
                                                  out.view(4, v.nnz).t())),
    "grad-int": (TypeError, "grad_out must be a floating-point",
                 lambda v, out, g: gather_backward(g.long(), v.inverse, v.num_unique)),
    "grad-1d": (ValueError, "grad_out must be 2-D",
                lambda v, out, g: gather_backward(g[0], v.inverse, v.num_unique)),
    "grad-rows": (ValueError, "grad_out has \\d+ rows, expected one per value",
                  lambda v, out, g: gather_backward(g[1:], v.inverse, v.num_unique)),
    "num-unique-negative": (ValueError, "num_unique=-1 must be >= 0",
                            lambda v, out, g: gather_backward(g, v.inverse, -1)),
    "num-unique-tensor": (TypeError, "num_unique must be an int",
                          lambda v, out, g: gather_backward(g, v.inverse, torch.tensor(12))),
    "inverse-float": (TypeError, "inverse must be int64 or int32",
                      lambda v, out, g: gather_backward(g, v.inverse.float(), v.num_unique)),
    "grouping-sizes": (ValueError, "grouping covers",
                       lambda v, out, g: gather_backward(
                           g, v.inverse, v.num_unique, (v.inverse, v.inverse[:4]))),
    "grouping-float": (TypeError, "grouping order must be int64 or int32",
                       lambda v, out, g: gather_backward(
                           g, v.inverse, v.num_unique, (g[:, 0], v.inverse))),
    "grouping-list": (TypeError, "grouping must be a tuple",
                      lambda v, out, g: gather_backward(g, v.inverse, v.num_unique, [v.inverse])),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_gather_rejects_bad_arguments_and_changes_nothing(device: torch.device, case: str) -> None:
    error, match, call = BAD_CALLS[case]
    v = make_values(seed_of("bad"), 4, device)
    out = nan_out(v)
    grad_out = torch.randn(v.nnz, 4, device=device)
    before = [t.clone() for t in (v.rows, v.slots, v.inverse, grad_out)]
    with pytest.raises(error, match=match):
        call(v, out, grad_out)
    assert out.isnan().all(), "out was written"
    for t, b in zip((v.rows, v.slots, v.inverse, grad_out), before, strict=True):
        assert torch.equal(t.nan_to_num(), b.nan_to_num()) and torch.equal(t.isnan(), b.isnan())


# ----------------------------------------------------------------------------------------------
# a hot id split across programs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [pytest.param(17, id="dim17"), pytest.param(130, id="dim130")])
@pytest.mark.parametrize("share", [0.5, 0.9], ids=["hot50", "hot90"])
def test_gather_backward_splits_a_hot_id_and_stays_exact(
    backend: str, device: torch.device, share: float, dim: int
) -> None:
    """One id holding half or nine tenths of 1,300 values (several of the backward's chunks,
    of 256 values at dim 17 and 64 at dim 130, on a GPU and under the interpreter alike): its
    gradient, summed by several programs then in chunk order, matches the float64 sum; two
    runs give the same bits, with the caller's grouping or without."""
    nnz, num_ids = 1300, 40
    gen = torch.Generator().manual_seed(seed_of("hot", share, dim))
    hot = torch.rand(nnz, generator=gen) < share
    ids = torch.where(hot, 7, torch.randint(0, num_ids, (nnz,), generator=gen)) * 1009 + (1 << 33)
    assert int(hot.sum()) > 2 * 256, "the hot id must span several chunks"
    grad_out = torch.randn(nnz, dim, generator=gen).to(device)
    _, inverse, order, segments = dedup_grouped(ids.to(device))
    num_unique = segments.numel() - 1

    plain, again = (gather_backward(grad_out, inverse, num_unique) for _ in range(2))
    grouped = gather_backward(grad_out, inverse, num_unique, (order, segments))
    assert torch.equal(plain.view(torch.int32), again.view(torch.int32)), "not bit-reproducible"
    assert torch.equal(grouped.view(torch.int32), plain.view(torch.int32)), "grouped differs"

    expected = torch.zeros(num_unique, dim, dtype=torch.float64)
    expected.index_add_(0, inverse.cpu(), grad_out.cpu().double())
    torch.testing.assert_close(plain.cpu().double(), expected, atol=1e-4, rtol=1e-5)
