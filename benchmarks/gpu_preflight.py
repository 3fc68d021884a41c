"""Does every Triton kernel give its torch twin's answer on this GPU, at a realistic size?

The first step of `gpu_check.sh`, so that a broken kernel is named within a minute instead of
surfacing as a failed training test minutes later. Each kernel runs once on the device (cold
compile included) on one batch of B=2048 samples and 26 features, Zipf(1.05) ids with
duplicates; its torch twin runs on the CPU copy of the same inputs; the device is synchronised
after each kernel. One line per check; the first mismatch (or error) names the kernel and ends
the run with exit status 1.

    python benchmarks/gpu_preflight.py                       # on CUDA
    python benchmarks/gpu_preflight.py --device cpu --tiny   # dry run: Triton's interpreter

The op families bound through `embcache.ops.registry` (ids, plan, rows, pooling, gather, update)
have their operations listed there: each must have its check, here (`CHECKED`) or in its
family's folder (``ops/<family>/preflight.py``'s ``CHECKS``, run after the checks here), or be
one no Triton kernel runs (that file's ``ON_HOST``), else the preflight fails before it starts,
naming the operation.

Outputs written by a kernel are compared whole, and freshly allocated ones are filled with NaN
first where the op takes them (pooling), so an element a kernel never writes fails the check.
Ids, sets, ways and slots must match exactly; float results to float32 rounding of a different
summation order.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


class MismatchError(AssertionError):
    """A kernel's result differs from its twin's."""


# The registered op families' operations (`embcache.ops.registry.operations`): the check that
# runs each one's Triton implementation, or why none does.
CHECKED = {
    "ids.fuse_ids": "fuse_ids",
    "ids.fuse_ids_deferred": "fuse_ids",  # what fuse_ids runs, its checks read by it
    "ids.unfuse_ids": "unfuse_ids",
    "ids.dedup": "dedup",
    "ids.dedup_grouped": "dedup_grouped (torch ops)",
    "ids.sort_and_mark": "dedup_joint (caches in one sort)",
    "ids.scatter_joint": "dedup_joint (caches in one sort)",
    "ids.dedup_together": "dedup_together (one read)",
    "plan.set_index": "set_index",
    "plan.cache_lookup": "cache_lookup",
    "plan.cache_slots": "cache_slots",
    "plan.assign_ways": "assign_ways",
    "plan.add_at_held": "add_at_held",
    "plan.lookup_counts": "lookup_counts",
    "plan.salted_mix64": "salted_mix64",
    "plan.miss_keys": "miss_keys (padded LRU order)",
    "plan.assign_misses": "assign_misses (device plan)",
    "plan.reserve_placed": "reserve_placed (device plan)",
    "plan.probe_group": "group plan (probe, assign, reserve)",
    "plan.assign_group": "group plan (probe, assign, reserve)",
    "plan.reserve_group": "group plan (probe, assign, reserve)",
    "pooling.pool_forward": "pool_forward SUM",
    "pooling.pool_backward": "pool_backward SUM",
    "gather.gather_rows": "gather_rows",
    "gather.gather_backward": "gather_backward",
    "rows.lock_floors": "slot_locks (floors, unlock)",
    "rows.unlock": "slot_locks (floors, unlock)",
    "rows.direct_slots": "direct_slots",
    "update.apply_row_update": "apply_row_update SGD",  # and each other rule
    "update.aggregate_grads": "aggregate_grads",
    "update.stochastic_round": "stochastic_round bf16",
}
# Operations no Triton kernel runs, and the checks of a family's own kernels, are declared in
# the family's folder (``ops/<family>/preflight.py``: `embcache.ops.registry.family_preflight`).


def unchecked_operations() -> list[str]:
    """The registered families' operations with no check and no reason, here (`CHECKED`) or
    in their family's folder (`family_preflight`): a new operation the preflight does not run
    yet."""
    from embcache.ops.registry import families, family_preflight, operations

    unchecked = []
    for family in families():
        checks, on_host = family_preflight(family)
        unchecked += [
            f"{family}.{op}"
            for op in operations(family)
            if f"{family}.{op}" not in CHECKED and op not in checks and op not in on_host
        ]
    return unchecked


def run_family_checks(p: Preflight) -> None:
    """The checks each family keeps in its folder (`family_preflight`), each function once
    (named by the operations it checks)."""
    from embcache.ops.registry import families, family_preflight

    for family in families():
        by_check: dict[Callable[[torch.device, bool], float], list[str]] = {}
        for op, check in family_preflight(family)[0].items():
            by_check.setdefault(check, []).append(op)
        for check, ops in by_check.items():
            name = f"{family}.{', '.join(ops)}"
            p.check(name, lambda check=check: check(p.device, p.tiny))


def check_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    """Exact equality (ids, sets, ways); returns 0.0 or raises `MismatchError`."""
    got = got.cpu()
    if got.shape != want.shape:
        raise MismatchError(f"{name}: shape {tuple(got.shape)}, twin {tuple(want.shape)}")
    diff = got != want
    if bool(diff.any()):
        i = int(diff.reshape(-1).nonzero()[0])
        raise MismatchError(
            f"{name}: {int(diff.sum())} of {diff.numel()} elements differ; first at flat {i}: "
            f"{got.reshape(-1)[i].item()} vs twin {want.reshape(-1)[i].item()}"
        )
    return 0.0


def check_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> float:
    """``|got - want| <= rtol * (|want| + max|want|)`` elementwise, NaN only where the twin has
    NaN; returns the largest absolute difference or raises `MismatchError`. (float32 math: the
    tolerance is far above its rounding, and the optimizer rows are tens of millions of
    elements.)"""
    got = got.cpu()
    if got.shape != want.shape:
        raise MismatchError(f"{name}: shape {tuple(got.shape)}, twin {tuple(want.shape)}")
    nan_want = want.isnan()
    nan_differs = got.isnan() != nan_want
    if bool(nan_differs.any()):
        i = int(nan_differs.reshape(-1).nonzero()[0])
        raise MismatchError(
            f"{name}: NaN at different places (a kernel skipped or corrupted an element); first "
            f"at flat {i}: {got.reshape(-1)[i].item()} vs twin {want.reshape(-1)[i].item()}"
        )
    magnitude = want.abs().nan_to_num_(0.0)
    scale = float(magnitude.max()) if want.numel() else 0.0
    err = (got - want).abs_().nan_to_num_(0.0)
    bad = err > magnitude.add_(scale).mul_(rtol)
    if bool(bad.any()):
        i = int(err.reshape(-1).argmax())
        raise MismatchError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements differ; worst at flat {i}: "
            f"{got.reshape(-1)[i].item()!r} vs twin {want.reshape(-1)[i].item()!r}"
        )
    return float(err.max()) if err.numel() else 0.0


@dataclass
class Batch:
    """One batch of F features over B samples, ids fused with their table, on the CPU."""

    batch_size: int
    num_features: int
    rows: int
    values: torch.Tensor  # int64 [nnz], feature-major
    lengths: torch.Tensor  # int64 [F * B]
    feature_lengths: torch.Tensor  # int64 [F]
    weights: torch.Tensor  # float32 [nnz]
    fusion_k: int = 32


def make_batch(batch_size: int, num_features: int, rows: int, seed: int = 0) -> Batch:
    """Bags of 0..8 ids (mean 4, some empty) drawn Zipf(1.05) per feature: hot ids repeat."""
    from _common import ZipfIds

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 9, (num_features * batch_size,), generator=gen)
    feature_lengths = lengths.reshape(num_features, batch_size).sum(1)
    values = torch.cat(
        [
            ZipfIds(rows, 1.05, gen).sample(int(n), gen)
            for n in feature_lengths.tolist()  # one table per feature
        ]
    )
    weights = torch.rand(values.numel(), generator=gen) + 0.5
    return Batch(batch_size, num_features, rows, values, lengths, feature_lengths, weights)


class Preflight:
    """Runs the checks in order, one line each; `check` raises on the first failure."""

    def __init__(self, device: torch.device, batch: Batch, dim: int, tiny: bool = False) -> None:
        self.device = device
        self.batch = batch
        self.dim = dim
        self.tiny = tiny  # the dry run's sizes (a family's own checks take it)
        self.gen = torch.Generator().manual_seed(1)
        self.count = 0
        self.names: list[str] = []

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def dev(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(self.device)

    def check(self, name: str, run: Callable[[], float]) -> None:
        """Run one check: ``run`` launches the kernel, syncs, compares, returns max |diff|."""
        t0 = time.perf_counter()
        try:
            err = run()
        except MismatchError as e:
            print(f"{name:<40} MISMATCH  {e}", flush=True)
            raise
        except Exception as e:
            print(f"{name:<40} ERROR     {type(e).__name__}: {e}", flush=True)
            raise MismatchError(f"{name}: {type(e).__name__}: {e}") from e
        self.count += 1
        self.names.append(name)
        print(f"{name:<40} ok  {time.perf_counter() - t0:6.2f} s  max|diff| {err:.2e}", flush=True)

    def triton(self, fn: Callable, *args, **kwargs):
        """``fn`` on the device with the Triton backend, synchronised."""
        os.environ["EMBCACHE_BACKEND"] = "triton"
        out = fn(*[self.dev(a) if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        self.sync()
        return out

    @staticmethod
    def twin(fn: Callable, *args, **kwargs):
        """``fn`` on the CPU with the torch twins."""
        os.environ["EMBCACHE_BACKEND"] = "torch"
        return fn(*args, **kwargs)


def run_checks(p: Preflight) -> None:
    from embcache.kernels.cache_index import (
        add_at_held,
        assign_ways,
        cache_lookup,
        cache_slots,
        lookup_counts,
        miss_keys,
        salted_mix64,
        set_index,
    )
    from embcache.kernels.gather import gather_backward, gather_rows
    from embcache.kernels.ids import dedup, dedup_grouped, fuse_ids, unfuse_ids
    from embcache.kernels.optim import (
        OptimRule,
        RowUpdate,
        aggregate_grads,
        apply_row_update,
        state_dim,
    )
    from embcache.kernels.pooling import PoolingMode, pool_backward, pool_forward
    from embcache.kernels.rounding import rounding_key, stochastic_round
    from embcache.ops.plan.spec import assign_ways_ref
    from embcache.ops.plan.triton import assign_misses_triton

    b, dim, gen = p.batch, p.dim, p.gen
    names = [f"f{i}" for i in range(b.num_features)]
    table_idx = torch.arange(b.num_features)
    num_embeddings = torch.full((b.num_features,), b.rows)
    fuse_args = (b.values, b.feature_lengths, table_idx, num_embeddings, b.fusion_k, names, names)
    fused = p.twin(fuse_ids, *fuse_args)
    p.check("fuse_ids", lambda: check_equal("fuse_ids", p.triton(fuse_ids, *fuse_args), fused))

    def unfuse() -> float:
        got = p.triton(unfuse_ids, fused, b.fusion_k)
        want = p.twin(unfuse_ids, fused, b.fusion_k)
        return max(
            check_equal(f"unfuse_ids[{i}]", g, w)
            for i, (g, w) in enumerate(zip(got, want, strict=True))
        )

    p.check("unfuse_ids", unfuse)
    unique_ids, inverse, counts = p.twin(dedup, fused)

    def dedup_check() -> float:
        got = p.triton(dedup, fused)
        parts = zip(
            ("unique_ids", "inverse", "counts"), got, (unique_ids, inverse, counts), strict=True
        )
        return max(check_equal(f"dedup {n}", g, w) for n, g, w in parts)

    p.check("dedup", dedup_check)

    def grouped_check() -> float:  # torch ops on every device: the device's sort vs the CPU's
        got, want = p.triton(dedup_grouped, fused), p.twin(dedup_grouped, fused)
        parts = zip(("unique_ids", "inverse", "order", "segments"), got, want, strict=True)
        return max(check_equal(f"dedup_grouped {n}", g, w) for n, g, w in parts)

    p.check("dedup_grouped (torch ops)", grouped_check)

    # The forward's dedup of several caches at once, one read (`IdsOps.dedup_together`): the
    # Triton route's unique ids, inverse, table bounds and the extra values read with them
    # against the torch route's, and its grouping (a stable sort) against `dedup_grouped`'s.
    from embcache.kernels.ids import dedup_together

    halves = [fused[: fused.numel() // 2], fused[fused.numel() // 2 :]]
    table_starts = [torch.tensor([0, 1 << b.fusion_k, 2 << b.fusion_k]), None]
    extra = torch.tensor([0, 3, 0, 1])

    def together_check() -> float:
        on_device = [p.dev(h) for h in halves], [p.dev(t) for t in table_starts]
        got, got_extra = p.triton(dedup_together, *on_device, extra)
        want, want_extra = p.twin(dedup_together, halves, [*table_starts], extra)
        if got_extra != want_extra or [g.bounds for g in got] != [w.bounds for w in want]:
            raise MismatchError(
                f"dedup_together: bounds {[g.bounds for g in got]} and extras {got_extra}, "
                f"twin {[w.bounds for w in want]} and {want_extra}"
            )
        for i, (g, w, ids) in enumerate(zip(got, want, halves, strict=True)):
            check_equal(f"dedup_together[{i}] unique", g.unique, w.unique)
            check_equal(f"dedup_together[{i}] inverse", g.inverse, w.inverse)
            grouped = p.twin(dedup_grouped, ids)
            check_equal(f"dedup_together[{i}] order", g.order, grouped[2])
            check_equal(f"dedup_together[{i}] segment_starts", g.segment_starts, grouped[3])
        return 0.0

    p.check("dedup_together (one read)", together_check)

    # Several caches deduplicated in one sort (`engine.joint`): the batch's features split
    # into two groups (caches), each taking its features in another order than the batch's;
    # the Triton route (`sort_and_mark`, one read, `scatter_joint`) against the torch spec.
    from embcache.ops.ids.shared import joint_plan as plan
    from embcache.ops.ids.spec import scatter_joint_ref
    from embcache.ops.ids.triton import scatter_joint, sort_and_mark

    per_key = b.feature_lengths.tolist()
    group_keys = [list(range(0, b.num_features, 2))[::-1], list(range(1, b.num_features, 2))]
    tag_shift = b.fusion_k + b.num_features.bit_length()
    group_of = torch.tensor([k % 2 for k in range(b.num_features)])
    tagged = fused | (group_of.repeat_interleave(b.feature_lengths) << tag_shift)
    group_start = torch.tensor([1 << tag_shift])

    def joint_check() -> float:
        os.environ["EMBCACHE_BACKEND"] = "triton"
        marked = sort_and_mark(p.dev(tagged), p.dev(group_start), None)
        read = marked.read.tolist()
        where = plan(per_key, group_keys, read[1:], read[0], b.batch_size)
        ends = p.dev(torch.cumsum(b.lengths, 0))
        got = scatter_joint(marked.ordered, marked.order, marked.is_start, marked.seen, where,
                            tag_shift, p.dev(b.weights), ends)  # fmt: skip
        p.sync()
        want = scatter_joint_ref(tagged, where, tag_shift, b.weights, b.lengths)
        for g in range(len(group_keys)):
            mine, spec = got.group(where, g), want.group(where, g)
            for name in ("unique", "inverse", "order", "starts", "weights", "offsets"):
                x, y = getattr(mine, name), getattr(spec, name)
                check_equal(f"dedup_joint group {g} {name}", x, y)
        return 0.0

    p.check("dedup_joint (caches in one sort)", joint_check)

    # Pooling: the batch's unique ids sit in shuffled cache slots of rows [weights | state].
    u = unique_ids.numel()
    cache_rows = torch.randn(u + 7, dim + 2, generator=gen)
    slots = torch.randperm(u + 7, generator=gen)[:u]
    offsets = torch.nn.functional.pad(torch.cumsum(b.lengths, 0), (1, 0))
    col_offsets = torch.arange(b.num_features) * dim
    grad_out = torch.randn(b.batch_size, b.num_features * dim, generator=gen)
    for mode in (PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.MAX):
        for weights in (None, b.weights) if mode == PoolingMode.SUM else (b.weights,):
            tag = f"{mode.name}{' weighted' if weights is not None else ''}"
            results = {}

            def forward(mode=mode, weights=weights, tag=tag, results=results) -> float:
                args = (cache_rows, dim, slots, inverse, offsets, weights, mode)
                # NaN-filled outputs; the device's is moved there first, so it is written in place.
                got = torch.full_like(grad_out, float("nan")).to(p.device)
                want = torch.full_like(grad_out, float("nan"))
                got_argmax = p.triton(pool_forward, *args, got, b.batch_size, col_offsets)
                want_argmax = p.twin(pool_forward, *args, want, b.batch_size, col_offsets)
                results["got"], results["want"] = (got, got_argmax), (want, want_argmax)
                return check_close(f"pool_forward {tag}", got, want)

            def backward(mode=mode, weights=weights, tag=tag, results=results) -> float:
                args = (dim, inverse, u, offsets, weights, mode, b.batch_size, col_offsets)
                got = p.triton(pool_backward, grad_out, *args, results["got"][1])
                want = p.twin(pool_backward, grad_out, *args, results["want"][1])
                return check_close(f"pool_backward {tag}", got, want, rtol=1e-4)

            def grouped(mode=mode, weights=weights, tag=tag, results=results) -> float:
                args = (dim, inverse, u, offsets, weights, mode, b.batch_size, col_offsets)
                grouping = p.twin(dedup_grouped, fused)[2:]  # the forward's dedup gives it
                grouping = tuple(p.dev(t) for t in grouping)
                got = p.triton(pool_backward, grad_out, *args, results["got"][1], grouping)
                want = p.twin(pool_backward, grad_out, *args, results["want"][1])
                return check_close(f"pool_backward {tag} grouped", got, want, rtol=1e-4)

            p.check(f"pool_forward {tag}", forward)
            p.check(f"pool_backward {tag}", backward)
            p.check(f"pool_backward {tag} grouped", grouped)

    # Unpooled gather (sequence embeddings): each value's row out of the same slots (one id not
    # admitted: zeros), from float32 (a strided view), float16 and bfloat16 rows; its backward
    # with and without the dedup's grouping.
    gather_slots = slots.clone()
    gather_slots[0] = -1

    def gather_rows_check() -> float:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            rows = cache_rows.to(dtype)[:, :dim]
            got = p.triton(gather_rows, rows, dim, gather_slots, inverse)
            check_equal(
                f"gather_rows {dtype}", got, p.twin(gather_rows, rows, dim, gather_slots, inverse)
            )
        return 0.0

    def gather_backward_check() -> float:
        value_rows = torch.randn(inverse.numel(), dim, generator=gen)
        grouping = p.twin(dedup_grouped, fused)[2:]
        want = p.twin(gather_backward, value_rows, inverse, u)
        got = p.triton(gather_backward, value_rows, inverse, u)
        err = check_close("gather_backward", got, want, rtol=1e-4)
        got = p.triton(gather_backward, value_rows, inverse, u, tuple(p.dev(t) for t in grouping))
        return max(err, check_close("gather_backward grouped", got, want, rtol=1e-4))

    p.check("gather_rows", gather_rows_check)
    p.check("gather_backward", gather_backward_check)

    # Cache index: 8 ways a set, about half the batch's ids resident.
    ways = 8
    num_sets = max(u // ways, 1)
    sets = p.twin(set_index, unique_ids, num_sets)
    p.check(
        "set_index",
        lambda: check_equal("set_index", p.triton(set_index, unique_ids, num_sets), sets),
    )
    shuffled = p.twin(salted_mix64, unique_ids, 12345)
    p.check(
        "salted_mix64",
        lambda: check_equal("salted_mix64", p.triton(salted_mix64, unique_ids, 12345), shuffled),
    )
    padded = torch.randint(-1, u, (u,), generator=gen)  # -1: a padded plan's padding
    keyed = p.twin(miss_keys, unique_ids, padded, 12345, num_sets)

    def miss_keys_check() -> float:
        got = p.triton(miss_keys, unique_ids, padded, 12345, num_sets)
        parts = zip(("ids", "sets", "keys"), got, keyed, strict=True)
        return max(check_equal(f"miss_keys {k}", g, w) for k, g, w in parts)

    p.check("miss_keys (padded LRU order)", miss_keys_check)
    keys = torch.full((num_sets, ways), -1, dtype=torch.int64)
    resident = torch.rand(u, generator=gen) < 0.5
    by_set = torch.argsort(sets[resident], stable=True)
    r_ids, r_sets = unique_ids[resident][by_set], sets[resident][by_set]
    starts = torch.searchsorted(r_sets, r_sets, right=False)
    rank = torch.arange(r_ids.numel()) - starts
    fits = rank < ways
    keys[r_sets[fits], rank[fits]] = r_ids[fits]
    found = p.twin(cache_lookup, keys, unique_ids, sets)
    p.check(
        "cache_lookup",
        lambda: check_equal("cache_lookup", p.triton(cache_lookup, keys, unique_ids, sets), found),
    )
    slots_found = p.twin(cache_slots, keys, unique_ids, sets)
    p.check(
        "cache_slots",
        lambda: check_equal(
            "cache_slots", p.triton(cache_slots, keys, unique_ids, sets), slots_found
        ),
    )
    admitted = torch.rand(u, generator=gen) < 0.9

    def lookup_counts_check() -> float:
        got_missing, got = p.triton(lookup_counts, slots_found, num_sets * ways // 2, admitted)
        want_missing, want = p.twin(lookup_counts, slots_found, num_sets * ways // 2, admitted)
        check_equal("lookup_counts", torch.stack(got), torch.stack(want))
        return check_equal("lookup_counts missing", got_missing, want_missing)

    p.check("lookup_counts", lookup_counts_check)

    def add_at_held_check() -> float:
        got = torch.zeros(num_sets * ways, dtype=torch.int32).to(p.device)
        want = torch.zeros(num_sets * ways, dtype=torch.int32)
        p.triton(add_at_held, got, slots_found, 2)
        p.twin(add_at_held, want, slots_found, 2)
        return check_equal("add_at_held", got, want)

    p.check("add_at_held", add_at_held_check)

    # The step's slot locks, every cache at once: two caches' floors, then their unlock.
    from embcache.ops.registry import implementations
    from embcache.ops.rows import SlotTable

    rows_ops = implementations("rows")

    def slot_locks_check() -> float:
        parts = []
        for n_slots, n in ((num_sets * ways, u), (97, 0)):
            taken = torch.randperm(n_slots, generator=gen)[:n]
            held = torch.randint(1, 3, (n_slots,), generator=gen, dtype=torch.int32)
            parts.append((taken, held, torch.rand(n_slots, generator=gen) < 0.5))
        mine = SlotTable.of([tuple(t.to(p.device) for t in part) for part in parts])
        spec = SlotTable.of([tuple(t.clone() for t in part) for part in parts])
        assert mine is not None and spec is not None
        got = rows_ops["triton"].lock_floors(mine)
        check_equal("lock_floors", got, rows_ops["spec"].lock_floors(spec))
        rows_ops["triton"].unlock(mine, True)
        rows_ops["spec"].unlock(spec, True)
        p.sync()
        check_equal("unlock locks", torch.cat(mine.locks), torch.cat(spec.locks))
        return check_equal("unlock dirty", torch.cat(mine.dirty), torch.cat(spec.dirty))

    p.check("slot_locks (floors, unlock)", slot_locks_check)

    def direct_slots_check() -> float:
        row_offset = torch.tensor([0, 500, 1700])
        keys = torch.unique(
            (torch.randint(0, 3, (u,), generator=gen) << 12) | torch.randint(0, 500, (u,))
        )
        got_locks = torch.zeros(2300, dtype=torch.int32).to(p.device)
        want_locks = torch.zeros(2300, dtype=torch.int32)
        got = p.triton(rows_ops["triton"].direct_slots, row_offset, keys, 12, got_locks)
        want = rows_ops["spec"].direct_slots(row_offset, keys, 12, want_locks)
        check_equal("direct_slots locks", got_locks, want_locks)
        return check_equal("direct_slots", got, want)

    p.check("direct_slots", direct_slots_check)
    scores = torch.randint(-1, 50, (num_sets, ways), generator=gen)  # ties: broken by way
    blocked = torch.rand(num_sets, ways, generator=gen) < 0.2
    miss_sets = torch.sort(sets[found < 0]).values
    victims = p.twin(assign_ways, scores, blocked, miss_sets)
    p.check(
        "assign_ways",
        lambda: check_equal(
            "assign_ways", p.triton(assign_ways, scores, blocked, miss_sets), victims
        ),
    )

    # The device plan's ways, places and counts in one kernel, against the torch ops of
    # `SetPlanner._choose_ways` around the twin: each slot's score, lock, last batch, key, dirty.
    locks = blocked.reshape(-1).to(torch.int32)
    batch_of = torch.where(torch.rand(num_sets * ways, generator=gen) < 0.1, 9, 2)
    slot_keys = torch.where(scores.reshape(-1) < 0, -1, 7)
    dirty = torch.rand(num_sets * ways, generator=gen) < 0.5

    def assign_misses_check() -> float:
        got_place, got_counts = p.triton(
            assign_misses_triton, miss_sets, scores.reshape(-1), locks, batch_of, slot_keys,
            dirty, ways, 9,
        )  # fmt: skip
        first = torch.ones_like(miss_sets, dtype=torch.bool)
        first[1:] = miss_sets[1:] != miss_sets[:-1]
        touched, owner = miss_sets[first], torch.cumsum(first, 0) - 1
        guard = (locks.view(num_sets, ways) > 0) | (batch_of.view(num_sets, ways) == 9)
        way = assign_ways_ref(scores[touched], guard[touched], owner)
        want = torch.where(way >= 0, touched[owner] * ways + way, way)
        held = (want >= 0) & (slot_keys[want.clamp(min=0)] >= 0)
        counts = [(want >= 0).sum(), held.sum(), (held & dirty[want.clamp(min=0)]).sum()]
        check_equal("assign_misses counts", got_counts, torch.stack(counts))
        return check_equal("assign_misses place", got_place, want)

    p.check("assign_misses (device plan)", assign_misses_check)

    # The placed misses reserved in one kernel: slots, keys, dirty flags, locks and the
    # rollback (old keys, scores, flags), against the torch ops.
    def reserve_placed_check() -> float:
        from embcache.ops.registry import implementations

        plan_impls = implementations("plan")
        n_slots, m = num_sets * ways, min(u, num_sets * ways // 2)
        place = torch.randperm(n_slots, generator=gen)[:m]
        order_pos = torch.randperm(u, generator=gen)[:m]
        state = (
            torch.randint(0, 1 << 20, (u,), generator=gen),  # ids
            torch.full((u,), -1),  # slots
            order_pos,
            place,
            torch.where(torch.rand(n_slots, generator=gen) < 0.7, 5, -1),  # keys
            torch.rand(n_slots, generator=gen) < 0.5,  # dirty
            torch.randint(0, 99, (n_slots,), generator=gen),  # scores
            torch.randint(0, 3, (n_slots,), generator=gen, dtype=torch.int32),  # locks
        )
        mine = [t.to(p.device) for t in state]
        spec = [t.clone() for t in state]
        got = p.triton(plan_impls["triton"].reserve_placed, *mine)
        want = plan_impls["spec"].reserve_placed(*spec)
        for name, g, w in zip(("slots", "keys", "dirty", "scores", "locks"),
                              (mine[1], *mine[4:]), (spec[1], *spec[4:]), strict=True):  # fmt: skip
            check_equal(f"reserve_placed {name}", g, w)
        return max(check_equal("reserve_placed out", g, w) for g, w in zip(got, want, strict=True))

    p.check("reserve_placed (device plan)", reserve_placed_check)

    # Several caches planned in one launch per step (`cache.group_plan`): the lookup, counts and
    # hit locks; the misses' places; their reservation and the touch, against the torch ops
    # cache by cache, every output and every cache's index after.
    def group_plan_check() -> float:
        from embcache.ops.plan import MISSES, PLACED, PlanCache, PlanTable
        from embcache.ops.plan.spec import set_index_ref
        from embcache.ops.registry import implementations

        plan_impls = implementations("plan")
        parts = []
        for c, (sets, w, n) in enumerate([(num_sets, ways, u), (3, 4, 40), (16, 2, 0)]):
            keys = torch.full((sets * w + 2 + u,), -1, dtype=torch.int64)  # u scratch rows free
            pool = torch.randperm(4 * sets * w, generator=gen) + (c << 40)
            hashed = set_index_ref(pool, sets).tolist()
            for i, (key, s) in enumerate(zip(pool.tolist(), hashed, strict=True)):
                if keys[s * w + i % w] < 0 and i % 3:
                    keys[s * w + i % w] = key
            held = keys[keys >= 0][: n // 2]
            ids = torch.cat([held, torch.arange(n - held.numel()) + (c << 40) + (1 << 39)])
            ids = ids[torch.randperm(n, generator=gen)]
            keys[sets * w + 1] = ids[-1] if c == 1 else -1
            parts.append(PlanCache(
                ids, keys,
                torch.randint(-1, 50, (sets * w,), generator=gen),
                (torch.rand(keys.numel(), generator=gen) < 0.2).to(torch.int32),
                torch.where(torch.rand(keys.numel(), generator=gen) < 0.1, 9, 2),
                torch.rand(keys.numel(), generator=gen) < 0.5, sets, w, 9, 40 + c, sets * w,
                # scratch row 1 holds an id of the batch, found there before the plan
                torch.where(ids == keys[sets * w + 1], sets * w + 1, -1) if c == 1 else None,
            ))  # fmt: skip
        mine = [PlanCache(*[p.dev(v) if isinstance(v, torch.Tensor | None) else v
                            for v in vars(part).values()]) for part in parts]  # fmt: skip
        spec = [PlanCache(*[v.clone() if isinstance(v, torch.Tensor) else v
                            for v in vars(part).values()]) for part in parts]  # fmt: skip
        table, ref = PlanTable.of(mine), PlanTable.of(spec)
        assert table is not None and ref is not None
        triton_plan, spec_plan = plan_impls["triton"], plan_impls["spec"]
        probe = p.triton(triton_plan.probe_group, table)
        want = spec_plan.probe_group(ref)
        for name, g, w in zip(want._fields, probe, want, strict=True):
            check_equal(f"probe_group {name}", g, w)
        m = int(want.counts[:, MISSES].sum())
        keys, order = torch.sort(probe.keys, stable=True)
        want_keys, want_order = torch.sort(want.keys, stable=True)
        place = p.triton(triton_plan.assign_group, table, keys, probe.counts)
        want_place = spec_plan.assign_group(ref, want_keys, want.counts)
        check_equal("assign_group place", place[:m], want_place[:m])
        check_equal("assign_group counts", probe.counts, want.counts)
        # Misses left without a way take free scratch rows (2 and up).
        for parts_now, t in ((mine, table), (spec, ref)):
            for part in parts_now:
                first = part.num_slots + 2
                part.free = torch.arange(first, part.slot_keys.numel(), device=part.ids.device)
            remade = PlanTable.of(parts_now)
            assert remade is not None
            t.table = remade.table
        missed = (place[:m] < 0).long()
        unplaced = torch.cumsum(missed, 0) - missed
        got = p.triton(triton_plan.reserve_group, table, probe, order, place, unplaced)
        wanted = spec_plan.reserve_group(ref, want, want_order, want_place)
        lo = 0
        for c in range(len(parts)):  # every cache reserved: misses placed, or scratch rows
            at = slice(lo, lo + int(want.counts[c, MISSES]))
            lo = at.stop
            for name, g, w in zip(wanted._fields, got, wanted, strict=True):
                check_equal(f"reserve_group cache {c} {name}", g[at], w[at])
        left = int((want.counts[:, MISSES] - want.counts[:, PLACED]).sum())
        print(f"# group plan: {m} misses, {left} of them in scratch rows", flush=True)
        for c, (a, b) in enumerate(zip(mine, spec, strict=True)):
            for name in ("slot_keys", "scores", "locks", "dirty"):
                check_equal(f"group plan cache {c} {name}", getattr(a, name), getattr(b, name))
        return check_equal("group plan slots", probe.slots, want.slots)

    p.check("group plan (probe, assign, reserve)", group_plan_check)

    # Optimizer: one aggregated gradient row per unique id, into shuffled cache rows.
    grads = torch.randn(u, dim, generator=gen)
    updates = {
        OptimRule.SGD: RowUpdate(OptimRule.SGD, lr=0.1, weight_decay=0.01),
        OptimRule.ADAGRAD: RowUpdate(OptimRule.ADAGRAD, lr=0.1, lr_decay=0.01),
        OptimRule.ROWWISE_ADAGRAD: RowUpdate(OptimRule.ROWWISE_ADAGRAD, lr=0.1, eps=1e-8),
        OptimRule.ADAM: RowUpdate(OptimRule.ADAM, lr=0.01, eps=1e-8),
    }
    for rule, update in updates.items():
        width = dim + state_dim(rule, dim)
        rows = torch.randn(u + 7, width + 1, generator=gen)
        rows[:, dim:width] = rows[:, dim:width].abs()  # accumulators, second moments >= 0
        rows[:, width] = float("nan")  # past the state: must stay NaN, untouched

        def update_check(rows=rows, update=update, rule=rule) -> float:
            got, want = rows.to(p.device), rows.clone()
            p.triton(apply_row_update, got[:, :dim], got[:, dim:], slots, grads, update, 3)
            p.twin(apply_row_update, want[:, :dim], want[:, dim:], slots, grads, update, 3)
            return check_close(f"apply_row_update {rule.name}", got, want)

        p.check(f"apply_row_update {rule.name}", update_check)

    value_grads = torch.randn(fused.numel(), dim, generator=gen)

    def aggregate() -> float:
        got_ids, got = p.triton(aggregate_grads, fused, value_grads)
        want_ids, want = p.twin(aggregate_grads, fused, value_grads)
        check_equal("aggregate_grads unique_ids", got_ids, want_ids)
        return check_close("aggregate_grads", got, want, rtol=1e-4)

    print(f"# aggregate_grads: hottest id x{int(counts.max())}", flush=True)
    p.check("aggregate_grads", aggregate)

    # Half-precision weights' stochastic rounding (what the row update stores them through):
    # the same draws, so the same bits.
    key = rounding_key(seed=7, step=3)

    def round_check() -> float:
        x = torch.randn(u, dim, generator=gen) * 3.0
        got = p.triton(stochastic_round, x, torch.bfloat16, unique_ids, key)
        want = p.twin(stochastic_round, x, torch.bfloat16, unique_ids, key)
        return check_equal("stochastic_round bf16", got.view(torch.int16), want.view(torch.int16))

    p.check("stochastic_round bf16", round_check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="B=16, 3 features (dry run)")
    parser.add_argument("--dim", type=int, default=None, help="embedding dim (default 64)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        # The Triton kernels on CPU tensors: the interpreter, set before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from _common import run_header

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_preflight: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.set_num_threads(min(os.cpu_count() or 1, 8))
    b, f, rows = (16, 3, 1000) if args.tiny else (2048, 26, 100_000)
    dim = args.dim or (8 if args.tiny else 64)
    print(run_header(device))
    t0 = time.perf_counter()
    batch = make_batch(b, f, rows)
    print(
        f"# batch: B={b} F={f} rows/table={rows} nnz={batch.values.numel()} dim={dim}; "
        f"Triton on {device.type} vs torch twins on cpu",
        flush=True,
    )
    unchecked = unchecked_operations()
    if unchecked:
        print(
            f"summary: preflight FAILED: no check for {', '.join(unchecked)} (CHECKED, or the "
            "family's preflight.py: CHECKS, ON_HOST)"
        )
        return 1
    pre = Preflight(device, batch, dim, args.tiny)
    backend = os.environ.get("EMBCACHE_BACKEND")
    try:
        run_checks(pre)
        run_family_checks(pre)
    except MismatchError as e:
        print(f"summary: preflight FAILED after {pre.count} ok: {e}")
        return 1
    finally:  # each check switches the backend; leave it as it was
        if backend is None:
            os.environ.pop("EMBCACHE_BACKEND", None)
        else:
            os.environ["EMBCACHE_BACKEND"] = backend
    gone = sorted(set(CHECKED.values()) - set(pre.names))
    if gone:
        print(f"summary: preflight FAILED: CHECKED names checks that did not run: {gone}")
        return 1
    print(f"summary: preflight {pre.count} checks ok in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
