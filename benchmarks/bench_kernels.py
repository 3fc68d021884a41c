"""How fast is each kernel op against the obvious plain-torch way of doing the same job?

Question: for the ops of one training step — ``fuse_ids``, ``dedup``, ``pool_forward``,
``pool_backward``, the unpooled ``gather_rows`` / ``gather_backward`` (sequence embeddings) and
``apply_row_update`` — the time of the torch twin (the CPU path) and, where
CUDA is present, of the Triton kernel, each as ``baseline_time / our_time`` (> 1: ours is faster)
against a named baseline measured in the same run on the same inputs:

* ``fuse_ids``: ``unchecked_fuse``: ``values | (repeat_interleave(table_idx, lengths) << k)``,
  the fusion without the range checks ours makes (so the ratio is the price of validation).
* ``dedup``: ``torch.unique(sorted=True, return_inverse=True)``.
* ``pool_forward``: ``F.embedding_bag`` over a dense table of every row (indices: each value's
  row), then the ``[F*B, D] -> [B, F*D]`` layout ours writes directly. Weighted MEAN, which
  ``embedding_bag`` lacks, is its weighted SUM divided by the bag lengths (as ours defines it).
* ``pool_backward``: the autograd backward of that ``embedding_bag`` with ``sparse=True``, then
  ``coalesce()``: one gradient row per distinct row, what ours returns. Ours is handed the
  batch's dedup (``inverse``, ``U``), which the forward already paid for (timed under dedup).
* ``gather_rows`` (unpooled gather: one row per value): ``torch.index_select`` of the dense
  table by each value's row into a preallocated ``[nnz, D]`` output, as ours writes one.
* ``gather_backward``: ``torch.zeros(U, D).index_add_(0, inverse, grad)``: one gradient row per
  unique id, what ours returns; ours also with the batch's ``dedup_grouped`` grouping given
  (variant ``bwd/grouped``), which spares it the stable sort of ``inverse`` it does otherwise.
* ``apply_row_update``: ``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam`` stepping an
  ``nn.EmbeddingBag(sparse=True)`` whose sparse gradient holds exactly the touched rows.
  ROWWISE_ADAGRAD has no torch optimizer: its baseline is ``Adagrad`` (per-element state), the
  nearest one; its numbers are checked against the row-wise formula instead.

Every baseline's result is checked against ours before timing. The workload: a batch of
``B`` samples x ``F`` features, one table of ``--rows`` rows per feature, bag lengths uniform in
``[0, 2 * pooling]`` (empty bags included), ids Zipf(1.05) per table, all tables cached (so the
cache rows are the dense table). On CPU, Triton is not timed: its interpreter runs each program
in Python, a correctness path, not a speed path. On CUDA the script also reports keys/s of
``dedup`` and of ``cache_lookup``, and the achieved bandwidth of ``pool_forward`` (row bytes
read + output bytes written, per second; index reads not counted) against a measured
device-to-device copy (``torch.empty(N).copy_``) moving as many bytes, at a size where it is a
bandwidth figure: SUM, unweighted, dims 64 and 128, one call reading 512 MiB of rows, every
value a distinct row (a permutation of the table; no row served twice from L2), bags of 16
values (variant ``sum/unique-large``, also timed against its ``F.embedding_bag``). The
workload-size ``pool_forward`` calls last tens of microseconds and read mostly repeated (Zipf)
rows that L2 serves: their GB/s (against a 1 GiB copy), printed labelled latency-bound, is not
the bandwidth figure. On every device it reports the unpooled gather's bandwidth, float32
bytes moved per second (forward: rows read + rows written, ``2 * 4 * nnz * D``; backward:
gradient rows read + unique rows written, ``4 * (nnz + U) * D``; index reads not counted) of
the baseline, the twin and Triton side by side. Prints a table; writes ``kernels.csv`` and
``kernels.png``. ``--quick``: B=512, 20,000 rows, dims 16 and 128 on a GPU (the GPU check's
size); without one B=256, 5,000 rows, dims 16 and 64: a smoke test, too small for conclusions.

    python benchmarks/bench_kernels.py [--quick] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import (
    ZipfIds,
    add_output_options,
    backend,
    interleaved_seconds,
    parse_args,
    pick_device,
    pyplot,
    quick_note,
    run_header,
    seconds,
    set_threads,
    write_csv,
)
from torch import nn
from torch.nn import functional

from embcache.kernels.gather import gather_backward, gather_rows
from embcache.kernels.ids import dedup, dedup_grouped, fuse_ids
from embcache.kernels.optim import OptimRule, RowUpdate, apply_row_update, state_dim
from embcache.kernels.pooling import PoolingMode, pool_backward, pool_forward
from embcache.ops.registry import implementations

FUSION_K = 30
ALPHA = 1.05
COPY_ELEMS = 1 << 28  # float32 elements of the copy-bandwidth buffer (1 GiB)
# pool_forward's bandwidth (CUDA): rows read a call (far past the 50-60 MB L2 of an H100/H200),
# values a bag, dims. About 2 GB of device memory at most (the copy's buffers, the twin's
# gathered rows and do_bench's L2 flush included).
UNIQUE_ROW_BYTES = 512 << 20
UNIQUE_BAG = 16
UNIQUE_DIMS = (64, 128)
UNIQUE_VARIANT = "sum/unique-large"
LOOKUP_SETS, LOOKUP_BATCH = 1 << 16, 1 << 20  # cache_lookup on CUDA: 2M slots, 1M ids
POOL_VARIANTS = [
    (PoolingMode.SUM, False),
    (PoolingMode.SUM, True),
    (PoolingMode.MEAN, False),
    (PoolingMode.MEAN, True),
]
# (rule, our hyper-parameters, torch baseline): lr/eps as each torch optimizer's would be set.
UPDATES: list[tuple[OptimRule, RowUpdate, str]] = [
    (OptimRule.SGD, RowUpdate(OptimRule.SGD, lr=0.01), "torch.optim.SGD"),
    (OptimRule.ADAGRAD, RowUpdate(OptimRule.ADAGRAD, lr=0.01), "torch.optim.Adagrad"),
    (
        OptimRule.ROWWISE_ADAGRAD,
        RowUpdate(OptimRule.ROWWISE_ADAGRAD, lr=0.01),
        "torch.optim.Adagrad",
    ),
    (OptimRule.ADAM, RowUpdate(OptimRule.ADAM, lr=0.001, eps=1e-8), "torch.optim.SparseAdam"),
]


@dataclass
class Row:
    device: str
    op: str
    variant: str
    dim: int | None
    items: int  # what one call processes: values (ids, pooling) or rows (updates)
    bytes_moved: int | None  # pool_forward, gather_*: float32 bytes read + written
    baseline: str
    baseline_s: float
    twin_s: float
    triton_s: float | None
    copy_gb_s: float | None  # measured device-to-device copy bandwidth (CUDA only)

    @property
    def twin_x(self) -> float:
        return self.baseline_s / self.twin_s

    @property
    def triton_x(self) -> float | None:
        return None if self.triton_s is None else self.baseline_s / self.triton_s

    @property
    def twin_items_per_s(self) -> float:
        return self.items / self.twin_s

    @property
    def triton_items_per_s(self) -> float | None:
        return None if self.triton_s is None else self.items / self.triton_s

    @property
    def triton_gb_s(self) -> float | None:
        if self.triton_s is None or self.bytes_moved is None:
            return None
        return self.bytes_moved / self.triton_s / 1e9

    @property
    def triton_frac_copy_bw(self) -> float | None:
        gb_s = self.triton_gb_s
        return None if gb_s is None or not self.copy_gb_s else gb_s / self.copy_gb_s

    @property
    def baseline_gb_s(self) -> float | None:
        return None if self.bytes_moved is None else self.bytes_moved / self.baseline_s / 1e9

    @property
    def twin_gb_s(self) -> float | None:
        return None if self.bytes_moved is None else self.bytes_moved / self.twin_s / 1e9


EXTRA = [
    "twin_x",
    "triton_x",
    "twin_items_per_s",
    "triton_items_per_s",
    "triton_gb_s",
    "triton_frac_copy_bw",
    "baseline_gb_s",
    "twin_gb_s",
]
GATHER_OPS = ("gather_rows", "gather_backward")


# ----------------------------------------------------------------------------------------------
# workload
# ----------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One batch of F features x B samples over F tables of ``rows`` rows each, on a device."""

    batch: int
    features: int
    rows: int
    values: torch.Tensor  # int64 [nnz] raw ids, feature-major
    lengths: torch.Tensor  # int64 [F*B] bag lengths
    offsets: torch.Tensor  # int64 [F*B + 1]
    feature_lengths: torch.Tensor  # int64 [F] values per feature
    table_idx: torch.Tensor  # int64 [F]
    num_embeddings: torch.Tensor  # int64 [F]
    weights: torch.Tensor  # float32 [nnz]
    fused: torch.Tensor  # int64 [nnz] id | table << FUSION_K
    row_ids: torch.Tensor  # int64 [nnz] row in the dense table of all F tables
    unique: torch.Tensor  # int64 [U] fused, ascending
    inverse: torch.Tensor  # int64 [nnz]
    slots: torch.Tensor  # int64 [U] row of each unique id in the dense table (= cache rows)

    @property
    def nnz(self) -> int:
        return self.values.numel()

    @property
    def num_unique(self) -> int:
        return self.unique.numel()


