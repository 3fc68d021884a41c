"""One reference per operation: every implementation of each core operation, on the same
fresh random inputs, against ONE float64 (or plain Python) reference written here.

Implementations gathered per operation (a parametrize id per operation and implementation).
The op families under `embcache.ops` (ids, plan, pooling, gather, update) take theirs from the
registry (`ops.registry.implementations`: ``spec``, ``triton``, ``native``), each called
directly; the composites of several families name theirs:

* ``torch``: the torch twin (``*_ref.py``), through the public function under
  ``EMBCACHE_BACKEND=torch``;
* ``triton``: the Triton kernel through the same function under ``EMBCACHE_BACKEND=triton``
  (the interpreter on a machine without a GPU, so shapes stay small);
* ``numba-*``: the compiled CPU version in `embcache.native`, where there is one;
* ``fbgemm``: FBGEMM's CPU TBE as `engine.tbe_step.TbeStep` drives it (pooling, and its
  backward with the row update in one pass), where fbgemm_gpu imports.

Inputs have odd shapes on purpose: dims 5 and 123, empty bags, duplicate ids, one huge bag, ids
at a table's last row; output buffers start as NaN so an element an implementation forgets to
write shows. Operations with no implementation of a kind list none here (the optimizer has no
numba version; the plan family's numba implementation runs the cache index's torch code, and
its compiled plan looks ids up through a row index).
"""

from __future__ import annotations

import math
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import embcache.native as native
from embcache.engine import tbe_step
from embcache.engine.batch_state import Prepared
from embcache.kernels.optim import (
    OptimRule,
    RowUpdate,
    apply_row_update,
    state_dim,
)
from embcache.kernels.pooling import PoolingMode, pool_backward
from embcache.kv.base import TableSpec
from embcache.kv.host import HostKV
from embcache.ops.ids import IdsOps
from embcache.ops.registry import implementations, ops_for

HAS_NUMBA = native._njit() is not None
HAS_FBGEMM = tbe_step._fbgemm() is not None
NO_NUMBA = "numba cannot be imported here: embcache.native has no compiled kernels"
NO_FBGEMM = "fbgemm_gpu cannot be imported here: no CPU TBE"


def _impl(name: str, needs: str | None = None) -> object:
    """A parametrize entry for implementation ``name`` (skipped when its library is absent).

    The Triton ones run only under the interpreter, on the CPU tensors built here (`use` skips
    them elsewhere; on a GPU the kernel test files run Triton on the device): exempt from the
    launch guard of the GPU check, which otherwise fails an interpreted launch by a test that
    does not take the ``device`` fixture."""
    marks = []
    if "triton" in name:
        marks.append(pytest.mark.launch_guard_exempt)
    if needs == "numba" and not HAS_NUMBA:
        marks.append(pytest.mark.skip(reason=NO_NUMBA))
    if needs == "fbgemm" and not HAS_FBGEMM:
        marks.append(pytest.mark.skip(reason=NO_FBGEMM))
    return pytest.param(name, id=name, marks=marks)


# What an implementation of an op family (`embcache.ops.registry`) needs here.
NEEDS = {"native": "numba"}


def _family(family: str) -> list:
    """A parametrize entry per implementation of ``family`` that the registry lists
    (`ops.registry.implementations`): a new implementation, or a new family's, is tested here
    the day it is registered."""
    return [_impl(name, NEEDS.get(name)) for name in implementations(family)]


@pytest.fixture
def use(monkeypatch: pytest.MonkeyPatch):
    """``use(impl)``: select the backend an implementation runs under. ``torch``/``triton``
    force the twins or the kernels; every other implementation runs under ``auto`` (where
    `embcache.native` is on, on a CPU)."""

    def select(impl: str) -> None:
        name = impl if impl in ("torch", "triton") else "auto"
        if impl == "spec":  # an op family's torch specification (`embcache.ops`)
            name = "torch"
        if impl.startswith("twins-"):
            name = impl.removeprefix("twins-")
        if name == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            # These inputs are CPU tensors: compiled Triton (a GPU machine) takes device ones,
            # and the kernel test files run it there (their ``device`` fixture).
            pytest.skip("Triton on CPU tensors needs the interpreter (TRITON_INTERPRET=1)")
        monkeypatch.setenv("EMBCACHE_BACKEND", name)

    return select


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# dedup of fused ids
# ----------------------------------------------------------------------------------------------

