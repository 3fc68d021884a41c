"""How a collection lays out its features over its caches: one `_CacheGroup` per embedding dim,
its features ordered so that those sharing a pooling mode form one contiguous `_Lookup`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embcache.cache.hot_cache import HotCache
from embcache.engine.tables import Table
from embcache.kernels.pooling import PoolingMode


@dataclass
class _Lookup:
    """The features of one cache that share a pooling mode, laid out contiguously."""

    mode: PoolingMode
    features: list[str]
    feature_lo: int  # first feature of this lookup within its cache's feature order
    feature_hi: int


@dataclass
class _CacheGroup:
    """The tables of one embedding dim, their cache, and their features in lookup order."""

    dim: int
    cache: HotCache
    tables: list[Table]
    features: list[str]
    feature_table: list[Table]
    lookups: list[_Lookup]
    table_index: torch.Tensor = field(init=False)  # int64 [F] table of each feature
    table_rows: torch.Tensor = field(init=False)  # int64 [F] num_embeddings of that table
    table_names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.table_index = torch.tensor([t.index for t in self.feature_table])
        self.table_rows = torch.tensor([t.num_embeddings for t in self.feature_table])
        self.table_names = [t.name for t in self.feature_table]

    def table_bounds(self, unique: torch.Tensor, fusion_k: int) -> list[int]:
        """Where each table's ids start in ascending fused ``unique`` ids (``[T + 1]``, the last
        entry ``len(unique)``): table i owns ``unique[bounds[i] : bounds[i + 1]]``."""
        starts = torch.tensor([t.index << fusion_k for t in self.tables], device=unique.device)
        return [*torch.searchsorted(unique, starts).tolist(), unique.numel()]

    @classmethod
    def of_tables(cls, dim: int, cache: HotCache, tables: list[Table]) -> _CacheGroup:
        """The group of ``tables`` (all of dim ``dim``) over ``cache``: their features in table
        order, then stably sorted by pooling mode so that each mode is one `_Lookup`."""
        pairs = [(f, t) for t in tables for f in t.feature_names]
        pairs.sort(key=lambda p: int(p[1].pooling))  # stable: same-mode features contiguous
        lookups: list[_Lookup] = []
        for i, (f, t) in enumerate(pairs):
            if lookups and lookups[-1].mode == t.pooling:
                lookups[-1].features.append(f)
                lookups[-1].feature_hi = i + 1
            else:
                lookups.append(_Lookup(t.pooling, [f], i, i + 1))
        return cls(dim, cache, tables, [f for f, _ in pairs], [t for _, t in pairs], lookups)
