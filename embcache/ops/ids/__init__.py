"""The ids family: validate and fuse a batch's ids, unfuse them, dedup them (one cache, or
several in one sort on the device path), a cache's checks and row-map dedup of fused ids, and
the batch as FBGEMM's TBE step reads it (each value's slot with its bags in sample-major order;
a direct-mapped share's ids checked and its distinct rows found).

`IdsOps` is the family's protocol; its implementations are `spec.SpecIds` (torch, the
specification), `triton.TritonIds` (the Triton kernels) and `native.NativeIds` (numba's
compiled passes where they pay), one of them bound per cache or collection by
`embcache.ops.registry`. Nothing outside `embcache.ops` imports an implementation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from embcache.ops.ids.direct_rows import DirectRows
from embcache.ops.ids.row_map import RowDedup
from embcache.ops.ids.shared import Deduped, IdVerdict, JointPlan, JointShares, Marked


class IdsOps(Protocol):
    """One implementation of the ids family.

    Attributes:
        name: ``"spec"``, ``"triton"`` or ``"native"``.
        joint: whether the joint dedup runs here (`sort_and_mark`, `scatter_joint`): the
            device path's, else they raise NotImplementedError.
        compiled: whether `direct_rows` is one compiled pass over the values here (numba's),
            which the engine prefers to its own torch path for a direct share
            (`CacheEngine._direct_slots`, the cache counting the rows); the torch
            specification says False, and its engine keeps that path.
    """

    name: str
    joint: bool
    compiled: bool

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
        """Validate the ids of F features and fuse each with its table index.

        Example: features ``f0, f1`` of table 0 and ``f2`` of table 1, ``fusion_k = 30``,
        values ``[3, 7, 7, 5]`` with lengths ``[2, 1, 1]`` give ``[3, 7, 7, 5 | 1 << 30]``.

        Args:
            values: int64 or int32 ``[nnz]``, the values of the F features concatenated.
            feature_lengths: int ``[F]``, number of values of each feature (sums to nnz).
            table_idx: int ``[F]``, table index of each feature, ``0 <= t < 2**(63 - k)``.
            num_embeddings: int ``[F]``, rows of each feature's table, -1 for an unbounded
                table (its ids outside ``[0, 2**fusion_k)`` folded by a hash).
            fusion_k: bits kept for the id, in ``[0, 63]``.
            feature_names: F feature names, for error messages.
            table_names: F table names (of each feature's table), for error messages.

        Returns:
            int64 ``[nnz]``: ``values | (table_idx << fusion_k)`` per value.

        Raises:
            TypeError: a tensor that is not int32/int64, or a fusion_k that is not an int.
            ValueError: mismatched lengths, negative lengths, a bad table index, or the first
                id that is negative, ``>= num_embeddings`` or ``>= 2**fusion_k``, naming
                feature, table, id and limit. Nothing is modified in any case.
        """
        ...

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
        """`fuse_ids` with its device checks not yet read: the fused ids (meaningless until
        the checks pass) and an `IdVerdict` to read with a read of the caller's (None: the
        checks were made and passed here, as the CPU path does). The caller must `judge` the
        verdict before it uses the fused ids for anything that changes state.

        Raises:
            TypeError, ValueError: as `fuse_ids`, for what the host knows (dtypes, sizes)
                and for what the CPU path reads.
        """
        ...

    def unfuse_ids(self, fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table_idx, ids)``, int64 ``[n]`` each, of int64 fused ids: `fuse_ids`' inverse."""
        ...

    def dedup(
        self, ids: torch.Tensor, with_counts: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Unique ids of a batch, sorted ascending, with the inverse index and counts.

        Example: ``[7, 3, 7, 9]`` gives ``([3, 7, 9], [1, 0, 1, 2], [1, 2, 1])``.

        Args:
            ids: int64 or int32 ``[n]`` (fused) ids.
            with_counts: also count occurrences (the CPU path is ~30% cheaper without).

        Returns:
            ``(unique_ids, inverse, counts)``: int64 ``[U]`` ascending, int64 ``[n]`` with
            ``unique_ids[inverse] == ids``, int64 ``[U]`` occurrences of each unique id
            (None when not asked for, where that saves work).
        """
        ...

    def dedup_grouped(
        self, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`dedup` plus the value positions grouped by unique id, for a one-pass backward:
        ``(unique_ids, inverse, order, segments)``, ``order`` int64 ``[n]`` positions sorted
        by id (ascending within an id) and ``segments`` int64 ``[U + 1]``: id u owns
        ``order[segments[u] : segments[u + 1]]``."""
        ...

    def first_bad_key(self, ids: torch.Tensor, fusion_k: int, limits: torch.Tensor) -> int:
        """The position of the first of CPU int64 fused ``ids`` that is no row of tables of
        ``limits[t]`` raw ids each (0: no such table), or -1."""
        ...

    def row_dedup(
        self,
        row_offset: torch.Tensor,
        index_rows: int,
        rows: Mapping[int, int | None],
        fusion_k: int,
    ) -> RowDedup:
        """The dedup through a map over a cache's tables' rows (`row_map.RowDedup`)."""
        ...

    def direct_rows(
        self, feature_rows: Sequence[int], feature_bases: Sequence[int], num_rows: int
    ) -> DirectRows:
        """The pass that checks a direct share's ids and lists its distinct rows, for a cache
        of ``num_rows`` slots whose feature f reads the table of ``feature_rows[f]`` rows at
        slot ``feature_bases[f]`` (`direct_rows.DirectRows`: called with a batch's values,
        offsets and B, it gives the distinct slots in order of first sight, or None for a bad
        id or offsets). Made once per engine: the compiled one holds a bit per slot.

        Raises:
            TypeError, ValueError: as `direct_rows.DirectRows` says.
        """
        ...

    def bags_sample_major(
        self,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        batch_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The TBE step's indices: the slot of every value, with the bags moved from the
        batch's feature-major order (bag ``f * B + b``) to sample-major (bag ``b * F + f``),
        so that FBGEMM's pooled output ``[B * F, dim]`` is the ``[B, F * dim]`` block as it
        stands.

        Example: F = 2, B = 2, unique slots ``[40, 50]``, inverse ``[0, 1, 1, 0]`` and offsets
        ``[0, 1, 2, 4, 4]`` (bags ``(f0,b0) = [40]``, ``(f0,b1) = [50]``, ``(f1,b0) = [50,
        40]``, ``(f1,b1) = []``) give ``[40, 50, 40, 50]`` with offsets ``[0, 1, 3, 4, 4]``.

        Args:
            slots: int64 ``[U]``, the slot of each unique id.
            inverse: int64 ``[nnz]``, the unique index of each value.
            offsets: int64 ``[F * B + 1]``, CSR over the bags, feature-major (its values are
                not checked: that would read them on the host).
            weights: floating ``[nnz]`` per-sample weights, or None.
            batch_size: B, bags per feature.

        Returns:
            ``(indices, offsets, weights)``: int64 ``[nnz]`` ``slots[inverse]`` in sample-major
            order, int64 ``[F * B + 1]`` its bag offsets, and the weights moved with their
            values (None without). With fewer than two features nothing moves (the offsets
            and weights are those given).

        Raises:
            TypeError: a tensor of another dtype, or a ``batch_size`` that is not an int.
            ValueError: a tensor that is not 1-D, weights not one per value, or offsets that
                are not F bags of ``batch_size`` each.
        """
        ...

    def sort_and_mark(
        self,
        ids: torch.Tensor,
        starts: torch.Tensor | None,
        extra: torch.Tensor | None,
        read: torch.Tensor | None = None,
    ) -> Marked:
        """A stable sort of ``ids`` (int64 ``[n]``), one kernel marking its runs and adding
        up the runs below each of ``starts`` (int64, ascending: a table's first fused id)
        into ``read`` (zeroed here, or given: a slice of a buffer the caller reads whole),
        which also receives a copy of ``extra`` (int64) after those counts; and the runs'
        running count. Only where `joint`."""
        ...

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
        """Each group's share of a joint dedup (`engine.joint`) from a `sort_and_mark` of the
        tagged keys, after the read that made ``plan`` (`spec.scatter_joint_ref` is the
        specification). Only where `joint`."""
        ...

    def dedup_together(
        self,
        ids: list[torch.Tensor],
        table_starts: Sequence[torch.Tensor | None] | None = None,
        also_read: torch.Tensor | None = None,
    ) -> tuple[list[Deduped], list[int]]:
        """`dedup` (unique ids ascending and the inverse, no counts) of several caches' ids
        (one device), with one host read for all of them, their numbers of unique ids, instead
        of one per cache: each is sorted, its runs ranked, and its unique ids written at their
        ranks once those sizes are known. The same read brings each cache's
        `CacheLayout.table_bounds` (where each table's ids start among its unique ids) when
        ``table_starts[i]`` gives the fused id each table of cache i starts at
        (`CacheLayout.fused_starts`; None: one table), and the values of ``also_read`` (int64
        ``[m]``, e.g. the id checks of `fuse_ids_deferred`), returned beside the shares."""
        ...