FUSION_K = 20
TABLE_ROWS = (7, 50)  # two tables; ids hit each one's last row


def _fused_batch(n: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Raw ids per feature (feature f reads table f) and the fused ids, feature-major."""
    g = _gen(seed)
    raw = []
    for t, rows in enumerate(TABLE_ROWS):
        k = n // 2 + t * (n % 2)
        ids = torch.randint(0, rows, (k,), generator=g)
        if k:
            ids[torch.randint(0, k, (1,), generator=g)] = rows - 1  # the last row
        raw.append(ids)
    fused = torch.cat([ids | (t << FUSION_K) for t, ids in enumerate(raw)])
    return raw, fused


def _dedup_reference(fused: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    values = fused.tolist()
    unique = sorted(set(values))
    rank = {v: i for i, v in enumerate(unique)}
    inverse = [rank[v] for v in values]
    counts = [values.count(v) for v in unique]
    return unique, inverse, counts


ROW_OFFSET = torch.tensor([0, TABLE_ROWS[0]])  # the two tables' rows, numbered one after another
DEDUP_WAYS = ["dedup", "grouped", "row-map", "row-map-values"]


def _run_dedup(ops: IdsOps, way: str, raw: list[torch.Tensor], fused: torch.Tensor):
    """The way's unique ids, inverse and counts; None where a row map declines the batch
    (asserted to be a batch it must decline: its caller then takes the plain dedup)."""
    if way == "dedup":
        return ops.dedup(fused)
    if way == "grouped":
        unique, inverse, order, segments = ops.dedup_grouped(fused)
        # The grouping: values of id u at order[segments[u]:segments[u + 1]], ascending.
        assert torch.equal(fused[order], unique.repeat_interleave(segments.diff()))
        for u in range(unique.numel()):
            part = order[segments[u] : segments[u + 1]]
            assert torch.equal(part, part.sort().values)
        return unique, inverse, segments.diff()
    rows = ops.row_dedup(ROW_OFFSET, sum(TABLE_ROWS), dict(enumerate(TABLE_ROWS)), FUSION_K)
    if way == "row-map":
        found = rows.unique_by_rows(fused)
        if found is None:
            assert not rows.dense_batch(fused.numel(), rows.compiled)
            return None
    else:  # raw ids checked, fused and deduplicated in one pass (compiled only)
        values = torch.cat(raw)
        bounds = torch.tensor([0, raw[0].numel(), values.numel()])
        found = rows.unique_values(values, bounds, rows.row_ranges([0, 1]))
        if found is None:
            assert not rows.maps_batch(values.numel())
            return None
    unique, inverse = found
    return unique, inverse, torch.bincount(inverse, minlength=unique.numel())


@pytest.mark.parametrize("n", [0, 1, 157], ids=["empty", "one", "n157"])
@pytest.mark.parametrize("way", DEDUP_WAYS)
@pytest.mark.parametrize("impl", _family("ids"))
def test_dedup(impl: str, way: str, n: int, use) -> None:
    use(impl)
    raw, fused = _fused_batch(n, seed=11 + n)
    found = _run_dedup(implementations("ids")[impl], way, raw, fused)
    if found is None:  # declined, as it must be (asserted there)
        return
    unique, inverse, counts = found
    ref_unique, ref_inverse, ref_counts = _dedup_reference(fused)
    assert unique.dtype == inverse.dtype == torch.int64
    assert unique.tolist() == ref_unique
    assert inverse.tolist() == ref_inverse
    if counts is not None:  # (the CPU path counts, the Triton dedup too)
        assert counts.tolist() == ref_counts


# ----------------------------------------------------------------------------------------------
# pooling forward and backward
# ----------------------------------------------------------------------------------------------

B, F = 5, 2
EXTRA_COLUMNS = 3  # rows are strided views: [R, dim] of [R, dim + 3]
NUM_ROWS = 40


def _bags(dim: int, weighted: bool, seed: int, unique: int = 20) -> SimpleNamespace:
    """F * B feature-major bags over ``unique`` ids held at distinct slots (one at the last
    row): empty bags, duplicates within a bag, and one huge bag."""
    g = _gen(seed)
    storage = torch.randn(NUM_ROWS, dim + EXTRA_COLUMNS, generator=g)
    perm = torch.randperm(NUM_ROWS - 1, generator=g)[: unique - 1]
    slots = torch.cat([perm, torch.tensor([NUM_ROWS - 1])])
    lengths = torch.randint(0, 4, (F * B,), generator=g)
    lengths[1] = 0  # empty bags
    lengths[B] = 0
    lengths[2] = 211 if dim < 100 else 97  # one huge bag
    lengths[3] = max(int(lengths[3]), 2)
    nnz = int(lengths.sum())
    inverse = torch.randint(0, unique, (nnz,), generator=g)
    start = int(lengths[:3].sum())
    inverse[start : start + 2] = inverse[start]  # a duplicate within bag 3
    offsets = torch.zeros(F * B + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    weights = torch.rand(nnz, generator=g) * 2 - 0.5 if weighted else None
    return SimpleNamespace(
        storage=storage,
        rows=storage[:, :dim],
        dim=dim,
        slots=slots,
        inverse=inverse,
        offsets=offsets,
        weights=weights,
        col_offsets=torch.arange(F, dtype=torch.int64) * dim,
        grad_out=torch.randn(B, F * dim, generator=g),
    )


def _values64(p: SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Each value's row and weight, float64."""
    x = p.rows.double()[p.slots[p.inverse]]
    w = p.weights.double() if p.weights is not None else torch.ones(p.inverse.numel()).double()
    return x, w


def _forward_reference(p: SimpleNamespace, mode: PoolingMode):
    """float64 ``out [B, F * dim]`` and, for MAX, the first value reaching each bag's max."""
    x, w = _values64(p)
    out = torch.zeros(B, F * p.dim, dtype=torch.float64)
    argmax = torch.full((F * B, p.dim), -1, dtype=torch.int64)
    for q in range(F * B):
        f, b = divmod(q, B)
        lo, hi = int(p.offsets[q]), int(p.offsets[q + 1])
        if hi == lo:
            continue
        seg = x[lo:hi] * w[lo:hi, None]
        cols = slice(f * p.dim, (f + 1) * p.dim)
        if mode == PoolingMode.SUM:
            out[b, cols] = seg.sum(0)
        elif mode == PoolingMode.MEAN:
            out[b, cols] = seg.sum(0) / (hi - lo)
        else:
            best = seg.max(0).values
            out[b, cols] = best
            argmax[q] = lo + (seg == best).to(torch.int8).argmax(0)
    return out, argmax


def _backward_reference(p: SimpleNamespace, mode: PoolingMode, argmax: torch.Tensor):
    """float64 gradient ``[U, dim]`` of each unique id."""
    _, w = _values64(p)
    grad = torch.zeros(p.slots.numel(), p.dim, dtype=torch.float64)
    g = p.grad_out.double()
    for q in range(F * B):
        f, b = divmod(q, B)
        lo, hi = int(p.offsets[q]), int(p.offsets[q + 1])
        gq = g[b, f * p.dim : (f + 1) * p.dim]
        for j in range(lo, hi):
            u = int(p.inverse[j])
            if mode == PoolingMode.SUM:
                grad[u] += w[j] * gq
            elif mode == PoolingMode.MEAN:
                grad[u] += w[j] * gq / (hi - lo)
            else:
                grad[u] += torch.where(argmax[q] == j, w[j] * gq, 0.0)
    return grad


def _fbgemm_step(p: SimpleNamespace, mode: PoolingMode, rule: OptimRule, weights, state):
    """A `TbeStep` over a stand-in cache holding ``weights`` / ``state`` as its slots."""
    cache = SimpleNamespace(
        weights=weights, state=state, storage_lock=threading.Lock(), ops=ops_for("cpu")
    )
    step = tbe_step.TbeStep(cache, mode, rule, eps=1e-8)
    prepared = Prepared(
        unique=None,
        inverse=p.inverse,
        slots=p.slots,
        offsets=p.offsets,
        weights=p.weights,
        locked=True,
    )
    return step, prepared


def _fbgemm_skip(dim: int, mode: PoolingMode, weighted: bool) -> None:
    # What `TbeStep.for_engine` / `takes` route elsewhere: not an implementation there.
    if dim % 4:
        pytest.skip("FBGEMM's CPU TBE takes dims that are multiples of 4 (tbe_step's rule)")
    if mode == PoolingMode.MAX:
        pytest.skip("the FBGEMM path (engine/tbe_step) pools SUM and MEAN only")
    if weighted and mode == PoolingMode.MEAN:
        pytest.skip("FBGEMM's weighted MEAN is another function (TbeStep.takes refuses it)")


MODES = [pytest.param(m, id=m.name.lower()) for m in PoolingMode]
DIMS = [pytest.param(5, id="dim5"), pytest.param(8, id="dim8"), pytest.param(123, id="dim123")]
WEIGHTED = [pytest.param(False, id="plain"), pytest.param(True, id="weighted")]


@pytest.mark.parametrize("weighted", WEIGHTED)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("impl", [*_family("pooling"), _impl("fbgemm", "fbgemm")])
def test_pool_forward(impl: str, dim: int, mode: PoolingMode, weighted: bool, use) -> None:
    use(impl)
    p = _bags(dim, weighted, seed=dim * 7 + int(mode) * 2 + weighted)
    ref, ref_argmax = _forward_reference(p, mode)
    if impl == "fbgemm":
        _fbgemm_skip(dim, mode, weighted)
        step, prepared = _fbgemm_step(
            p, mode, OptimRule.SGD, p.rows.contiguous(), torch.empty(NUM_ROWS, 0)
        )
        pooled, _ = step.pool(prepared, lr=0.0, batch_size=B)
        out, argmax = pooled.detach().reshape(B, F * dim), None
    else:
        out = torch.full((B, F * dim), math.nan)
        argmax = implementations("pooling")[impl].pool_forward(
            p.rows, dim, p.slots, p.inverse, p.offsets, p.weights, mode, out, B, p.col_offsets
        )
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    if mode == PoolingMode.MAX and argmax is not None:
        # Any value reaching the max is a right answer; empty bags say -1.
        x, w = _values64(p)
        empty = p.offsets[1:] == p.offsets[:-1]
        assert bool((argmax[empty] == -1).all())
        assert torch.equal(argmax == -1, ref_argmax == -1)
        lo, hi = p.offsets[:-1, None], p.offsets[1:, None]
        won = argmax[~empty]
        assert bool(((won >= lo[~empty]) & (won < hi[~empty])).all())
        cols = torch.arange(dim).expand_as(won)
        picked = x[won, cols] * w[won]
        best = x[ref_argmax[~empty], cols] * w[ref_argmax[~empty]]
        torch.testing.assert_close(picked, best, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weighted", WEIGHTED)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("impl", [*_family("pooling"), _impl("spec-grouped")])
def test_pool_backward(impl: str, dim: int, mode: PoolingMode, weighted: bool, use) -> None:
    use(impl.removesuffix("-grouped"))
    p = _bags(dim, weighted, seed=dim * 5 + int(mode) * 2 + weighted)
    _, argmax = _forward_reference(p, mode)
    ref = _backward_reference(p, mode, argmax)
    grouping = None
    if impl.endswith("-grouped"):
        order = torch.sort(p.inverse, stable=True).indices
        counts = torch.bincount(p.inverse, minlength=p.slots.numel())
        grouping = (order, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))
    grad = implementations("pooling")[impl.removesuffix("-grouped")].pool_backward(
        p.grad_out,
        dim,
        p.inverse,
        p.slots.numel(),
        p.offsets,
        p.weights,
        mode,
        B,
        p.col_offsets,
        argmax if mode == PoolingMode.MAX else None,
        grouping,
    )
    assert grad.dtype == torch.float32 and grad.shape == ref.shape
    torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# unpooled gather (sequence embeddings) forward and backward
# ----------------------------------------------------------------------------------------------


def _sequence(dim: int, seed: int, unique: int = 20) -> SimpleNamespace:
    """Values over ``unique`` ids held at distinct slots (one at the last row, one not
    admitted): duplicates, one hot id holding a third of the values, one id no value uses."""
    g = _gen(seed)
    storage = torch.randn(NUM_ROWS, dim + EXTRA_COLUMNS, generator=g)
    storage[:, dim:] = math.nan  # beyond the table's dim: never read
    perm = torch.randperm(NUM_ROWS - 1, generator=g)[: unique - 1]
    slots = torch.cat([perm, torch.tensor([NUM_ROWS - 1])])
    slots[3] = -1  # an id the cache did not admit: reads zeros
    nnz = 157 if dim < 100 else 61
    inverse = torch.randint(0, unique - 1, (nnz,), generator=g)  # id unique - 1: no value
    inverse[: nnz // 3] = 4  # a hot id
    inverse[-2:] = torch.tensor([3, unique - 2])  # the id not admitted, the last row's id
    inverse = inverse[torch.randperm(nnz, generator=g)]
    return SimpleNamespace(
        rows=storage[:, :dim],
        dim=dim,
        slots=slots,
        inverse=inverse,
        grad_out=torch.randn(nnz, dim, generator=g),
    )


def _gather_reference(p: SimpleNamespace) -> torch.Tensor:
    """float64 ``[nnz, dim]``: each value's row, zeros where its slot is negative."""
    out = torch.zeros(p.inverse.numel(), p.dim, dtype=torch.float64)
    for j, u in enumerate(p.inverse.tolist()):
        slot = int(p.slots[u])
        if slot >= 0:
            out[j] = p.rows[slot].double()
    return out


def _gather_backward_reference(p: SimpleNamespace) -> torch.Tensor:
    """float64 ``[U, dim]``: each unique id's gradient rows summed."""
    grad = torch.zeros(p.slots.numel(), p.dim, dtype=torch.float64)
    for j, u in enumerate(p.inverse.tolist()):
        grad[u] += p.grad_out[j].double()
    return grad


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("impl", _family("gather"))
def test_gather_rows(impl: str, dim: int, use) -> None:
    use(impl)
    p = _sequence(dim, seed=dim * 11)
    out = torch.full((p.inverse.numel(), dim), math.nan)
    assert implementations("gather")[impl].gather_rows(p.rows, dim, p.slots, p.inverse, out) is out
    torch.testing.assert_close(out.double(), _gather_reference(p), rtol=0, atol=0)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize(
    "impl", [*_family("gather"), *(_impl(f"{name}-grouped") for name in implementations("gather"))]
)
def test_gather_backward(impl: str, dim: int, use) -> None:
    use(impl.removesuffix("-grouped"))
    p = _sequence(dim, seed=dim * 13)
    grouping = None
    if impl.endswith("-grouped"):
        order = torch.sort(p.inverse, stable=True).indices
        counts = torch.bincount(p.inverse, minlength=p.slots.numel())
        grouping = (order, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))
    gather = implementations("gather")[impl.removesuffix("-grouped")]
    grad = gather.gather_backward(p.grad_out, p.inverse, p.slots.numel(), grouping)
    ref = _gather_backward_reference(p)
    assert grad.dtype == torch.float32 and grad.shape == ref.shape
    torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# optimizer row update
# ----------------------------------------------------------------------------------------------

LR, EPS, BETAS, WD, LR_DECAY, STEP = 0.05, 1e-8, (0.9, 0.99), 0.01, 0.1, 3


def _update_reference(rule: OptimRule, w, s, g, step=STEP, wd=WD, lr_decay=LR_DECAY):
    """One step of ``rule`` on float64 rows ``w [n, dim]``, state ``s [n, S]``, gradient
    ``g``, as the public contract words it (torch.optim / FBGEMM's formulas), L2 weight decay
    ``wd`` added to the gradient (ADAMW: ``w *= 1 - lr * wd`` first, then ADAM)."""
    dim = w.shape[1]
    if rule == OptimRule.ADAMW:  # AdamW's decoupled decay: the weights shrink, no L2 term
        w = w * (1 - LR * wd)
    else:
        g = g + wd * w
    if rule == OptimRule.SGD:
        return w - LR * g, s
    if rule == OptimRule.ADAGRAD:
        acc = s[:, :dim] + g * g
        clr = LR / (1 + (step - 1) * lr_decay)
        return w - clr * g / (acc.sqrt() + EPS), torch.cat([acc, s[:, dim:]], 1)
    if rule == OptimRule.ROWWISE_ADAGRAD:
        acc = s[:, :1] + (g * g).mean(1, keepdim=True)
        return w - LR * g / (acc.sqrt() + EPS), torch.cat([acc, s[:, 1:]], 1)
    b1, b2 = BETAS
    m = b1 * s[:, :dim] + (1 - b1) * g
    v = b2 * s[:, dim : 2 * dim] + (1 - b2) * g * g
    size = LR * math.sqrt(1 - b2**step) / (1 - b1**step)
    return w - size * m / (v.sqrt() + EPS), torch.cat([m, v, s[:, 2 * dim :]], 1)


def _row_update(rule: OptimRule) -> RowUpdate:
    return RowUpdate(
        rule,
        lr=LR,
        eps=EPS,
        beta1=BETAS[0],
        beta2=BETAS[1],
        weight_decay=WD,
        lr_decay=LR_DECAY if rule == OptimRule.ADAGRAD else 0.0,
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


RULES = [pytest.param(r, id=r.name.lower()) for r in OptimRule]


@pytest.mark.parametrize("dim", [pytest.param(5, id="dim5"), pytest.param(123, id="dim123")])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("impl", _family("update"))
def test_row_update(impl: str, rule: OptimRule, dim: int, use) -> None:
    use(impl)
    g = _gen(dim * 3 + int(rule))
    rows, n = 30, 12
    cols = state_dim(rule, dim) + 1  # one column beyond the rule's, never touched
    slots = torch.cat([torch.randperm(rows - 1, generator=g)[: n - 2], torch.tensor([rows - 1])])
    slots = torch.cat([slots, torch.tensor([-1])])  # a row the cache did not admit: skipped
    slots = slots[torch.randperm(slots.numel(), generator=g)]
    weights = torch.full((rows, dim), math.nan)  # rows not updated stay NaN, bit for bit
    state = torch.full((rows, cols), math.nan)
    kept = slots[slots >= 0]
    weights[kept] = torch.randn(kept.numel(), dim, generator=g)
    state[kept, : cols - 1] = torch.rand(kept.numel(), cols - 1, generator=g)
    grads = torch.randn(slots.numel(), dim, generator=g)
    before_w, before_s = weights.clone(), state.clone()
    ref_w, ref_s = _update_reference(
        rule,
        before_w[kept].double(),
        before_s[kept, : cols - 1].double(),
        grads[slots >= 0].double(),
    )
    update = implementations("update")[impl]
    update.apply_row_update(weights, state, slots, grads, _row_update(rule), STEP)
    torch.testing.assert_close(weights[kept].double(), ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[kept, : cols - 1].double(), ref_s, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[kept] = False
    assert torch.equal(_bits(weights[untouched]), _bits(before_w[untouched]))
    assert torch.equal(_bits(state[untouched]), _bits(before_s[untouched]))
    assert torch.equal(_bits(state[:, -1]), _bits(before_s[:, -1]))


@pytest.mark.parametrize("impl", _family("update"))
def test_aggregate_grads(impl: str, use) -> None:
    use(impl)
    g = _gen(5)
    ids = torch.cat([torch.randint(0, 9, (60,), generator=g), torch.full((300,), 4)])  # hot id
    ids = ids[torch.randperm(ids.numel(), generator=g)] | (1 << 40)
    grads = torch.randn(ids.numel(), 5, generator=g)
    unique, summed = implementations("update")[impl].aggregate_grads(ids, grads)
    ref_unique = sorted(set(ids.tolist()))
    assert unique.tolist() == ref_unique
    ref = torch.stack([grads.double()[ids == u].sum(0) for u in ref_unique])
    torch.testing.assert_close(summed.double(), ref, rtol=1e-5, atol=1e-4)


# The composite the FBGEMM CPU TBE does in one backward: pooled gradient -> per-id gradient
# -> row update, against the references above chained in float64.

TBE_RULES = [
    pytest.param(r, id=r.name.lower())
    for r in (OptimRule.SGD, OptimRule.ADAGRAD, OptimRule.ROWWISE_ADAGRAD)
]


@pytest.mark.parametrize("mode", [pytest.param(PoolingMode.SUM, id="sum"),
                                  pytest.param(PoolingMode.MEAN, id="mean")])  # fmt: skip
@pytest.mark.parametrize("rule", TBE_RULES)
@pytest.mark.parametrize(
    "impl", [_impl("twins-torch"), _impl("twins-triton"), _impl("fbgemm", "fbgemm")]
)
def test_pooled_backward_and_update(impl: str, rule: OptimRule, mode: PoolingMode, use) -> None:
    use(impl)
    dim = 8  # FBGEMM's CPU TBE needs a multiple of 4
    p = _bags(dim, weighted=False, seed=int(rule) * 3 + int(mode))
    weights = p.rows.contiguous()
    state = torch.rand(NUM_ROWS, state_dim(rule, dim), generator=_gen(9))
    before_w, before_s = weights.clone(), state.clone()
    grad_rows = _backward_reference(p, mode, argmax=torch.empty(0))
    # No weight decay, no lr decay: what the TBE step takes (TbeStep.can_apply).
    ref_w, ref_s = _update_reference(
        rule, before_w[p.slots].double(), before_s[p.slots].double(), grad_rows, 1, 0.0, 0.0
    )
    if impl == "fbgemm":
        step, prepared = _fbgemm_step(p, mode, rule, weights, state)
        pooled, bound = step.pool(prepared, lr=LR, batch_size=B)
        pending = tbe_step.PendingUpdate(
            engine=0,
            batch=None,
            pooled=pooled,
            grad=p.grad_out.reshape(B * F, dim),
            grad_out=p.grad_out,
            batch_size=B,
            columns=p.col_offsets,
            bound=bound,
            lr=LR,
        )
        step.apply(pending, prepared)
    else:
        grads = pool_backward(p.grad_out, dim, p.inverse, p.slots.numel(), p.offsets, None,
                              mode, B, p.col_offsets, None)  # fmt: skip
        update = RowUpdate(rule, lr=LR, eps=EPS)
        apply_row_update(weights, state, p.slots, grads, update, 1)
    torch.testing.assert_close(weights[p.slots].double(), ref_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[p.slots].double(), ref_s, rtol=1e-5, atol=1e-5)
    others = torch.ones(NUM_ROWS, dtype=torch.bool)
    others[p.slots] = False
    assert torch.equal(weights[others], before_w[others])
    assert torch.equal(state[others], before_s[others])


# ----------------------------------------------------------------------------------------------
# cache set index, lookup and victim choice
# ----------------------------------------------------------------------------------------------

_M64 = (1 << 64) - 1


def _set_reference(key: int, num_sets: int) -> int:
    """splitmix64's finaliser of ``key + golden`` in Python ints, low 63 bits, mod sets."""
    z = (key + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return (z & ((1 << 63) - 1)) % num_sets


CACHE_IMPLS = _family("plan")


@pytest.mark.parametrize("num_sets", [1, 7, 1 << 40])
@pytest.mark.parametrize("impl", CACHE_IMPLS)
def test_set_index(impl: str, num_sets: int, use) -> None:
    use(impl)
    set_index = implementations("plan")[impl].set_index
    g = _gen(num_sets % 1000)
    ids = torch.randint(-(2**62), 2**62, (97,), generator=g, dtype=torch.int64)
    ids[:4] = torch.tensor([0, -1, 2**63 - 1, -(2**63)])
    got = set_index(ids, num_sets)
    assert got.tolist() == [_set_reference(k, num_sets) for k in ids.tolist()]


@pytest.mark.parametrize("impl", CACHE_IMPLS)
def test_cache_lookup(impl: str, use) -> None:
    use(impl)
    cache_lookup = implementations("plan")[impl].cache_lookup
    g = _gen(3)
    sets, ways = 6, 5
    keys = torch.full((sets, ways), -1, dtype=torch.int64)
    held = torch.randperm(1000, generator=g)[:40]
    set_of = {k: _set_reference(k, sets) for k in held.tolist()}
    for k, s in set_of.items():
        free = (keys[s] == -1).nonzero()
        if free.numel():
            keys[s, free[-1]] = k  # fill from the last way: the way matters
    ids = torch.cat([held, torch.tensor([1000, 1001]), held[:3]])  # misses and duplicates
    set_idx = torch.tensor([_set_reference(k, sets) for k in ids.tolist()])
    got = cache_lookup(keys, ids, set_idx)
    ref = []
    for k, s in zip(ids.tolist(), set_idx.tolist(), strict=True):
        row = keys[s].tolist()
        ref.append(row.index(k) if k in row else -1)
    assert got.tolist() == ref


@pytest.mark.parametrize("impl", CACHE_IMPLS)
def test_assign_ways(impl: str, use) -> None:
    use(impl)
    assign_ways = implementations("plan")[impl].assign_ways
    g = _gen(4)
    sets, ways = 5, 4
    scores = torch.randint(-1, 6, (sets, ways), generator=g)  # ties: broken by way
    blocked = torch.rand(sets, ways, generator=g) < 0.3
    blocked[0] = True  # a set with no way to give
    miss_sets = torch.sort(torch.randint(0, sets, (14,), generator=g)).values
    miss_sets[-6:] = sets - 1  # more misses than ways: the overflow gets -1
    got = assign_ways(scores, blocked, miss_sets)
    ref, rank = [], {}
    for s in miss_sets.tolist():
        order = sorted(range(ways), key=lambda w, s=s: (bool(blocked[s, w]), int(scores[s, w]), w))
        k = rank.get(s, 0)
        rank[s] = k + 1
        ref.append(order[k] if k < int((~blocked[s]).sum()) else -1)
    assert got.tolist() == ref


# ----------------------------------------------------------------------------------------------
# row moves between a tier's stored rows and a CPU cache's slots
# ----------------------------------------------------------------------------------------------

MOVE_DIM, MOVE_STATE, SLOTS = 5, 3, 23


def _moves(seed: int) -> SimpleNamespace:
    g = _gen(seed)
    n = 9
    slots = torch.cat([torch.randperm(SLOTS - 1, generator=g)[: n - 1], torch.tensor([SLOTS - 1])])
    ids = torch.cat([torch.randperm(6, generator=g)[:4], torch.tensor([6]),  # table a, last row
                     torch.randperm(30, generator=g)[:4]])  # fmt: skip
    return SimpleNamespace(
        slots=slots,
        ids=ids,
        counts=[5, 4],
        rows=torch.randn(n, MOVE_DIM + MOVE_STATE, generator=g),
    )


def _tier(m: SimpleNamespace, rows: torch.Tensor | None) -> HostKV:
    kv = HostKV(pin_memory=False)
    for name, num in (("a", 7), ("b", 30)):
        kv.init_table(TableSpec(name, MOVE_DIM, num, state_dim=MOVE_STATE))
    if rows is not None:
        kv.put_grouped(["a", "b"], m.ids, m.counts, rows)
    return kv


MOVE_IMPLS = [_impl("torch"), _impl("numba", "numba"), _impl("hostkv-straight", "numba")]


@pytest.mark.parametrize("impl", MOVE_IMPLS)
def test_rows_into_slots(impl: str, use) -> None:
    use(impl)
    m = _moves(1)
    weights = torch.full((SLOTS, MOVE_DIM), math.nan)
    state = torch.full((SLOTS, MOVE_STATE), math.nan)
    if impl == "torch":
        spec = implementations("rows")["spec"]  # the rows family's specification
        spec.copy_rows(weights, m.slots, m.rows[:, :MOVE_DIM])
        spec.copy_rows(state, m.slots, m.rows[:, MOVE_DIM:])
    elif impl == "numba":
        implementations("rows")["native"].scatter_split(weights, state, m.slots, m.rows)
    else:
        kv = _tier(m, m.rows)
        assert kv.get_grouped_into(["a", "b"], m.ids, m.counts, weights, state, m.slots)
    ref_w = np.full((SLOTS, MOVE_DIM), np.nan)
    ref_s = np.full((SLOTS, MOVE_STATE), np.nan)
    for i, s in enumerate(m.slots.tolist()):
        ref_w[s] = m.rows[i, :MOVE_DIM].double().numpy()
        ref_s[s] = m.rows[i, MOVE_DIM:].double().numpy()
    np.testing.assert_array_equal(weights.double().numpy(), ref_w)
    np.testing.assert_array_equal(state.double().numpy(), ref_s)


@pytest.mark.parametrize("impl", MOVE_IMPLS)
def test_rows_out_of_slots(impl: str, use) -> None:
    use(impl)
    m = _moves(2)
    g = _gen(7)
    weights = torch.randn(SLOTS, MOVE_DIM, generator=g)
    state = torch.randn(SLOTS, MOVE_STATE, generator=g)
    out = torch.full((m.slots.numel(), MOVE_DIM + MOVE_STATE), math.nan)
    if impl == "torch":
        torch.index_select(weights, 0, m.slots, out=out[:, :MOVE_DIM])
        torch.index_select(state, 0, m.slots, out=out[:, MOVE_DIM:])
    elif impl == "numba":
        implementations("rows")["native"].gather_join(weights, state, m.slots, out)
    else:
        kv = _tier(m, None)
        assert kv.put_grouped_from(["a", "b"], m.ids, m.counts, weights, state, m.slots)
        out = torch.cat([kv.read("a", m.ids[:5]), kv.read("b", m.ids[5:])])
    ref = np.array([list(weights[s].double()) + list(state[s].double()) for s in m.slots.tolist()])
    np.testing.assert_array_equal(out.double().numpy(), ref)