def make_workload(
    batch: int, features: int, rows: int, pooling: int, device: torch.device
) -> Workload:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 2 * pooling + 1, (features * batch,), generator=gen)
    feature_lengths = lengths.view(features, batch).sum(dim=1)
    values = torch.cat(
        [ZipfIds(rows, ALPHA, gen).sample(int(n), gen) for n in feature_lengths.tolist()]
    )
    table_of_value = torch.arange(features).repeat_interleave(feature_lengths)
    fused = values | (table_of_value << FUSION_K)
    unique, inverse = torch.unique(fused, sorted=True, return_inverse=True)
    to = {"device": device}
    return Workload(
        batch=batch,
        features=features,
        rows=rows,
        values=values.to(**to),
        lengths=lengths.to(**to),
        offsets=torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(**to),
        feature_lengths=feature_lengths.to(**to),
        table_idx=torch.arange(features).to(**to),
        num_embeddings=torch.full((features,), rows).to(**to),
        weights=torch.rand(values.numel(), generator=gen).to(**to),
        fused=fused.to(**to),
        row_ids=(table_of_value * rows + values).to(**to),
        unique=unique.to(**to),
        inverse=inverse.to(**to),
        slots=((unique >> FUSION_K) * rows + (unique & ((1 << FUSION_K) - 1))).to(**to),
    )


