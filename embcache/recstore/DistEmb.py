# ruff: noqa: N999 (RecStore's module name, kept so that only the import prefix changes)
"""RecStore's ``recstore/DistEmb.py``: `DistEmbedding` under its module path."""

from embcache.recstore.dist_embedding import DistEmbedding

__all__ = ["DistEmbedding"]
