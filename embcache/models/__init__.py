"""The modules users train with: the cached collection and the DLRM model built on it."""

from embcache.engine.batch_state import FusedPrefetchHandle
from embcache.models.collection import CachedEmbeddingBagCollection

__all__ = ["CachedEmbeddingBagCollection", "FusedPrefetchHandle"]
