"""torchrec's distributed engine over embcache's caches (needs torchrec; ``import embcache``
does not import this package).

* `CachedEmbeddingBagCollectionSharder`: a torchrec ``ModuleSharder`` whose ``module_type`` is
  `embcache.CachedEmbeddingBagCollection`; ``DistributedModelParallel(model,
  sharders=[...], plan=...)`` shards it table-, row- or column-wise, each rank's shards on
  embcache's cache (`kernel.CachedBagKernel`) over a tier of its own.
* `CachedParameterConstraints`: torchrec's ``ParameterConstraints`` plus the cache's options
  (load factor or rows, policy, ways, tier URL).
* `CachedEmbeddingShardingPlanner`: torchrec's planner whose storage estimate counts each
  shard's cache on the compute device (`CachedStorageEstimator`), not the whole table.
  torchrec's own ``EmbeddingShardingPlanner`` plans embcache's collections too: to it their
  sharders name the kernel the cache stands in for (``fused`` on a CPU, ``fused_uvm_caching``
  on CUDA; `CachedKernelSharder`), a plan's ``cache_params.load_factor`` sizes the caches, and
  the tables train on the cache all the same.

* `CachedEmbeddingCollectionSharder`: the same for `embcache.CachedEmbeddingCollection`
  (sequence embeddings, one row per id).
* `CachingEmbeddingBagCollectionSharder`: torchrec's own ``EmbeddingBagCollection`` with the
  tables its constraints name in the cache, the rest on torchrec's kernels (the cache there
  needs `CachedEmbeddingShardingPlanner`; torchrec's planner plans torchrec's kernels only).

Other sharders (torchrec's own for its ``EmbeddingBagCollection``) go in the same list, so one
model can hold both kinds of collection.
"""

from embcache.torchrec.constraints import (
    CACHED_KERNEL,
    CachedEmbeddingShardingPlanner,
    CachedEnumerator,
    CachedKernelSharder,
    CachedParameterConstraints,
    CachedPerfEstimator,
    CachedStorageEstimator,
    ShardCacheOptions,
)
from embcache.torchrec.kernel import (
    CachedBagKernel,
    CachedPooledLookup,
    CachedSequenceKernel,
    CachedSequenceLookup,
    KernelOptimizer,
    ShardState,
)
from embcache.torchrec.sequence import (
    CachedEmbeddingCollectionSharder,
    ShardedCachedEmbeddingCollection,
)
from embcache.torchrec.sharder import (
    CachedEmbeddingBagCollectionSharder,
    CachingEmbeddingBagCollectionSharder,
    ShardedCachedEmbeddingBagCollection,
)

__all__ = [
    "CACHED_KERNEL",
    "CachedBagKernel",
    "CachedEmbeddingBagCollectionSharder",
    "CachedEmbeddingCollectionSharder",
    "CachedEmbeddingShardingPlanner",
    "CachedEnumerator",
    "CachedKernelSharder",
    "CachedParameterConstraints",
    "CachedPerfEstimator",
    "CachedPooledLookup",
    "CachedSequenceKernel",
    "CachedSequenceLookup",
    "CachedStorageEstimator",
    "CachingEmbeddingBagCollectionSharder",
    "KernelOptimizer",
    "ShardCacheOptions",
    "ShardState",
    "ShardedCachedEmbeddingBagCollection",
    "ShardedCachedEmbeddingCollection",
]
