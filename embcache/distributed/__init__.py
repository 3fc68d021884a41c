"""Several processes: row-wise sharding of cached collections over torch.distributed
(`ShardedEmbeddingBagCollection`, `ShardedKVClient`) and the launcher (`spawn`)."""

from embcache.distributed.launch import SpawnError, spawn
from embcache.distributed.sharded import (
    CollectiveError,
    ShardedEmbeddingBagCollection,
    ShardedKVClient,
    kv_owner_of,
    owner_of,
)

__all__ = [
    "CollectiveError",
    "ShardedEmbeddingBagCollection",
    "ShardedKVClient",
    "SpawnError",
    "kv_owner_of",
    "owner_of",
    "spawn",
]