# ----------------------------------------------------------------------------------------------
# timing ours against a baseline
# ----------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, device: torch.device, reps: int, copy_gb_s: float | None) -> None:
        self.device = device
        self.reps = reps
        self.copy_gb_s = copy_gb_s
        self.on_gpu = device.type == "cuda"

    def time(
        self,
        op: str,
        variant: str,
        dim: int | None,
        items: int,
        baseline: str,
        baseline_fn: Callable[[], object],
        ours_fn: Callable[[], object],
        bytes_moved: int | None = None,
    ) -> Row:
        """Time ``ours_fn`` under the torch twin and (CUDA) Triton, and ``baseline_fn``."""
        triton_s = None
        if self.on_gpu:
            base_s = seconds(baseline_fn, self.device, self.reps)
            with backend("torch"):
                twin_s = seconds(ours_fn, self.device, self.reps)
            with backend("triton"):
                triton_s = seconds(ours_fn, self.device, self.reps)
        else:
            with backend("torch"):
                base_s, twin_s = interleaved_seconds([baseline_fn, ours_fn], self.device, self.reps)
        row = Row(
            self.device.type,
            op,
            variant,
            dim,
            items,
            bytes_moved,
            baseline,
            base_s,
            twin_s,
            triton_s,
            self.copy_gb_s,
        )
        print_row(row)
        return row

    def implementations(self) -> list[str]:
        return ["torch", "triton"] if self.on_gpu else ["torch"]


def bench_ids(b: Bench, w: Workload) -> list[Row]:
    names = [f"f{i}" for i in range(w.features)]
    tables = [f"t{i}" for i in range(w.features)]

    def ours_fuse() -> torch.Tensor:
        return fuse_ids(
            w.values, w.feature_lengths, w.table_idx, w.num_embeddings, FUSION_K, names, tables
        )

    def unchecked_fuse() -> torch.Tensor:
        table = torch.repeat_interleave(w.table_idx, w.feature_lengths, output_size=w.nnz)
        return w.values | (table << FUSION_K)

    def torch_unique() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.unique(w.fused, sorted=True, return_inverse=True)

    # Every implementation of the ids family the registry lists that runs here (Triton on a
    # GPU only: the interpreter is no speed path) gives the baselines' answers.
    for name, ops in implementations("ids").items():
        if name == "triton" and not b.on_gpu:
            continue
        fused = ops.fuse_ids(
            w.values, w.feature_lengths, w.table_idx, w.num_embeddings, FUSION_K, names, tables
        )
        assert torch.equal(fused, unchecked_fuse()), name
        unique, inverse, counts = ops.dedup(w.fused)
        assert torch.equal(unique, w.unique) and torch.equal(inverse, w.inverse), name
        assert counts is not None and int(counts.sum()) == w.nnz, name
    return [
        b.time("fuse_ids", "-", None, w.nnz, "unchecked_fuse", unchecked_fuse, ours_fuse),
        b.time("dedup", "-", None, w.nnz, "torch.unique", torch_unique, lambda: dedup(w.fused)),
    ]


