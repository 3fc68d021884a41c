"""The device cache: slots, set-associative index, policy, locks, write-back."""

from embcache.cache.config import CacheConfig, CachePolicy
from embcache.cache.hot_cache import HotCache
from embcache.cache.sizing import CacheOverflowWarning

__all__ = ["CacheConfig", "CacheOverflowWarning", "CachePolicy", "HotCache"]
