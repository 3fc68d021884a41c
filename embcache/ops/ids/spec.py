"""The ids family's specification in plain torch: validate and fuse per-feature ids, unfuse
them, dedup a batch, check fused ids against a cache's tables, and the joint dedup's scatter.

A batch arrives as the values of F features concatenated (a KeyedJaggedTensor's values). Each
id of a bounded table is checked against it (``0 <= id < num_embeddings``) and the fusion width
(``id < 2**fusion_k``), then fused with its table index, ``id | (table_idx << fusion_k)``, so
that one cache can hold the rows of several tables. An unbounded table takes any int64 id (raw
64-bit hashes included): one in ``[0, 2**fusion_k)`` is kept as it is, any other is folded
into the id bits by a hash, ``mix64(id) & (2**fusion_k - 1)``, so two ids may share a row (with
fusion_k bits and n folded ids, about ``n / 2**fusion_k`` of them do).

Each twin (``*_ref``) computes exactly what its Triton kernel (`ops.ids.triton`) or compiled
pass (`ops.ids.native`) computes, with vectorised torch ops (no Python loop over ids, no
per-element ``.item()``): `bags_sample_major_ref`, the TBE step's indices with their bags in
sample-major order, has no Triton kernel, and neither has a direct share's distinct rows
(`direct_rows.DirectRows`). `SpecIds` is the family's implementation built on them (`IdsOps`):
the CPU path where numba is absent, the ``torch`` backend everywhere, and what the other
implementations are tested against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from embcache.hashing import mix64
from embcache.ops.ids import IdsOps
from embcache.ops.ids.direct_rows import DirectRows
from embcache.ops.ids.row_map import RowDedup
from embcache.ops.ids.shared import (
    ID_NEGATIVE,
    ID_OK,
    ID_OUT_OF_RANGE,
    ID_OVERFLOWS_K,
    Deduped,
    IdVerdict,
    JointPlan,
    JointShares,
    Marked,
    bad_tables,
    check_bags_sample_major,
    check_fusion_k,
    check_ids,
    features_of_values,
    joint_outputs,
)

# ----------------------------------------------------------------------------------------------
# the twins
# ----------------------------------------------------------------------------------------------


def fuse_ids_ref(
    values: torch.Tensor,
    value_features: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fuse each id with its table index and judge it, without raising. An unbounded table's
    id outside ``[0, 2**fusion_k)`` is folded to ``mix64(id) & (2**fusion_k - 1)`` and judged
    ok.

    Args:
        values: int32 or int64 ``[nnz]`` ids.
        value_features: int64 ``[nnz]`` feature of each value, in ``[0, F)``.
        table_idx: int64 ``[F]`` table index of each feature, ``0 <= t < 2**(63 - fusion_k)``.
        num_embeddings: int64 ``[F]`` rows of each feature's table, -1 when unbounded.
        fusion_k: bits kept for the id, in ``[0, 63]``.

    Returns:
        ``(fused, verdict)``: int64 ``[nnz]`` ``values | (table_idx << fusion_k)``, and int8
        ``[nnz]`` ``ID_OK`` or the first failed check (``ID_NEGATIVE``, ``ID_OUT_OF_RANGE``,
        ``ID_OVERFLOWS_K``). ``fused`` is meaningless where the verdict is not ``ID_OK``.
    """
    ids = values.to(torch.int64)
    table = table_idx.index_select(0, value_features)
    # Unbounded tables: fold ids beyond the id bits (computed for every value: asking first
    # whether any table is unbounded would cost a host read per batch).
    fold = (num_embeddings.index_select(0, value_features) < 0) & ((ids >> fusion_k) != 0)
    ids = torch.where(fold, mix64(ids) & ((1 << fusion_k) - 1), ids)
    fused = ids | (table << fusion_k)
    # Good path: one bound per feature, min(num_embeddings, 2**fusion_k), and one mask.
    fits = (1 << fusion_k) if fusion_k < 63 else torch.iinfo(torch.int64).max
    bound = torch.where(num_embeddings >= 0, num_embeddings.clamp(max=fits), fits)
    bad = (ids < 0) | (ids >= bound.index_select(0, value_features))
    if not bool(bad.any()):
        return fused, torch.zeros_like(ids, dtype=torch.int8)
    limit = num_embeddings.index_select(0, value_features)
    verdict = torch.where(
        ids < 0,
        ID_NEGATIVE,
        torch.where(
            (limit >= 0) & (ids >= limit),
            ID_OUT_OF_RANGE,
            torch.where((ids >> fusion_k) != 0, ID_OVERFLOWS_K, ID_OK),
        ),
    ).to(torch.int8)
    return fused, verdict


