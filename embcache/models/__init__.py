"""The modules users train with: cached collections (TorchRec and RecStore style) and
DistEmbedding."""

from embcache.models.collection import (
    CachedEmbeddingBagCollection,
    FusedPrefetchHandle,
    RecStoreEmbeddingBagCollection,
)
from embcache.models.dist_embedding import DistEmbedding

__all__ = [
    "CachedEmbeddingBagCollection",
    "DistEmbedding",
    "FusedPrefetchHandle",
    "RecStoreEmbeddingBagCollection",
]
