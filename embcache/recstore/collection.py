"""RecStore's name and signature for the cached collection."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from embcache.engine.tables import TableConfig
from embcache.models.collection import CachedEmbeddingBagCollection


class RecStoreEmbeddingBagCollection(CachedEmbeddingBagCollection):
    """RecStore's name and signature for the same collection.

    Args:
        embedding_bag_configs: TableConfig or EmbeddingBagConfig objects, or dicts.
        lr: learning rate a sparse optimizer uses when given none.
        enable_fusion, fusion_k: as in `CachedEmbeddingBagCollection`.
        **kwargs: any other `CachedEmbeddingBagCollection` argument.
    """

    def __init__(
        self,
        embedding_bag_configs: Sequence[TableConfig | Mapping[str, Any] | Any],
        lr: float = 0.01,
        enable_fusion: bool = True,
        fusion_k: int = 30,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            tables=embedding_bag_configs,
            lr=lr,
            enable_fusion=enable_fusion,
            fusion_k=fusion_k,
            **kwargs,
        )