def _embedding_bag(
    table: torch.Tensor, w: Workload, mode: PoolingMode, weighted: bool, sparse: bool = False
) -> torch.Tensor:
    """The baseline pooled output ``[B, F*D]`` over the dense table."""
    pooled = functional.embedding_bag(
        w.row_ids,
        table,
        w.offsets,
        mode="sum" if weighted or mode == PoolingMode.SUM else "mean",
        sparse=sparse,
        per_sample_weights=w.weights if weighted else None,
        include_last_offset=True,
    )
    if weighted and mode == PoolingMode.MEAN:
        pooled = pooled / w.lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)
    dim = table.shape[1]
    return pooled.view(w.features, w.batch, dim).transpose(0, 1).reshape(w.batch, -1)


def bench_pooling(b: Bench, w: Workload, dim: int) -> list[Row]:
    gen = torch.Generator(b.device).manual_seed(dim)
    table = torch.randn(w.features * w.rows, dim, generator=gen, device=b.device)  # = cache rows
    cols = torch.arange(w.features, device=b.device) * dim
    out = torch.empty(w.batch, w.features * dim, device=b.device)
    grad_out = torch.randn(w.batch, w.features * dim, generator=gen, device=b.device)
    leaf = table.detach().requires_grad_()  # same storage, for the baseline's autograd
    rows: list[Row] = []
    for mode, weighted in POOL_VARIANTS:
        variant = f"{mode.name.lower()}{'/weighted' if weighted else ''}"
        psw = w.weights if weighted else None

        def ours_fwd(mode=mode, psw=psw) -> None:
            pool_forward(table, dim, w.slots, w.inverse, w.offsets, psw, mode, out, w.batch, cols)

        def ours_bwd(mode=mode, psw=psw) -> torch.Tensor:
            return pool_backward(
                grad_out, dim, w.inverse, w.num_unique, w.offsets, psw, mode, w.batch, cols, None
            )

        def base_fwd(mode=mode, weighted=weighted) -> torch.Tensor:
            with torch.no_grad():
                return _embedding_bag(table, w, mode, weighted)

        graph = _embedding_bag(leaf, w, mode, weighted, sparse=True)

        def base_bwd(graph=graph) -> torch.Tensor:
            (grad,) = torch.autograd.grad(graph, leaf, grad_out, retain_graph=True)
            return grad.coalesce()

        want_out, want_grad = base_fwd(), base_bwd()
        assert torch.equal(want_grad.indices()[0], w.slots)
        for impl in b.implementations():
            with backend(impl):
                ours_fwd()
                torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5, msg=impl)
                got = ours_bwd()
                torch.testing.assert_close(got, want_grad.values(), atol=2e-5, rtol=1e-5, msg=impl)
        # Each value reads one row; the output is written once.
        moved = 4 * dim * (w.nnz + w.batch * w.features)
        rows.append(
            b.time(
                "pool_forward", variant, dim, w.nnz, "F.embedding_bag", base_fwd, ours_fwd, moved
            )
        )
        rows.append(
            b.time(
                "pool_backward", variant, dim, w.nnz, "embedding_bag.backward", base_bwd, ours_bwd
            )
        )
        del graph
    return rows


