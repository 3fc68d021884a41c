"""How a collection lays out its features over its caches: one `CacheLayout` per embedding dim,
its features ordered so that those sharing a pooling mode form one contiguous `Lookup`, and the
bags of one batch cut along those lookups (`CacheLayout.bags`).

A position of a layout is one (table, feature) lookup: ``features[i]`` is the input key it
reads (a feature looked up by two tables of one dim appears twice) and ``keys[i]`` the output
key it writes (``feature@table`` for such a feature, as torchrec names it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from embcache.engine.tables import Table
from embcache.kernels.pooling import PoolingMode


@dataclass
class Lookup:
    """The features of one cache that share a pooling mode, laid out contiguously (mode None:
    unpooled, one row per value)."""

    mode: PoolingMode | None
    features: list[str]
    feature_lo: int  # first feature of this lookup within its cache's feature order
    feature_hi: int


@dataclass
class Bags:
    """One lookup's bags of a batch, as the pooling kernels take them."""

    inverse: torch.Tensor  # int64 [nnz] row (unique id) of each value
    offsets: torch.Tensor  # int64 [F_lookup * B + 1], from 0
    weights: torch.Tensor | None  # float32 [nnz]
    columns: torch.Tensor  # int64 [F_lookup] first output column of each feature
    # ``columns[0]`` when the columns are known to lie side by side (``columns[0] + dim *
    # arange(F_lookup)``): the kernels then read nothing on the host. None: not known.
    column_start: int | None = None


