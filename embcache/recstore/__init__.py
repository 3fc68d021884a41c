"""The RecStore compatibility layer: RecStore's names over embcache's caches and tiers.

* `RecStoreEmbeddingBagCollection` (``embedding_bag_configs, lr, enable_fusion, fusion_k``), the
  cached collection under RecStore's name, with ``issue_fused_prefetch`` /
  ``set_fused_prefetch_handle``;
* `get_kv_client()` / `KVClient` (``init_data, pull, push, update_async, wait, flush, prefetch,
  wait_and_get``) over a tier, `DistTensor` (``__getitem__`` pulls, ``__setitem__`` pushes) and
  `DistEmbedding`, the single-table module updated in Python by `SparseSGD`.
"""

from embcache.recstore.collection import RecStoreEmbeddingBagCollection
from embcache.recstore.dist_embedding import DistEmbedding
from embcache.recstore.dist_tensor import DistTensor
from embcache.recstore.kv_client import KVClient, KVHandle, get_kv_client, reset_kv_client

__all__ = [
    "DistEmbedding",
    "DistTensor",
    "KVClient",
    "KVHandle",
    "RecStoreEmbeddingBagCollection",
    "get_kv_client",
    "reset_kv_client",
]
