"""The RecStore compatibility layer: RecStore's names over embcache's caches and tiers.

* `RecStoreEmbeddingBagCollection` (``embedding_bag_configs, lr, enable_fusion, fusion_k``, and
  ``ps_host``/``ps_port``/``kv_client``), the cached collection under RecStore's name, with
  ``issue_fused_prefetch`` / ``set_fused_prefetch_handle`` (asynchronous, leak-proof handles),
  ``reset_trace``, ``embedding_bag_configs()`` and ``kv_client``, through which its tables are
  read and written coherently with its caches;
* `RecStoreEmbeddingCollection` (``embedding_configs``, then the same keywords), the cached
  sequence collection (one row per id) under the same conventions, its tables tensors of its
  ``kv_client`` too;
* `get_kv_client()` / `KVClient` (``init_data, pull, push, update_async, add_async, wait, flush,
  prefetch, wait_and_get``) over a tier, whose ``update_async`` hands gradients to a backend
  optimizer (`KVOptimizer`: SGD, AdaGrad, RowWiseAdaGrad, state beside the rows);
* `DistTensor` (``__getitem__`` pulls, ``__setitem__`` pushes) and `DistEmbedding`, the
  single-table module updated in Python by `SparseSGD`, saved in ``state_dict()`` and
  checkpoints.

RecStore's module paths are here too (``embcache.recstore.DistEmb``, ``.DistTensor``,
``.KVClient``, ``.optimizer``; ``embcache.torchrec_kv.EmbeddingBag``), so RecStore code changes
only its import prefix. They are imported below, before the classes are bound: a submodule
imported later would replace the package's ``KVClient`` / ``DistTensor`` class with itself.
"""

import embcache.recstore.DistEmb
import embcache.recstore.DistTensor
import embcache.recstore.KVClient
import embcache.recstore.optimizer  # noqa: F401
from embcache.recstore.collection import (
    RecStoreEmbeddingBagCollection,
    RecStoreEmbeddingCollection,
)
from embcache.recstore.dist_embedding import DistEmbedding
from embcache.recstore.dist_tensor import DistTensor
from embcache.recstore.kv_client import (
    KVClient,
    KVHandle,
    KVLearningRateWarning,
    KVOptimizer,
    get_kv_client,
    reset_kv_client,
)

__all__ = [
    "DistEmbedding",
    "DistTensor",
    "KVClient",
    "KVHandle",
    "KVLearningRateWarning",
    "KVOptimizer",
    "RecStoreEmbeddingBagCollection",
    "RecStoreEmbeddingCollection",
    "get_kv_client",
    "reset_kv_client",
]
