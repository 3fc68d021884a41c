"""embcache: a GPU-resident embedding cache for training recommendation models.

Tables far larger than the device live in a backing tier (host memory by default, Redis when
shared or persistent); the rows a batch needs sit in a fixed-size cache on the device, where
kernels dedup ids, pool bags and apply the optimizer in place. Dirty rows are written back on
eviction or flush.
"""

from embcache.cache import CacheConfig, CacheOverflowWarning, CachePolicy, HotCache
from embcache.checkpoint import load, save
from embcache.data import Batch, SyntheticConfig, SyntheticCriteo
from embcache.distributed import ShardedEmbeddingBagCollection
from embcache.engine import JaggedBatch, PooledEmbeddings, TableConfig
from embcache.kernels.pooling import PoolingMode
from embcache.kv import (
    HostKV,
    Store,
    TableSpec,
    TierDataLossError,
    TierError,
    TierOwnershipError,
    TierUnavailableError,
    open_store,
)
from embcache.models import DLRM, CachedEmbeddingBagCollection, FusedPrefetchHandle
from embcache.optim import (
    SparseAdaGrad,
    SparseAdam,
    SparseOptimizer,
    SparseRowWiseAdaGrad,
    SparseRowWiseAdagrad,
    SparseSGD,
)
from embcache.recstore import (
    DistEmbedding,
    DistTensor,
    KVClient,
    KVOptimizer,
    RecStoreEmbeddingBagCollection,
    get_kv_client,
    reset_kv_client,
)
from embcache.train.pipeline import PrefetchFallbackWarning, TrainPipeline

__version__ = "0.1.0"

__all__ = [
    "DLRM",
    "Batch",
    "CacheConfig",
    "CacheOverflowWarning",
    "CachePolicy",
    "CachedEmbeddingBagCollection",
    "DistEmbedding",
    "DistTensor",
    "FusedPrefetchHandle",
    "HostKV",
    "HotCache",
    "JaggedBatch",
    "KVClient",
    "KVOptimizer",
    "PooledEmbeddings",
    "PoolingMode",
    "PrefetchFallbackWarning",
    "RecStoreEmbeddingBagCollection",
    "ShardedEmbeddingBagCollection",
    "SparseAdaGrad",
    "SparseAdam",
    "SparseOptimizer",
    "SparseRowWiseAdaGrad",
    "SparseRowWiseAdagrad",
    "SparseSGD",
    "Store",
    "SyntheticConfig",
    "SyntheticCriteo",
    "TableConfig",
    "TableSpec",
    "TierDataLossError",
    "TierError",
    "TierOwnershipError",
    "TierUnavailableError",
    "TrainPipeline",
    "get_kv_client",
    "load",
    "open_store",
    "reset_kv_client",
    "save",
]