@dataclass
class CacheLayout:
    """The tables of one embedding dim (one cache) and their features in lookup order."""

    dim: int
    tables: list[Table]
    features: list[str]  # input key of each position
    feature_table: list[Table]
    lookups: list[Lookup]
    keys: list[str]  # output key of each position
    table_index: torch.Tensor = field(init=False)  # int64 [F] table of each feature (host)
    table_rows: torch.Tensor = field(init=False)  # int64 [F] its num_embeddings (-1: unbounded)
    table_names: list[str] = field(init=False)
    # `indexes` and `table_bounds`' tensors by device: made once, never copied per step (on a
    # GPU each upload from the host is a blocking copy).
    _on_device: dict[torch.device, tuple[torch.Tensor, ...]] = field(init=False, repr=False)
    _fused_starts: dict[tuple[torch.device, int], torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.table_index = torch.tensor([t.index for t in self.feature_table])
        self.table_rows = torch.tensor(
            [-1 if t.num_embeddings is None else t.num_embeddings for t in self.feature_table]
        )
        self.table_names = [t.name for t in self.feature_table]
        self._on_device = {}
        self._fused_starts = {}

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(table_index, table_rows, table_starts_unshifted)`` on ``device``, made once."""
        found = self._on_device.get(device)
        if found is None:
            starts = torch.tensor([t.index for t in self.tables])
            found = tuple(t.to(device) for t in (self.table_index, self.table_rows, starts))
            self._on_device[device] = found
        return found

    def indexes(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`table_index` and `table_rows` on ``device`` (made on the first call for it)."""
        table_index, table_rows, _ = self._tensors(device)
        return table_index, table_rows

    @classmethod
    def of_tables(cls, dim: int, tables: list[Table]) -> CacheLayout:
        """The layout of ``tables`` (all of dim ``dim``): their features in table order, then
        stably sorted by pooling mode so that each mode is one `Lookup`."""
        triples = [
            (f, k, t) for t in tables for f, k in zip(t.feature_names, t.key_names, strict=True)
        ]
        # Stable: same-mode features contiguous (unpooled ones first; a collection holds one kind).
        triples.sort(key=lambda p: -1 if p[2].pooling is None else int(p[2].pooling))
        lookups: list[Lookup] = []
        for i, (f, _, t) in enumerate(triples):
            if lookups and lookups[-1].mode == t.pooling:
                lookups[-1].features.append(f)
                lookups[-1].feature_hi = i + 1
            else:
                lookups.append(Lookup(t.pooling, [f], i, i + 1))
        return cls(
            dim,
            tables,
            [f for f, _, _ in triples],
            [t for _, _, t in triples],
            lookups,
            [k for _, k, _ in triples],
        )

    @property
    def pooled(self) -> bool:
        """Whether the cache's lookups pool bags (else each value gets its row: sequences)."""
        return self.lookups[0].mode is not None

    def value_cuts(self, per_feature: list[int]) -> list[int] | None:
        """`Prepared.cuts` from the number of values of each feature (host ints, in this
        layout's order); None with one lookup (nothing to cut)."""
        if len(self.lookups) == 1:
            return None
        starts = [0]
        for n in per_feature:
            starts.append(starts[-1] + n)
        return [starts[lk.feature_lo] for lk in self.lookups] + [starts[-1]]

    def table_bounds(self, unique: torch.Tensor, fusion_k: int) -> list[int]:
        """Where each table's ids start in ascending fused ``unique`` ids (``[T + 1]``, the last
        entry ``len(unique)``): table i owns ``unique[bounds[i] : bounds[i + 1]]``. One host
        read, none for a cache of one table; `bounds_together` reads several caches' at once."""
        return bounds_together([(self, unique, fusion_k)])[0]

    def fused_starts(self, device: torch.device, fusion_k: int) -> torch.Tensor | None:
        """The fused id each table's ids start at (int64 ``[T]`` on ``device``, made once),
        or None for a cache of one table."""
        if len(self.tables) == 1:
            return None
        key = (device, fusion_k)
        found = self._fused_starts.get(key)
        if found is None:
            found = self._fused_starts[key] = self._tensors(device)[2] << fusion_k
        return found

    def table_starts(self, unique: torch.Tensor, fusion_k: int) -> torch.Tensor | None:
        """The first ``T`` entries of `table_bounds` as a device tensor (no host read), or
        None for a cache of one table (they are ``[0]``)."""
        starts = self.fused_starts(unique.device, fusion_k)
        return None if starts is None else torch.searchsorted(unique, starts)

    def bags(
        self,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        batch_size: int,
        columns: torch.Tensor,
        column_start: int | None = None,
        cuts: list[int] | None = None,
    ) -> list[Bags]:
        """A batch's bags of this cache, cut per lookup (with several lookups, at ``cuts``, or
        else where one host read of the offsets says).

        Args:
            inverse: int64 ``[nnz]`` unique-id index of each value (features in this layout's
                order).
            offsets: int64 ``[F * B + 1]`` bag offsets.
            weights: float32 ``[nnz]`` per-sample weights, or None.
            batch_size: B.
            columns: int64 ``[F]`` first output column of each feature.
            column_start: when known, ``columns`` is ``column_start + dim * arange(F)``.
            cuts: the value where each lookup starts, then nnz (`Prepared.cuts`), or None.
        """
        if len(self.lookups) == 1:
            return [Bags(inverse, offsets, weights, columns, column_start)]
        B = batch_size
        if cuts is None:
            cut = [lk.feature_lo * B for lk in self.lookups] + [offsets.numel() - 1]
            bounds = offsets[cut].tolist()
        else:
            bounds = cuts
        out = []
        for i, lk in enumerate(self.lookups):
            lo, hi = bounds[i], bounds[i + 1]
            out.append(
                Bags(
                    inverse[lo:hi],
                    offsets[lk.feature_lo * B : lk.feature_hi * B + 1] - lo,
                    None if weights is None else weights[lo:hi],
                    columns[lk.feature_lo : lk.feature_hi],
                    None if column_start is None else column_start + lk.feature_lo * self.dim,
                )
            )
        return out


def bounds_together(
    items: Sequence[tuple[CacheLayout, torch.Tensor, int]],
) -> list[list[int]]:
    """`CacheLayout.table_bounds` of several ``(layout, unique, fusion_k)`` in one host read
    (none when every cache holds one table): a backward's trace cuts every cache's ids."""
    starts = [layout.table_starts(unique, k) for layout, unique, k in items]
    read = [t for t in starts if t is not None]
    values = torch.cat(read).tolist() if read else []
    out, at = [], 0
    for (_, unique, _), t in zip(items, starts, strict=True):
        if t is None:
            out.append([0, unique.numel()])
        else:
            out.append([*values[at : at + t.numel()], unique.numel()])
            at += t.numel()
    return out
