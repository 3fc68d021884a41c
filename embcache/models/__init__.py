"""The modules users train with: the cached collections (bags, sequences) and the models built
on them (DLRM, a sequence recommender)."""

from embcache.engine.batch_state import FusedPrefetchHandle
from embcache.models.collection import CachedEmbeddingBagCollection
from embcache.models.dlrm import DLRM
from embcache.models.sequence import CachedEmbeddingCollection
from embcache.models.sequence_model import SequenceRecommender

__all__ = [
    "DLRM",
    "CachedEmbeddingBagCollection",
    "CachedEmbeddingCollection",
    "FusedPrefetchHandle",
    "SequenceRecommender",
]
