"""The device cache: slots, set-associative index, policy, locks, write-back.

The public names are imported on first use (PEP 562), so that the policies' names
(`embcache.cache.policy_registry`, which the command line's parser reads) come without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embcache.cache.config import CacheConfig, CachePolicy
    from embcache.cache.hot_cache import HotCache
    from embcache.cache.sizing import CacheOverflowWarning

_HOMES = {
    "CacheConfig": "embcache.cache.config",
    "CacheOverflowWarning": "embcache.cache.sizing",
    "CachePolicy": "embcache.cache.config",
    "HotCache": "embcache.cache.hot_cache",
}

__all__ = ["CacheConfig", "CacheOverflowWarning", "CachePolicy", "HotCache"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