def unfuse_ids_ref(fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fused ids into ``(table_idx, ids)``, both int64 ``[n]``; inverse of `fuse_ids_ref`."""
    fused = fused.to(torch.int64)
    return fused >> fusion_k, fused & ((1 << fusion_k) - 1)


def dedup_ref(
    ids: torch.Tensor, with_counts: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Unique ids, sorted ascending, with the inverse index and counts.

    Args:
        ids: int64 ``[n]``.
        with_counts: also count occurrences; else counts is None.

    Returns:
        ``(unique_ids, inverse, counts)``: int64 ``[U]``, int64 ``[n]`` with
        ``unique_ids[inverse] == ids``, and int64 ``[U]`` occurrences of each unique id.
    """
    if not with_counts:
        unique_ids, inverse = torch.unique(ids.to(torch.int64), sorted=True, return_inverse=True)
        return unique_ids, inverse.reshape(-1), None
    unique_ids, inverse, counts = torch.unique(
        ids.to(torch.int64), sorted=True, return_inverse=True, return_counts=True
    )
    return unique_ids, inverse.reshape(-1), counts


def dedup_grouped_ref(
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dedup_ref` that also returns the positions grouped by unique id.

    Args:
        ids: int64 ``[n]``.

    Returns:
        ``(unique_ids, inverse, order, segments)``: unique ids ascending ``[U]``, the inverse
        ``[n]``, ``order`` ``[n]``: positions sorted by id (stable: ascending within an id), and
        ``segments`` ``[U + 1]``: unique id u owns ``order[segments[u] : segments[u + 1]]``.
    """
    ids = ids.to(torch.int64)
    n = ids.numel()
    sorted_ids, order = torch.sort(ids, stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=ids.device)
    if n > 1:
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=starts[1:])
    unique_ids = sorted_ids[starts]
    inverse = torch.empty_like(order)
    inverse[order] = torch.cumsum(starts, 0) - 1
    segments = torch.nonzero(starts).squeeze(1)
    segments = torch.cat([segments, segments.new_full((1,), n)])
    return unique_ids, inverse, order, segments


_SEGMENT_MIN = 4096  # values per feature (on average) from which `fuse_segments_cpu` pays


def fuse_segments_cpu(
    values: torch.Tensor,
    lengths: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
) -> torch.Tensor | None:
    """`fuse_ids_ref` on the CPU, one feature's contiguous values at a time: a range
    check (one min/max pass) and one fusing pass per feature (per batch when every feature has
    as many values), instead of per-value gathers of each value's table and bound; two host
    reads whatever the number of features. None when any id or table index fails a check (the
    caller's general path then says which), or when features are short and uneven (the
    general path is cheaper then)."""
    fits = (1 << fusion_k) if fusion_k < 63 else torch.iinfo(torch.int64).max
    table_limit = (1 << (63 - fusion_k)) if fusion_k > 0 else torch.iinfo(torch.int64).max
    sizes, tables, rows = torch.stack([lengths, table_idx, num_embeddings]).tolist()
    if not all(0 <= t < table_limit for t in tables):
        return None
    n = sizes[0] if sizes else 0
    if n and sizes.count(n) == len(sizes):  # as many values in every feature: all at once
        grid = values.view(len(sizes), n)
        lows, highs = (bound.tolist() for bound in torch.aminmax(grid, dim=1))
        for lo, hi, limit in zip(lows, highs, rows, strict=True):
            if lo < 0 or hi >= (min(limit, fits) if limit >= 0 else fits):
                return None
        shift = torch.tensor(tables, dtype=torch.int64).unsqueeze(1) << fusion_k
        return torch.bitwise_or(grid, shift).view(-1)  # int64 whatever the values' type
    if values.numel() < _SEGMENT_MIN * len(sizes):
        return None  # short features: the per-value path is cheaper
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    present = [f for f, n in enumerate(sizes) if n]
    if present:
        ranges = torch.stack(
            [torch.stack(torch.aminmax(values[starts[f] : starts[f + 1]])) for f in present]
        ).tolist()
        for f, (lo, hi) in zip(present, ranges, strict=True):
            if lo < 0 or hi >= (min(rows[f], fits) if rows[f] >= 0 else fits):
                return None
    out = torch.empty(values.numel(), dtype=torch.int64)
    for f in present:
        seg, dst = values[starts[f] : starts[f + 1]], out[starts[f] : starts[f + 1]]
        if seg.dtype == torch.int64:
            torch.bitwise_or(seg, tables[f] << fusion_k, out=dst)
        else:
            dst.copy_(seg).bitwise_or_(tables[f] << fusion_k)
    return out


def scatter_joint_ref(
    keys: torch.Tensor,
    plan: JointPlan,
    tag_shift: int,
    weights: torch.Tensor | None,
    lengths: torch.Tensor,
) -> JointShares:
    """`scatter_joint`'s specification in plain torch, from the tagged keys themselves
    (unsorted, in the batch's order) and the bag lengths (``[K * B]``, the batch's order);
    the padding between shares is left as allocated."""
    device = keys.device
    out = joint_outputs(plan, device, weights is not None)
    bags = lengths.to(torch.int64).view(len(plan.key_ends), plan.batch_size)
    for g, ob in enumerate(plan.obase):
        mine = [k for k in range(len(plan.key_ends)) if plan.key_group[k] == g]
        mine.sort(key=lambda k: plan.key_place[k])
        grouped = bags[mine].reshape(-1) if mine else bags.new_zeros(0)
        out.offsets[ob] = 0
        out.offsets[ob + 1 : ob + 1 + grouped.numel()] = torch.cumsum(grouped, 0)
    key_ends = torch.tensor(plan.key_ends, dtype=torch.int64, device=device)
    shifts = torch.tensor(plan.shift, dtype=torch.int64, device=device)
    for g in range(len(plan.u_lo)):
        positions = torch.nonzero((keys >> tag_shift) == g).flatten()  # batch order
        # A value's place in its group's feature order: its key's shift added.
        dst = positions + shifts[torch.searchsorted(key_ends, positions, right=True)]
        ids = keys[positions] & ((1 << tag_shift) - 1)
        local = torch.empty_like(ids)
        local[dst] = ids
        unique, inverse = torch.unique(local, sorted=True, return_inverse=True)
        counts = torch.bincount(inverse, minlength=unique.numel())
        starts = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, 0, out=starts[1:])
        ub, vb, nv = plan.ubase[g], plan.vbase[g], local.numel()
        out.unique[ub : ub + unique.numel()] = unique
        out.starts[ub : ub + unique.numel() + 1] = starts
        out.inverse[vb : vb + nv] = inverse
        # Grouped by id, each id's values in batch order (the sort is stable).
        out.order[vb : vb + nv] = dst[torch.sort(ids, stable=True)[1]]
        if out.weights is not None and weights is not None:
            w = torch.empty(nv, dtype=torch.float32, device=device)
            w[dst] = weights[positions]
            out.weights[vb : vb + nv] = w
    return out


def bags_sample_major_ref(
    slots: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`IdsOps.bags_sample_major` in torch ops, on checked arguments: a gather of each value's
    slot, then the bags moved by a transpose when they all have one length, else by a
    permutation of the values (nothing to move with fewer than two features)."""
    num_bags = offsets.numel() - 1
    features = num_bags // batch_size if batch_size else 0
    if features <= 1:
        return slots.index_select(0, inverse), offsets, weights
    n = inverse.numel()
    bag_lengths = offsets[1:] - offsets[:-1]
    shortest, longest = torch.stack(torch.aminmax(bag_lengths)).tolist()
    values = slots.index_select(0, inverse)
    if shortest == longest == 0:
        return values, offsets, weights
    if shortest == longest:  # bags of one length: a transpose of [F, B, L]

        def moved(t: torch.Tensor) -> torch.Tensor:
            return t.view(features, batch_size, longest).transpose(0, 1).reshape(-1)

        out_offsets = torch.arange(0, n + 1, longest, dtype=torch.int64, device=values.device)
        return moved(values), out_offsets, None if weights is None else moved(weights)
    starts = offsets[:-1].view(features, batch_size).t().reshape(-1)
    lengths = bag_lengths.view(features, batch_size).t().reshape(-1)
    out_offsets = torch.zeros(num_bags + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(lengths, 0, out=out_offsets[1:])
    # Value i of sample-major bag k sits at starts[k] + (i - out_offsets[k]) in the batch.
    perm = torch.repeat_interleave(starts - out_offsets[:-1], lengths, output_size=n)
    perm += torch.arange(n, dtype=torch.int64, device=values.device)
    out_weights = None if weights is None else weights.index_select(0, perm)
    return values.index_select(0, perm), out_offsets, out_weights


# ----------------------------------------------------------------------------------------------
# the implementation
# ----------------------------------------------------------------------------------------------


class SpecIds:
    """The ids family in torch ops (`IdsOps` documents each operation). The other
    implementations subclass it and replace the hooks (``_fuse``, ``_unfuse``, ``_dedup``)
    or whole operations; the checks of the arguments stay here, one wording for all."""

    name = "spec"
    joint = False  # no joint dedup (`sort_and_mark`, `scatter_joint`): the device path's
    compiled = False  # `direct_rows` in torch ops: the engine keeps its own torch path

    def fuse_ids(
        self,
        values: torch.Tensor,
        feature_lengths: torch.Tensor,
        table_idx: torch.Tensor,
        num_embeddings: torch.Tensor,
        fusion_k: int,
        feature_names: Sequence[str],
        table_names: Sequence[str],
    ) -> torch.Tensor:
        fused, verdict = self.fuse_ids_deferred(
            values, feature_lengths, table_idx, num_embeddings, fusion_k, feature_names,
            table_names,
        )  # fmt: skip
        if verdict is not None:
            verdict.verify()
        return fused

    def fuse_ids_deferred(
        self,
        values: torch.Tensor,
        feature_lengths: torch.Tensor,
        table_idx: torch.Tensor,
        num_embeddings: torch.Tensor,
        fusion_k: int,
        feature_names: Sequence[str],
        table_names: Sequence[str],
    ) -> tuple[torch.Tensor, IdVerdict | None]:
        for name, t in (
            ("values", values),
            ("feature_lengths", feature_lengths),
            ("table_idx", table_idx),
            ("num_embeddings", num_embeddings),
        ):
            check_ids(name, t)
        check_fusion_k(fusion_k)
        num_features = feature_lengths.numel()
        sizes = {
            "table_idx": table_idx.numel(),
            "num_embeddings": num_embeddings.numel(),
            "feature_names": len(feature_names),
            "table_names": len(table_names),
        }
        for name, size in sizes.items():
            if size != num_features:
                raise ValueError(
                    f"{name} has {size} entries but feature_lengths has {num_features} features"
                )
        nnz = values.numel()
        device = values.device
        if num_features == 0:
            if nnz:
                raise ValueError(f"values has {nnz} entries but there are no features")
            return torch.empty(0, dtype=torch.int64, device=device), None
        lengths = feature_lengths.to(device=device, dtype=torch.int64)
        table_idx = table_idx.to(device=device, dtype=torch.int64)
        num_embeddings = num_embeddings.to(device=device, dtype=torch.int64)
        ends = torch.cumsum(lengths, 0)
        names = (feature_names, table_names)
        return self._fuse(values, lengths, ends, table_idx, num_embeddings, fusion_k, names)

    def _fuse(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor,
        ends: torch.Tensor,
        table_idx: torch.Tensor,
        num_embeddings: torch.Tensor,
        fusion_k: int,
        names: tuple[Sequence[str], Sequence[str]],
    ) -> tuple[torch.Tensor, IdVerdict | None]:
        """`fuse_ids_deferred` once its arguments are checked (``lengths``, ``table_idx``
        and ``num_embeddings`` int64 on the values' device, ``ends`` the lengths' running
        sums, F >= 1)."""
        nnz, num_features = values.numel(), lengths.numel()
        lengths_ok = (
            values.device.type == "cpu" and bool((lengths >= 0).all()) and int(ends[-1]) == nnz
        )
        # Per feature pays a few calls per feature: it wins once features average ~4k values,
        # or when every feature has as many values (one pass over them all).
        if lengths_ok:
            fused = fuse_segments_cpu(values, lengths, table_idx, num_embeddings, fusion_k)
            if fused is not None:
                return fused, None  # else a bad id or table index: the checks below name it
            # On the CPU a check costs no device sync: with lengths known good,
            # repeat_interleave is several times cheaper than a search per value.
            features = torch.arange(num_features, dtype=torch.int64)
            value_features = torch.repeat_interleave(features, lengths, output_size=nnz)
        else:
            value_features = features_of_values(ends, nnz)
        fused, verdict = fuse_ids_ref(values, value_features, table_idx, num_embeddings, fusion_k)
        flags = torch.stack(
            [
                (lengths < 0).any(),
                ends[-1] != nnz,
                bad_tables(table_idx, fusion_k).any(),
                (verdict != ID_OK).any(),
            ]
        ).to(torch.int64)
        args = (values, lengths, ends, table_idx, value_features, verdict, num_embeddings,
                fusion_k, *names)  # fmt: skip
        return fused, IdVerdict(flags, args)

    def unfuse_ids(self, fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_ids("fused", fused)
        check_fusion_k(fusion_k)
        return self._unfuse(fused, fusion_k)

    def _unfuse(self, fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return unfuse_ids_ref(fused, fusion_k)

    def dedup(
        self, ids: torch.Tensor, with_counts: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        check_ids("ids", ids)
        return self._dedup(ids, with_counts)

    def _dedup(
        self, ids: torch.Tensor, with_counts: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return dedup_ref(ids, with_counts)

    def dedup_grouped(
        self, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # Sort-based with torch ops in every implementation (``torch.sort`` is the
        # bandwidth-bound core on a GPU too, as in the Triton dedup).
        check_ids("ids", ids)
        return dedup_grouped_ref(ids)

    def first_bad_key(self, ids: torch.Tensor, fusion_k: int, limits: torch.Tensor) -> int:
        tables = ids >> fusion_k
        n = limits.numel()
        wrong = (ids < 0) | (tables >= n)
        wrong |= (ids & ((1 << fusion_k) - 1)) >= limits.index_select(0, tables.clamp(0, n - 1))
        found = np.flatnonzero(wrong.numpy())
        return int(found[0]) if found.size else -1

    def row_dedup(
        self,
        row_offset: torch.Tensor,
        index_rows: int,
        rows: Mapping[int, int | None],
        fusion_k: int,
    ) -> RowDedup:
        return RowDedup(row_offset, index_rows, rows, fusion_k)

    def direct_rows(
        self, feature_rows: Sequence[int], feature_bases: Sequence[int], num_rows: int
    ) -> DirectRows:
        return DirectRows(feature_rows, feature_bases, num_rows)

    def bags_sample_major(
        self,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        batch_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        check_bags_sample_major(slots, inverse, offsets, weights, batch_size)
        return bags_sample_major_ref(slots, inverse, offsets, weights, batch_size)

    def sort_and_mark(
        self,
        ids: torch.Tensor,
        starts: torch.Tensor | None,
        extra: torch.Tensor | None,
        read: torch.Tensor | None = None,
    ) -> Marked:
        raise NotImplementedError(f"the {self.name} ids have no joint dedup (see `joint`)")

    def scatter_joint(
        self,
        ordered: torch.Tensor,
        order: torch.Tensor,
        is_start: torch.Tensor,
        seen: torch.Tensor,
        plan: JointPlan,
        tag_shift: int,
        weights: torch.Tensor | None,
        length_ends: torch.Tensor,
    ) -> JointShares:
        raise NotImplementedError(f"the {self.name} ids have no joint dedup (see `joint`)")

    def dedup_together(
        self,
        ids: list[torch.Tensor],
        table_starts: Sequence[torch.Tensor | None] | None = None,
        also_read: torch.Tensor | None = None,
    ) -> tuple[list[Deduped], list[int]]:
        # Each cache's ids sorted, their runs ranked; one read brings every count (and the
        # table bounds, and ``also_read``); the unique ids are written at their ranks after.
        runs, parts = [], []
        for i, x in enumerate(ids):
            x = x.to(torch.int64)
            n = x.numel()
            ordered, order = torch.sort(x)
            starts = torch.ones(n, dtype=torch.bool, device=x.device)
            if n > 1:
                torch.ne(ordered[1:], ordered[:-1], out=starts[1:])
            # ``seen[j]``: unique ids among the first j sorted ids; the last is their number.
            seen = torch.zeros(n + 1, dtype=torch.int64, device=x.device)
            torch.cumsum(starts, 0, out=seen[1:])
            rank = seen[1:] - 1
            parts.append(seen[n:])
            fused_starts = None if table_starts is None else table_starts[i]
            if fused_starts is not None:
                # A table's ids start after the unique ids of the sorted ids below its first.
                parts.append(seen.index_select(0, torch.searchsorted(ordered, fused_starts)))
            runs.append((ordered, order, rank, 0 if fused_starts is None else fused_starts.numel()))
        if also_read is not None:
            parts.append(also_read.to(torch.int64))
        values = torch.cat(parts).tolist() if parts else []
        out, at = [], 0
        for ordered, order, rank, tables in runs:
            n = values[at]
            bounds = [*values[at + 1 : at + 1 + tables], n] if tables else None
            at += 1 + tables
            unique = ordered.new_empty(n).scatter_(0, rank, ordered)  # a run writes one value
            out.append(Deduped(unique, torch.empty_like(order).scatter_(0, order, rank), bounds))
        return out, values[at:]


IMPLEMENTATION: IdsOps = SpecIds()  # checked against the protocol
