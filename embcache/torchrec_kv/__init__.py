"""RecStore's ``torchrec_kv`` package path: ``from embcache.torchrec_kv.EmbeddingBag import
RecStoreEmbeddingBagCollection`` (RecStore: ``from torchrec_kv.EmbeddingBag import ...``)."""

from embcache.recstore.collection import RecStoreEmbeddingBagCollection

__all__ = ["RecStoreEmbeddingBagCollection"]
