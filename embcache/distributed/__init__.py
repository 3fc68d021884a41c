"""The RecStore-style KV client and DistTensor (row-wise sharding over torch.distributed: later)."""

from embcache.distributed.dist_tensor import DistTensor
from embcache.distributed.kv_client import KVClient, KVHandle, get_kv_client, reset_kv_client

__all__ = ["DistTensor", "KVClient", "KVHandle", "get_kv_client", "reset_kv_client"]
