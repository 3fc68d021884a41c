# ruff: noqa: N999 (RecStore's module name, kept so that only the import prefix changes)
"""RecStore's ``recstore/KVClient.py``: `get_kv_client` and the client class, whose RecStore
name is ``RecStoreClient`` (here a plain class: ``get_kv_client()`` gives the process's one,
as RecStore's singleton constructor does)."""

from embcache.recstore.kv_client import KVClient, KVHandle, KVOptimizer, get_kv_client

RecStoreClient = KVClient

__all__ = ["KVClient", "KVHandle", "KVOptimizer", "RecStoreClient", "get_kv_client"]
