"""The modules users train with: the cached collection and the DLRM model built on it."""

from embcache.engine.batch_state import FusedPrefetchHandle
from embcache.models.collection import CachedEmbeddingBagCollection
from embcache.models.dlrm import DLRM

__all__ = ["DLRM", "CachedEmbeddingBagCollection", "FusedPrefetchHandle"]
