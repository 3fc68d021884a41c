"""kernels/pooling: forward and backward against float64 references, on both backends.

The forward reference is a plain loop over bags in float64; the backward reference is
torch.autograd through that loop. Outputs and gradients are pre-filled with NaN (and the
optimizer-state columns of the cache rows are NaN) so that an element a kernel never writes, or
a column it should never read, fails loudly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embcache.kernels.pooling import PoolingMode, pool_backward, pool_forward

# (atol, rtol) of a float32 kernel against the float64 reference, per dtype of the rows. Rows
# are float32 by contract; the longest bag sums 150 terms, hence the margin over one ulp.
TOLERANCES = {torch.float32: (2e-5, 2e-5)}

DIMS = [1, 3, 17, 130]
MODES = list(PoolingMode)
STATE_COLS = 3  # optimizer-state columns after the weights in a cache row, never read
LONG_BAG = 150  # longer than BLOCK_N for every dim, so the bag loop runs several blocks


@dataclasses.dataclass
class Bags:
    """One table's pooling inputs: cache rows, unique slots and CSR bags (feature-major)."""

    rows: torch.Tensor  # [R, dim + STATE_COLS], a strided view
    slots: torch.Tensor  # [U]
    inverse: torch.Tensor  # [nnz]
    offsets: torch.Tensor  # [F * B + 1]
    weights: torch.Tensor | None  # [nnz]
    dim: int
    batch_size: int
    num_features: int

    @property
    def num_unique(self) -> int:
        return self.slots.numel()


def make_bags(
    seed: int,
    dim: int,
    weighted: bool,
    device: torch.device,
    num_features: int = 2,
    batch_size: int = 3,
    num_unique: int = 20,
    num_rows: int = 40,
    long_bag: bool = True,
) -> Bags:
    """Random bags with an empty bag, duplicate ids, one long bag and the cache's last row."""
    gen = torch.Generator().manual_seed(seed)
    num_bags = num_features * batch_size
    width = dim + STATE_COLS
    storage = torch.randn(num_rows, width + 2, generator=gen)
    storage[:, dim:] = float("nan")  # state columns and the padding must never be read
    # Unique ids live in distinct slots, the cache's last row among them.
    slots = torch.randperm(num_rows - 1, generator=gen)[: num_unique - 1]
    slots = torch.cat([slots, torch.tensor([num_rows - 1])])
    slots = slots[torch.randperm(num_unique, generator=gen)]
    lengths = torch.randint(0, 6, (num_bags,), generator=gen)
    lengths[1] = 0  # an empty bag
    lengths[num_bags - 1] = 0  # ... and the very last bag empty too
    if long_bag:
        lengths[num_bags - 2] = LONG_BAG
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    nnz = int(offsets[-1])
    # Few unique ids for many values: duplicates within and across bags.
    inverse = torch.randint(0, num_unique, (nnz,), generator=gen)
    inverse[nnz - 1] = int(torch.nonzero(slots == num_rows - 1))
    weights = torch.randn(nnz, generator=gen) if weighted else None
    return Bags(
        rows=storage.to(device)[:, :width],
        slots=slots.to(device),
        inverse=inverse.to(device),
        offsets=offsets.to(device),
        weights=None if weights is None else weights.to(device),
        dim=dim,
        batch_size=batch_size,
        num_features=num_features,
    )


def reference_pool(bags: Bags, unique_rows: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """float64 ``[F * B, dim]`` pooled bags, by a plain loop; differentiable in unique_rows."""
    offsets = bags.offsets.tolist()
    inverse = bags.inverse.tolist()
    weights = None if bags.weights is None else bags.weights.double().cpu()
    pooled = []
    for q in range(len(offsets) - 1):
        values = []
        for j in range(offsets[q], offsets[q + 1]):
            x = unique_rows[inverse[j]]
            values.append(x if weights is None else x * weights[j])
        if not values:
            pooled.append(torch.zeros(bags.dim, dtype=torch.float64))
        elif mode == PoolingMode.SUM:
            pooled.append(torch.stack(values).sum(0))
        elif mode == PoolingMode.MEAN:
            pooled.append(torch.stack(values).sum(0) / len(values))
        else:
            pooled.append(torch.stack(values).amax(0))
    return torch.stack(pooled)


def unique_rows64(bags: Bags) -> torch.Tensor:
    return bags.rows[:, : bags.dim].index_select(0, bags.slots).double().cpu()


def feature_columns(bags: Bags, col_offsets: list[int]) -> list[tuple[int, int, slice]]:
    """(bag, sample, output columns) of every bag."""
    return [
        (i * bags.batch_size + b, b, slice(col, col + bags.dim))
        for i, col in enumerate(col_offsets)
        for b in range(bags.batch_size)
    ]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    atol, rtol = TOLERANCES[torch.float32]
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}"
    torch.testing.assert_close(
        actual.cpu().double(),
        expected.cpu().double(),
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"{what}: {m}",
    )


