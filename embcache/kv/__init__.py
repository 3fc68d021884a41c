"""The tiers behind the device cache: the `Store` protocol and its implementations.

`HostKV` (in-process host memory, the default), `RedisKV` (a Redis server or cluster),
`TieredKV` (a host-memory write-back row cache in front of a slower store); `open_store` builds
one from a URL.
"""

from embcache.kv.base import RowInit, ScorePolicy, Store, TableSpec, default_init
from embcache.kv.bounded import TierCapacityError
from embcache.kv.errors import (
    TierAuthError,
    TierCommandError,
    TierConfigError,
    TierDataLossError,
    TierError,
    TierFullError,
    TierOwnershipError,
    TierUnavailableError,
)
from embcache.kv.host import HostKV
from embcache.kv.tier_state import TableState, TierState, expect_tier_state, tier_state
from embcache.kv.url import open_store, redis_kv_class

__all__ = [
    "HostKV",
    "RowInit",
    "ScorePolicy",
    "Store",
    "TableSpec",
    "TableState",
    "TierAuthError",
    "TierCapacityError",
    "TierCommandError",
    "TierConfigError",
    "TierDataLossError",
    "TierError",
    "TierFullError",
    "TierOwnershipError",
    "TierState",
    "TierUnavailableError",
    "default_init",
    "expect_tier_state",
    "open_store",
    "tier_state",
]


def __getattr__(name: str):
    # The Redis tiers import redis-py; load them only when asked for.
    if name == "RedisKV":
        redis_kv_class()  # a clear ImportError when redis-py is missing
        from embcache.kv import redis_kv

        return getattr(redis_kv, name)
    if name == "TieredKV":
        from embcache.kv.tiered import TieredKV

        return TieredKV
    raise AttributeError(f"module 'embcache.kv' has no attribute {name!r}")
