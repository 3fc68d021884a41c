"""Several processes: the RecStore-style KV client and DistTensor, and row-wise sharding of
cached collections over torch.distributed (`ShardedEmbeddingBagCollection`, `spawn`)."""

from embcache.distributed.dist_tensor import DistTensor
from embcache.distributed.kv_client import KVClient, KVHandle, get_kv_client, reset_kv_client
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
    "DistTensor",
    "KVClient",
    "KVHandle",
    "ShardedEmbeddingBagCollection",
    "ShardedKVClient",
    "SpawnError",
    "get_kv_client",
    "kv_owner_of",
    "owner_of",
    "reset_kv_client",
    "spawn",
]
