"""Several processes: row-wise sharding of cached collections over torch.distributed
(`ShardedEmbeddingBagCollection`, `ShardedEmbeddingCollection`, `ShardedKVClient`) and the
launcher (`spawn`)."""

from embcache.distributed.launch import SpawnError, spawn
from embcache.distributed.sharded import (
    CollectiveError,
    ShardedEmbeddingBagCollection,
    ShardedKVClient,
    kv_owner_of,
    owner_of,
)
from embcache.distributed.sharded_sequence import ShardedEmbeddingCollection

__all__ = [
    "CollectiveError",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardedKVClient",
    "SpawnError",
    "kv_owner_of",
    "owner_of",
    "spawn",
]