def run_forward(
    bags: Bags, mode: PoolingMode, out: torch.Tensor, col_offsets: list[int]
) -> torch.Tensor | None:
    return pool_forward(
        bags.rows,
        bags.dim,
        bags.slots,
        bags.inverse,
        bags.offsets,
        bags.weights,
        mode,
        out,
        bags.batch_size,
        torch.tensor(col_offsets, device=bags.rows.device),
    )


def run_backward(
    bags: Bags,
    mode: PoolingMode,
    grad_out: torch.Tensor,
    col_offsets: list[int],
    argmax: torch.Tensor | None,
) -> torch.Tensor:
    return pool_backward(
        grad_out,
        bags.dim,
        bags.inverse,
        bags.num_unique,
        bags.offsets,
        bags.weights,
        mode,
        bags.batch_size,
        torch.tensor(col_offsets, device=grad_out.device),
        argmax,
    )


def seed_of(*parts: object) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(repr(parts))) % 2**31


@pytest.mark.parametrize("dim", DIMS, ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_pool_forward_matches_float64_reference(
    backend: str, device: torch.device, mode: PoolingMode, weighted: bool, dim: int
) -> None:
    bags = make_bags(seed_of("fwd", mode, weighted, dim), dim, weighted, device)
    # One spare column on each side of the features' columns: it must stay NaN.
    col_offsets = [1, 1 + dim]
    out = torch.full((bags.batch_size, 2 * dim + 2), float("nan"), device=device)
    argmax = run_forward(bags, mode, out, col_offsets)

    expected = reference_pool(bags, unique_rows64(bags), mode)
    for q, b, cols in feature_columns(bags, col_offsets):
        assert_close(out[b, cols], expected[q], f"bag {q}")
    assert out[:, 0].isnan().all() and out[:, -1].isnan().all(), "wrote outside its columns"

    if mode != PoolingMode.MAX:
        assert argmax is None
        return
    assert argmax is not None and argmax.dtype == torch.int64
    assert tuple(argmax.shape) == (bags.offsets.numel() - 1, dim)
    offsets = bags.offsets.cpu()
    argmax = argmax.cpu()
    lengths = offsets[1:] - offsets[:-1]
    assert (argmax[lengths == 0] == -1).all()
    full = argmax[lengths > 0]
    starts = offsets[:-1][lengths > 0].unsqueeze(1)
    ends = offsets[1:][lengths > 0].unsqueeze(1)
    assert ((full >= starts) & (full < ends)).all(), "arg-max outside its bag"
    # The value at the arg-max is the bag's max.
    x = unique_rows64(bags)[bags.inverse.cpu()]  # [nnz, dim]
    if bags.weights is not None:
        x = x * bags.weights.double().cpu().unsqueeze(1)
    picked = x.gather(0, full.clamp(min=0))
    assert_close(picked.float(), expected[lengths > 0], "value at arg-max")


@pytest.mark.parametrize("dim", DIMS, ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_pool_backward_matches_autograd(
    backend: str, device: torch.device, mode: PoolingMode, weighted: bool, dim: int
) -> None:
    bags = make_bags(seed_of("bwd", mode, weighted, dim), dim, weighted, device)
    col_offsets = [dim, 0]  # features in reverse column order
    out = torch.full((bags.batch_size, 2 * dim + 1), float("nan"), device=device)
    argmax = run_forward(bags, mode, out, col_offsets)
    gen = torch.Generator().manual_seed(seed_of("grad", dim))
    grad_out = torch.randn(bags.batch_size, 2 * dim + 1, generator=gen)
    grad_out[:, -1] = float("nan")  # a column of another table: never read
    grad_unique = run_backward(bags, mode, grad_out.to(device), col_offsets, argmax)

    x = unique_rows64(bags).requires_grad_()
    pooled = reference_pool(bags, x, mode)
    loss = sum(
        (pooled[q] * grad_out[b, cols].double()).sum()
        for q, b, cols in feature_columns(bags, col_offsets)
    )
    loss.backward()
    assert tuple(grad_unique.shape) == (bags.num_unique, dim)
    assert_close(grad_unique, x.grad, "grad of unique rows")


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_two_tables_fill_one_output(backend: str, device: torch.device, mode: PoolingMode) -> None:
    """Tables of dims 3 (features 0, 1) and 17 (feature 2) write one [B, 23] output."""
    small = make_bags(seed_of("small", mode), 3, False, device, num_features=2)
    large = make_bags(seed_of("large", mode), 17, True, device, num_features=1, long_bag=False)
    out = torch.full((small.batch_size, 2 * 3 + 17), float("nan"), device=device)
    run_forward(small, mode, out, [0, 3])
    run_forward(large, mode, out, [6])
    assert not out.isnan().any(), "an output element was never written"
    for bags, col_offsets in ((small, [0, 3]), (large, [6])):
        expected = reference_pool(bags, unique_rows64(bags), mode)
        for q, b, cols in feature_columns(bags, col_offsets):
            assert_close(out[b, cols], expected[q], f"dim {bags.dim} bag {q}")


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_pooling_is_deterministic(
    backend: str, device: torch.device, mode: PoolingMode, weighted: bool
) -> None:
    """Two runs give the same bits: few unique ids, so every gradient sums many terms."""
    if backend == "torch" and device.type == "cuda":
        pytest.skip("the torch twin's scatter_add_/index_add_ use float atomics on CUDA")
    bags = make_bags(seed_of("det", mode), 33, weighted, device, num_unique=4, num_rows=8)
    gen = torch.Generator().manual_seed(7)
    grad_out = torch.randn(bags.batch_size, 66, generator=gen).to(device)
    results = []
    for _ in range(2):
        out = torch.full((bags.batch_size, 66), float("nan"), device=device)
        argmax = run_forward(bags, mode, out, [0, 33])
        results.append((out, argmax, run_backward(bags, mode, grad_out, [0, 33], argmax)))
    (out0, arg0, grad0), (out1, arg1, grad1) = results
    assert torch.equal(out0, out1)
    assert (arg0 is None and arg1 is None) or torch.equal(arg0, arg1)
    assert torch.equal(grad0, grad1)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_all_bags_empty(backend: str, device: torch.device, mode: PoolingMode) -> None:
    rows = torch.randn(4, 8, device=device)
    offsets = torch.zeros(2 * 3 + 1, dtype=torch.int64, device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    col_offsets = torch.tensor([0, 5], device=device)
    out = torch.full((3, 10), float("nan"), device=device)
    argmax = pool_forward(rows, 5, empty, empty, offsets, None, mode, out, 3, col_offsets)
    assert torch.equal(out, torch.zeros_like(out))
    if mode == PoolingMode.MAX:
        assert argmax is not None and (argmax == -1).all()
    grad_out = torch.randn(3, 10, device=device)
    grad = pool_backward(grad_out, 5, empty, 0, offsets, None, mode, 3, col_offsets, argmax)
    assert tuple(grad.shape) == (0, 5)


def test_pool_rejects_bad_arguments(device: torch.device) -> None:
    bags = make_bags(1, 4, False, device, long_bag=False)
    out = torch.zeros(bags.batch_size, 8, device=device)
    cols = torch.tensor([0, 4], device=device)
    args = (bags.slots, bags.inverse, bags.offsets, None, PoolingMode.SUM, out)
    with pytest.raises(ValueError, match="dim=9 must be in"):
        pool_forward(bags.rows, 9, *args, bags.batch_size, cols)
    with pytest.raises(ValueError, match="offsets has 7 entries, expected F \\* B \\+ 1"):
        pool_forward(bags.rows, 4, *args, bags.batch_size, cols[:1])
    with pytest.raises(TypeError, match="rows must be a float32"):
        pool_forward(bags.rows.double(), 4, *args, bags.batch_size, cols)
    bad_weights = torch.ones(bags.inverse.numel(), dtype=torch.float64, device=device)
    with pytest.raises(TypeError, match="per_sample_weights must be float32"):
        pool_forward(
            bags.rows, 4, bags.slots, bags.inverse, bags.offsets, bad_weights,
            PoolingMode.SUM, out, bags.batch_size, cols,
        )  # fmt: skip
    with pytest.raises(ValueError, match="MAX backward needs the forward's argmax"):
        pool_backward(
            out, 4, bags.inverse, bags.num_unique, bags.offsets, None, PoolingMode.MAX,
            bags.batch_size, cols, None,
        )  # fmt: skip


@pytest.mark.parametrize("dim", DIMS, ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("mode", [PoolingMode.SUM, PoolingMode.MEAN], ids=lambda m: m.name)
def test_pool_backward_with_grouping_matches_autograd(
    device: torch.device, mode: PoolingMode, weighted: bool, dim: int
) -> None:
    """The one-pass backward over values grouped by unique id (``dedup_grouped``'s order)
    gives the float64 reference's gradient, as the gather-and-scatter path does."""
    bags = make_bags(seed_of("grouped", mode, weighted, dim), dim, weighted, device)
    col_offsets = [0, dim]  # the usual layout, which the one-pass path reads in place
    out = torch.full((bags.batch_size, 2 * dim), float("nan"), device=device)
    run_forward(bags, mode, out, col_offsets)
    gen = torch.Generator().manual_seed(seed_of("grouped-grad", dim))
    grad_out = torch.randn(bags.batch_size, 2 * dim, generator=gen).to(device)
    order = torch.sort(bags.inverse, stable=True).indices
    segments = torch.searchsorted(
        bags.inverse[order], torch.arange(bags.num_unique + 1, device=device)
    )  # ids that no value uses get empty segments
    grouped = pool_backward(
        grad_out, bags.dim, bags.inverse, bags.num_unique, bags.offsets, bags.weights, mode,
        bags.batch_size, torch.tensor(col_offsets, device=device), None, (order, segments),
    )  # fmt: skip
    plain = run_backward(bags, mode, grad_out, col_offsets, None)

    x = unique_rows64(bags).requires_grad_()  # on the CPU, as the reference is
    pooled = reference_pool(bags, x, mode)
    grad64 = grad_out.double().cpu()
    loss = sum(
        (pooled[q] * grad64[b, cols]).sum() for q, b, cols in feature_columns(bags, col_offsets)
    )
    loss.backward()
    assert_close(grouped, x.grad, "grouped grad of unique rows")
    assert_close(grouped, plain.double(), "grouped vs gather-and-scatter")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("dim", [3, 17], ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_pool_forward_reads_half_rows_in_float32_and_negative_slots_as_zeros(
    backend: str, device: torch.device, mode: PoolingMode, dim: int, dtype: torch.dtype
) -> None:
    """Half-precision cache rows are pooled with float32 accumulation (the float64 reference
    pools the very same half values); a slot of -1 (an id not admitted) reads as zeros."""
    bags = make_bags(seed_of("half", mode, dim, dtype), dim, True, device)
    half = bags.rows.to(dtype)  # contiguous copy; its state columns stay NaN
    slots = bags.slots.clone()
    slots[::4] = -1
    bags = dataclasses.replace(bags, rows=half, slots=slots)
    col_offsets = [0, dim]
    out = torch.full((bags.batch_size, 2 * dim), float("nan"), device=device)
    run_forward(bags, mode, out, col_offsets)

    unique = half[:, :dim].index_select(0, slots.clamp(min=0)).double().cpu()
    unique[slots.cpu() < 0] = 0.0
    expected = reference_pool(bags, unique, mode)
    for q, b, cols in feature_columns(bags, col_offsets):
        assert_close(out[b, cols], expected[q], f"bag {q}")


@pytest.mark.parametrize("share", [0.5, 0.9], ids=["hot50", "hot90"])
@pytest.mark.parametrize("mode", [PoolingMode.SUM, PoolingMode.MEAN], ids=lambda m: m.name)
def test_pool_backward_splits_a_hot_id_and_stays_exact(
    backend: str, device: torch.device, mode: PoolingMode, share: float
) -> None:
    """One id holding half or nine tenths of ~1,300 values (several of the backward's chunks
    of 256 values): its gradient, summed by several programs then in chunk order, matches the
    float64 sum, and two runs give the same bits."""
    dim, batch, features, num_unique = 17, 64, 2, 40
    gen = torch.Generator().manual_seed(seed_of("hot", mode, share))
    lengths = torch.randint(0, 21, (features * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    nnz = int(offsets[-1])
    hot = torch.rand(nnz, generator=gen) < share
    inverse = torch.where(hot, 0, torch.randint(1, num_unique, (nnz,), generator=gen))
    assert int(hot.sum()) > 2 * 256, "the hot id must span several chunks"
    weights = torch.randn(nnz, generator=gen)
    grad_out = torch.randn(batch, features * dim, generator=gen)
    col_offsets = torch.tensor([0, dim])

    def run() -> torch.Tensor:
        return pool_backward(
            grad_out.to(device), dim, inverse.to(device), num_unique, offsets.to(device),
            weights.to(device), mode, batch, col_offsets.to(device), None,
        ).cpu()  # fmt: skip

    got, again = run(), run()
    assert torch.equal(got.view(torch.int32), again.view(torch.int32)), "not bit-reproducible"

    bag = torch.repeat_interleave(torch.arange(features * batch), lengths)
    feature, sample = bag // batch, bag % batch
    cols = (col_offsets[feature].unsqueeze(1) + torch.arange(dim)).long()
    g = grad_out.double()[sample.unsqueeze(1), cols] * weights.double().unsqueeze(1)
    if mode == PoolingMode.MEAN:
        g = g / lengths[bag].clamp(min=1).double().unsqueeze(1)
    expected = torch.zeros(num_unique, dim, dtype=torch.float64).index_add_(0, inverse, g)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
