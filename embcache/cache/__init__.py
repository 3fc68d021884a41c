"""The device cache: slots, set-associative index, policy, locks, write-back."""

from embcache.cache.config import CacheConfig, CachePolicy
from embcache.cache.hot_cache import HotCache

__all__ = ["CacheConfig", "CachePolicy", "HotCache"]
