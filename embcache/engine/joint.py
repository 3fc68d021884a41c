"""Every cache of a collection deduplicated in one pass on the device path.

A collection of several embedding dims keeps one cache per dim. Cutting a batch between the
caches needs each key's number of values on the host, a read of its own before any dedup can
be sized; and deduplicating each cache apart costs a sort and its kernels per cache. Here the
batch is fused in its own key order, each value's fused id tagged with its cache in the bits
above the fused ids, and sorted once (`IdsOps.sort_and_mark`). One host read then brings what
every cache needs: the number of unique ids, where each cache's and each table's ids start,
the id and length checks of the fuse (`IdVerdict`), and the per-key counts (which place each
value in its cache's feature order and check the batch's lengths). A last kernel
(`IdsOps.scatter_joint`) writes each cache's unique ids, inverse, grouping and per-sample
weights apart.

`JointLayout.of` says when this applies (the caches' shares are plain dedups on the device
path, the batch's keys are the collection's features, and the tag fits above the fused ids);
`dedup_joint` runs it and gives what `ShareMaker.prepare_fused` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from embcache.engine.inputs import JaggedBatch
from embcache.engine.layout import CacheLayout
from embcache.ops.ids import IdsOps
from embcache.ops.ids.shared import Deduped, joint_plan

# A cache's share as `ShareMaker.prepare_fused` takes it: ids (here its unique ids, already
# deduplicated), its bags (here their offsets, made by the dedup: `Deduped.offsets`),
# per-sample weights and `Prepared.cuts`.
JointShare = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int] | None]


@dataclass
class JointLayout:
    """How a batch with keys ``keys`` maps onto caches ``layouts`` (made once per key order and
    device): each cache's keys in its feature order (``group_keys``), each key's table index
    tagged with its cache and its table's rows and name, and the tagged fused ids where each
    cache but the first starts, then where each table of a cache of several starts."""

    keys: list[str]
    layouts: list[CacheLayout]
    group_keys: list[list[int]]
    tag_shift: int
    table_index: torch.Tensor  # int64 [K] (cache << table bits) | table index
    table_rows: torch.Tensor  # int64 [K]
    table_names: list[str]  # [K]
    starts: torch.Tensor  # int64 [G - 1 + sum of tables of caches of several]
    table_starts_at: list[int | None]  # per cache: its first table start's entry in ``starts``

    @classmethod
    def of(
        cls,
        layouts: Sequence[CacheLayout],
        keys: Sequence[str],
        device: torch.device,
        fusion_k: int,
    ) -> JointLayout | None:
        """The layout, or None when a key is not exactly one cache's feature or the cache
        tag does not fit the bits above the fused ids."""
        features = [f for layout in layouts for f in layout.features]
        position = {k: i for i, k in enumerate(keys)}
        if len(position) != len(keys) or sorted(features) != sorted(keys):
            return None
        table_bits = max(t.index for layout in layouts for t in layout.tables).bit_length()
        tag_shift = fusion_k + table_bits
        if tag_shift + (len(layouts) - 1).bit_length() > 63:
            return None
        group_keys = [[position[f] for f in layout.features] for layout in layouts]
        index = [0] * len(keys)
        rows = [0] * len(keys)
        names = [""] * len(keys)
        for g, layout in enumerate(layouts):
            for f, t in zip(layout.features, layout.feature_table, strict=True):
                k = position[f]
                index[k] = (g << table_bits) | t.index
                rows[k] = -1 if t.num_embeddings is None else t.num_embeddings
                names[k] = t.name
        starts = [g << tag_shift for g in range(1, len(layouts))]
        table_starts_at: list[int | None] = []
        for g, layout in enumerate(layouts):
            several = len(layout.tables) > 1
            table_starts_at.append(len(starts) if several else None)
            if several:
                starts += [(g << tag_shift) | (t.index << fusion_k) for t in layout.tables]

        def tensor(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        return cls(list(keys), list(layouts), group_keys, tag_shift, tensor(index), tensor(rows),
                   names, tensor(starts), table_starts_at)  # fmt: skip


def dedup_joint(
    joint: JointLayout, batch: JaggedBatch, fusion_k: int, device: torch.device, ops: IdsOps
) -> tuple[list[JointShare], list[Deduped]]:
    """Every cache's share of ``batch`` (keys checked, values on ``device``), deduplicated
    together by ``ops`` (the ids family bound for the caches, where `IdsOps.joint`): one fuse,
    one sort, one host read, one scatter (module docstring).

    Raises:
        ValueError: a bad id or length, as `IdsOps.fuse_ids` says, before anything is
            written.
    """
    keys = joint.keys
    values, lengths = batch.values(), batch.lengths()
    b = batch.stride()
    rows = lengths.view(len(keys), b)
    per_key = rows.sum(dim=1, dtype=torch.int64)
    late = batch.lengths_pending
    if late and b:  # a negative bag makes its key's count negative: the fuse's check sees it
        per_key.masked_fill_(rows.amin(dim=1) < 0, -1)
    fused, verdict = ops.fuse_ids_deferred(
        values, per_key, joint.table_index, joint.table_rows, fusion_k, keys, joint.table_names
    )
    # The bags' running ends, for every cache's offsets (`scatter_joint`).
    ends = torch.cumsum(lengths, 0, dtype=torch.int64)
    extra = per_key if verdict is None else torch.cat([verdict.flags, per_key])
    marked = ops.sort_and_mark(fused, joint.starts, extra)
    num_starts = joint.starts.numel()
    read = marked.read.tolist()  # the one host read
    runs_below = read[1 : 1 + num_starts]
    tail = read[1 + num_starts :]
    if verdict is not None:
        if late:
            verdict.first = batch.check_lengths
        verdict.judge(tail[:4])
        tail = tail[4:]
    if late:
        batch.lengths_checked(tail)
    groups = len(joint.layouts)
    where = joint_plan(tail, joint.group_keys, runs_below[: groups - 1], read[0], b)
    weights = batch.weights_or_none()
    if weights is not None:
        weights = weights.to(device, torch.float32)
    shares = ops.scatter_joint(marked.ordered, marked.order, marked.is_start, marked.seen, where,
                           joint.tag_shift, weights, ends)  # fmt: skip
    out: list[JointShare] = []
    found: list[Deduped] = []
    for g, layout in enumerate(joint.layouts):
        share = shares.group(where, g)
        at = joint.table_starts_at[g]
        bounds = None
        if at is not None:
            below = runs_below[at : at + len(layout.tables)]
            bounds = [r - where.u_lo[g] for r in below] + [where.num_unique[g]]
        found.append(
            Deduped(share.unique, share.inverse, bounds, share.order, share.starts, share.offsets)
        )
        cuts = layout.value_cuts([tail[k] for k in joint.group_keys[g]])
        out.append((share.unique, share.offsets, share.weights, cuts))
    return out, found
