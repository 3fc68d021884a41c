# ruff: noqa: N999 (RecStore's module name, kept so that only the import prefix changes)
"""RecStore's ``torchrec_kv/EmbeddingBag.py``: the collection under its module path."""

from embcache.recstore.collection import RecStoreEmbeddingBagCollection

__all__ = ["RecStoreEmbeddingBagCollection"]