def bench_gather(b: Bench, w: Workload, dim: int) -> list[Row]:
    """Unpooled gather (one row per value) and its backward, against ``index_select`` and
    ``index_add_`` on the same device and inputs."""
    gen = torch.Generator(b.device).manual_seed(dim + 1)
    table = torch.randn(w.features * w.rows, dim, generator=gen, device=b.device)  # = cache rows
    out = torch.empty(w.nnz, dim, device=b.device)
    base_out = torch.empty_like(out)
    grad_out = torch.randn(w.nnz, dim, generator=gen, device=b.device)
    unique, inverse, order, segments = dedup_grouped(w.fused)
    assert torch.equal(unique, w.unique) and torch.equal(inverse, w.inverse)
    grouping = (order, segments)

    def ours_fwd() -> torch.Tensor:
        return gather_rows(table, dim, w.slots, w.inverse, out)

    def base_fwd() -> torch.Tensor:
        return torch.index_select(table, 0, w.row_ids, out=base_out)

    def ours_bwd(given: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return gather_backward(grad_out, w.inverse, w.num_unique, given)

    def base_bwd() -> torch.Tensor:
        grad = torch.zeros(w.num_unique, dim, device=b.device)
        return grad.index_add_(0, w.inverse, grad_out)

    want_out, want_grad = base_fwd().clone(), base_bwd()
    for impl in b.implementations():
        with backend(impl):
            assert torch.equal(ours_fwd(), want_out), impl
            for g in (None, grouping):
                torch.testing.assert_close(ours_bwd(g), want_grad, atol=2e-5, rtol=1e-5, msg=impl)
    fwd_bytes = 2 * 4 * dim * w.nnz  # each value's row read, its output row written
    bwd_bytes = 4 * dim * (w.nnz + w.num_unique)  # gradient rows read, unique rows written
    return [
        b.time("gather_rows", "fwd", dim, w.nnz, "torch.index_select", base_fwd, ours_fwd,
               fwd_bytes),
        b.time("gather_backward", "bwd", dim, w.nnz, "Tensor.index_add_", base_bwd,
               ours_bwd, bwd_bytes),
        b.time("gather_backward", "bwd/grouped", dim, w.nnz, "Tensor.index_add_", base_bwd,
               lambda: ours_bwd(grouping), bwd_bytes),
    ]  # fmt: skip


def _sparse_rows(rows: torch.Tensor, values: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A coalesced sparse gradient holding ``values`` at the distinct ascending ``rows``."""
    shape = (num_rows, values.shape[1])
    return torch.sparse_coo_tensor(
        rows[None], values, shape, is_coalesced=True, check_invariants=False
    )


def _check_update(rule: OptimRule, update: RowUpdate, make_opt, dim: int, u: int) -> None:
    """Ours against the baseline optimizer (or the row-wise formula) on a compact table."""
    gen = torch.Generator().manual_seed(7)
    w0 = torch.randn(u, dim, generator=gen)
    grads = torch.randn(u, dim, generator=gen)
    slots = torch.arange(u)
    rows = torch.zeros(u, dim + state_dim(rule, dim))
    rows[:, :dim] = w0
    with backend("torch"):
        apply_row_update(rows[:, :dim], rows[:, dim:], slots, grads, update, step=1)
    if rule == OptimRule.ROWWISE_ADAGRAD:
        acc = (grads * grads).mean(dim=1, keepdim=True)
        want = w0 - update.lr * grads / (acc.sqrt() + update.eps)
    else:
        emb = nn.EmbeddingBag.from_pretrained(w0.clone(), freeze=False, sparse=True)
        opt = make_opt(emb.weight)
        emb.weight.grad = _sparse_rows(slots, grads, u)
        opt.step()
        want = emb.weight.detach()
    torch.testing.assert_close(rows[:, :dim], want, atol=1e-6, rtol=1e-5, msg=rule.name)


def _torch_optimizer(rule: OptimRule, update: RowUpdate) -> Callable[[nn.Parameter], object]:
    if rule == OptimRule.SGD:
        return lambda p: torch.optim.SGD([p], lr=update.lr)
    if rule == OptimRule.ADAM:
        return lambda p: torch.optim.SparseAdam(
            [p], lr=update.lr, betas=(update.beta1, update.beta2), eps=update.eps
        )
    return lambda p: torch.optim.Adagrad([p], lr=update.lr, eps=update.eps)


def bench_updates(b: Bench, w: Workload, dim: int) -> list[Row]:
    gen = torch.Generator(b.device).manual_seed(dim)
    num_rows = w.features * w.rows
    grads = 0.01 * torch.randn(w.num_unique, dim, generator=gen, device=b.device)
    out: list[Row] = []
    for rule, update, base_name in UPDATES:
        make_opt = _torch_optimizer(rule, update)
        _check_update(rule, update, make_opt, dim, 257)
        # Whole tables, left uninitialised but where a batch touches them (pages never written
        # cost nothing); the torch optimizers allocate their own full-size state.
        cache_rows = torch.empty(num_rows, dim + state_dim(rule, dim), device=b.device)
        cache_rows[w.slots] = 0.0
        steps = itertools.count(1)

        def ours(cache_rows=cache_rows, update=update, steps=steps) -> None:
            weights, state = cache_rows[:, :dim], cache_rows[:, dim:]
            apply_row_update(weights, state, w.slots, grads, update, next(steps))

        if b.on_gpu:  # Triton against the twin, one step each, on the touched rows
            touched = []
            for impl in b.implementations():
                other = cache_rows.clone()
                with backend(impl):
                    apply_row_update(other[:, :dim], other[:, dim:], w.slots, grads, update, 1)
                touched.append(other[w.slots])
                del other
            torch.testing.assert_close(*touched, atol=1e-6, rtol=1e-5, msg=rule.name)

        weight = torch.empty(num_rows, dim, device=b.device)
        weight[w.slots] = 0.0
        emb = nn.EmbeddingBag.from_pretrained(weight, freeze=False, sparse=True)
        opt = make_opt(emb.weight)
        emb.weight.grad = _sparse_rows(w.slots, grads, num_rows)
        out.append(
            b.time(
                "apply_row_update",
                rule.name.lower(),
                dim,
                w.num_unique,
                base_name,
                opt.step,
                ours,
            )
        )
        del cache_rows, ours, weight, emb, opt
    return out


# ----------------------------------------------------------------------------------------------
# CUDA only: copy bandwidth and cache lookups
# ----------------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, elems: int = COPY_ELEMS) -> float:
    """GB/s of a device-to-device copy of ``elems`` float32 values (bytes read + written)."""
    src = torch.empty(elems, device=device)
    dst = torch.empty_like(src)
    s = seconds(lambda: dst.copy_(src), device, 5)
    return 2 * elems * 4 / s / 1e9


def bench_pool_bandwidth(device: torch.device, reps: int, dim: int) -> Row:
    """``pool_forward`` (SUM, unweighted) at a size where its GB/s measures bandwidth.

    A table of ``R = UNIQUE_ROW_BYTES / (4 * dim)`` rows; ``R`` values, each its own unique id
    (``inverse`` the identity) whose slot is a permutation of the rows, so every value reads a
    distinct row and none is served twice from L2; ``R / UNIQUE_BAG`` bags of ``UNIQUE_BAG``
    values, one feature. Bytes moved: rows read + output written, ``4 * dim * (R + R / L)``;
    the copy it is set against moves as many. Timed by `Bench.time` (``do_bench``: a warm-up,
    then repeats with L2 flushed before each, CUDA events, one sync at the end), against
    ``F.embedding_bag`` over the same rows, after both of ours are checked against it.
    """
    num_rows = UNIQUE_ROW_BYTES // (4 * dim)
    batch = num_rows // UNIQUE_BAG
    moved = 4 * dim * (num_rows + batch)
    copy_gb_s = copy_bandwidth(device, moved // 8)
    gen = torch.Generator(device).manual_seed(dim)
    table = torch.randn(num_rows, dim, generator=gen, device=device)
    slots = torch.randperm(num_rows, generator=gen, device=device)
    inverse = torch.arange(num_rows, device=device)
    offsets = torch.arange(0, num_rows + 1, UNIQUE_BAG, device=device)
    cols = torch.zeros(1, dtype=torch.int64, device=device)
    out = torch.empty(batch, dim, device=device)

    def ours() -> None:
        pool_forward(
            table, dim, slots, inverse, offsets, None, PoolingMode.SUM, out, batch, cols, 0
        )

    def base() -> torch.Tensor:
        return functional.embedding_bag(slots, table, offsets, mode="sum", include_last_offset=True)

    b = Bench(device, reps, copy_gb_s)
    want = base()
    for impl in b.implementations():
        with backend(impl):
            out.fill_(float("nan"))
            ours()
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-5, msg=impl)
    del want
    return b.time(
        "pool_forward", UNIQUE_VARIANT, dim, num_rows, "F.embedding_bag", base, ours, moved
    )


def bench_lookup(b: Bench) -> Row:
    """``cache_lookup`` keys/s on a 2M-slot cache, against bench_cache_index's baseline."""
    from bench_cache_index import WAYS, lookup_sorted_keys, make_cache, sorted_keys_index

    from embcache.kernels.cache_index import cache_lookup

    num_sets, batch = LOOKUP_SETS, LOOKUP_BATCH
    keys, ids, sets, _ = make_cache(num_sets, batch, b.device, torch.Generator().manual_seed(0))
    sorted_keys, slot_of = sorted_keys_index(keys)
    with backend("torch"):
        want = cache_lookup(keys, ids, sets)
    with backend("triton"):
        assert torch.equal(cache_lookup(keys, ids, sets), want)
    assert torch.equal(lookup_sorted_keys(sorted_keys, slot_of, ids, WAYS), want)
    return b.time(
        "cache_lookup",
        f"{num_sets}x{WAYS}",
        None,
        batch,
        "sorted_keys",
        lambda: lookup_sorted_keys(sorted_keys, slot_of, ids, WAYS),
        lambda: cache_lookup(keys, ids, sets),
    )


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------

HEAD = (
    f"{'op':<17}{'variant':<16}{'dim':>4}  {'baseline':<23}"
    f"{'base ms':>9}{'twin ms':>9}{'triton ms':>10}{'twin x':>8}{'triton x':>9}"
)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_row(r: Row) -> None:
    print(
        f"{r.op:<17}{r.variant:<16}{_fmt(r.dim, 'd'):>4}  {r.baseline:<23}"
        f"{1e3 * r.baseline_s:>9.3f}{1e3 * r.twin_s:>9.3f}"
        f"{_fmt(None if r.triton_s is None else 1e3 * r.triton_s, '.3f'):>10}"
        f"{r.twin_x:>8.2f}{_fmt(r.triton_x, '.2f'):>9}",
        flush=True,
    )


def print_rates(rows: list[Row]) -> None:
    """CUDA: keys/s of the id ops and lookups; pool_forward's bandwidth against the copy, the
    large unique-row calls as the figure, the workload-size calls labelled latency-bound."""
    print("\nrates (CUDA); targets from docs/design.md")
    for r in rows:
        if r.op in ("dedup", "fuse_ids", "cache_lookup"):
            target = "  (target >= 2.5e9)" if r.op == "cache_lookup" else ""
            print(
                f"  {r.op:<14} triton {r.triton_items_per_s:.3g} keys/s, twin "
                f"{r.twin_items_per_s:.3g} keys/s{target}"
            )
            print(f"summary: {r.op} triton_keys_per_s={r.triton_items_per_s:.3g}")
    pools = [r for r in rows if r.op == "pool_forward"]
    large = [r for r in pools if r.variant == UNIQUE_VARIANT]
    small = [r for r in pools if r.variant != UNIQUE_VARIANT]
    if large:
        print(
            "  pool_forward bandwidth: one call reading every row of a table once, against a "
            "copy moving as many bytes (index reads not counted)"
        )
    for r in large:
        line = (
            f"pool_forward bandwidth D={r.dim} unique rows {r.bytes_moved / 1e6:.0f} MB/call: "
            f"{r.triton_gb_s:.0f} GB/s = {r.triton_frac_copy_bw:.2f} of copy "
            f"{r.copy_gb_s:.0f} GB/s"
        )
        print(f"  {line} (target >= 0.80)")
        print(f"summary: {line}")
    if small:
        most_mb = max(r.bytes_moved or 0 for r in small) / 1e6
        print(
            f"  pool_forward at the workload's size: small calls ({small[0].items} values, "
            f"<= {most_mb:.1f} MB, rows repeated and served from L2): latency-bound, not the "
            "bandwidth target"
        )
        for r in small:
            print(
                f"    {r.variant:<14} D={r.dim:<4} {r.triton_gb_s:7.1f} GB/s = "
                f"{r.triton_frac_copy_bw:.2f} of copy {r.copy_gb_s:.0f} GB/s"
            )
        fracs = [r.triton_frac_copy_bw or 0.0 for r in small]
        print(
            f"summary: pool_forward small calls ({small[0].items} values, latency-bound, not "
            f"the target) frac_copy_bw {min(fracs):.2f}-{max(fracs):.2f}"
        )


def print_gather_bandwidth(rows: list[Row]) -> None:
    """The unpooled gather's GB/s (float32 bytes moved / time): baseline, twin, Triton."""
    sel = [r for r in rows if r.op in GATHER_OPS]
    if not sel:
        return
    print("\nunpooled gather, GB/s = float32 bytes moved / time, same device and inputs")
    print(f"  {'op':<16}{'variant':<12}{'dim':>4}  {'baseline':<20}{'base':>8}{'twin':>8}"
          f"{'triton':>8}")  # fmt: skip
    for r in sel:
        print(
            f"  {r.op:<16}{r.variant:<12}{r.dim:>4}  {r.baseline:<20}{r.baseline_gb_s:>8.2f}"
            f"{r.twin_gb_s:>8.2f}{_fmt(r.triton_gb_s, '.2f'):>8}"
        )
    widest = max(r.dim or 0 for r in sel)
    fwd, bwd = (
        next(r for r in sel if r.op == op and r.dim == widest and "grouped" not in r.variant)
        for op in GATHER_OPS
    )
    ours = "triton" if fwd.triton_gb_s is not None else "twin"

    def gb_s(r: Row) -> float:
        return r.triton_gb_s if r.triton_gb_s is not None else r.twin_gb_s or 0.0

    print(
        f"summary: unpooled gather D={widest} {ours} GB/s fwd={gb_s(fwd):.1f} "
        f"(index_select {fwd.baseline_gb_s:.1f}) bwd={gb_s(bwd):.1f} "
        f"(index_add_ {bwd.baseline_gb_s:.1f})"
    )


def _bar_label(r: Row) -> str:
    what = r.op if r.dim is None else f"{r.variant} D={r.dim}"
    if r.op in ("pool_forward", "pool_backward"):
        return what
    return f"{what}\nvs {r.baseline.removeprefix('torch.optim.')}"


def write_plot(rows: list[Row], path: Path, title: str) -> None:
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    panels = [
        ("ids", ("fuse_ids", "dedup", "cache_lookup")),
        ("pool_forward", ("pool_forward",)),
        ("pool_backward", ("pool_backward",)),
        ("unpooled gather", GATHER_OPS),
        ("apply_row_update", ("apply_row_update",)),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(24, 5.5), width_ratios=[1, 3, 3, 2, 3])
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, (name, ops) in zip(axes, panels, strict=True):
        sel = [r for r in rows if r.op in ops]
        x = list(range(len(sel)))
        series = [("torch twin", [r.twin_x for r in sel])]
        if any(r.triton_x is not None for r in sel):
            series.append(("triton", [r.triton_x or float("nan") for r in sel]))
        width = 0.8 / len(series)
        for k, (label, ratios) in enumerate(series):
            pos = [i + (k - (len(series) - 1) / 2) * width for i in x]
            bars = ax.bar(pos, ratios, width, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="baseline")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="y", which="both", labelsize=7)
        ax.set_xticks(x, [_bar_label(r) for r in sel], rotation=90, fontsize=7)
        baselines = sorted({r.baseline for r in sel})
        ax.set_title(
            f"{name} (baseline: {baselines[0] if len(baselines) == 1 else 'under each bar'})",
            fontsize=9,
        )
        ax.set_ylabel("baseline time / our time (> 1: ours faster)", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class Sizes:
    """What each option left out defaults to."""

    batch: int
    rows: int  # per table
    dims: tuple[int, ...]
    reps: int


FULL = Sizes(2048, 100_000, (16, 64, 128), 7)
QUICK = Sizes(512, 20_000, (16, 128), 3)  # on a GPU (the GPU check's size)
# --quick without a GPU: a smoke test of the CPU path (QUICK took 1.4 GB there), too small for
# conclusions.
QUICK_CPU = Sizes(256, 5_000, (16, 64), 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="B=512, 20k rows, dims 16 128 on a GPU; on the CPU B=256, 5k rows, dims 16 64 "
        "(a smoke test)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1)")
    parser.add_argument("--batch", type=int, default=None, help="samples B (default 2048)")
    parser.add_argument("--features", type=int, default=26)
    parser.add_argument("--rows", type=int, default=None, help="rows per table (default 100k)")
    parser.add_argument("--pooling", type=int, default=4, help="mean bag length")
    parser.add_argument("--dims", type=int, nargs="+", default=None)
    parser.add_argument("--reps", type=int, default=None, help="timed calls per median (CPU)")
    add_output_options(parser, "kernels.csv")
    args = parse_args(parser, argv)

    set_threads(args.threads)
    device = pick_device(args.device)
    # Our sparse gradients are built coalesced by construction; skip torch's re-validation.
    torch.sparse.check_sparse_tensor_invariants.disable()
    sizes = (QUICK if device.type == "cuda" else QUICK_CPU) if args.quick else FULL
    batch = args.batch or sizes.batch
    rows = args.rows or sizes.rows
    dims = args.dims or list(sizes.dims)
    reps = args.reps or sizes.reps
    t0 = time.perf_counter()
    header = run_header(device)
    print(header)
    note = quick_note(args.quick and device.type != "cuda")
    w = make_workload(batch, args.features, rows, args.pooling, device)
    print(
        f"# workload: B={batch} F={args.features} rows/table={rows} pooling~{args.pooling} "
        f"nnz={w.nnz} unique={w.num_unique} dims={dims}; x = baseline time / our time"
    )
    if device.type != "cuda":
        print("# triton: not timed on CPU (the interpreter is a correctness path, not a speed one)")
    copy_gb_s = copy_bandwidth(device) if device.type == "cuda" else None
    if copy_gb_s is not None:
        print(f"# device-to-device copy: {copy_gb_s:.0f} GB/s")
    b = Bench(device, reps, copy_gb_s)
    print(HEAD)
    print("-" * len(HEAD))
    results = bench_ids(b, w)
    if device.type == "cuda":
        results.append(bench_lookup(b))
    for dim in dims:
        results += bench_pooling(b, w, dim)
    if device.type == "cuda":
        for dim in UNIQUE_DIMS:
            results.append(bench_pool_bandwidth(device, reps, dim))
            torch.cuda.empty_cache()  # its tensors, freed with its frame, back to the device
    else:
        print(
            f"# pool_forward bandwidth ({UNIQUE_ROW_BYTES >> 20} MiB of unique rows a call): "
            f"CUDA only, not run on {device.type}"
        )
    for dim in dims:
        results += bench_gather(b, w, dim)
    for dim in dims:
        results += bench_updates(b, w, dim)
    if device.type == "cuda":
        print_rates(results)
    print_gather_bandwidth(results)
    slow = min(results, key=lambda r: r.twin_x)
    print(
        f"summary: slowest twin ratio {slow.op} {slow.variant} D={_fmt(slow.dim, 'd')} "
        f"x={slow.twin_x:.2f}"
    )
    write_csv(results, args.out, EXTRA)
    title = f"{header[2:]}\n{w.nnz} values, B={batch}" + (f"; {note}" if note else "")
    write_plot(results, args.out.with_suffix(".png"), title)
    elapsed = time.perf_counter() - t0
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
