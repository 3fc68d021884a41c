"""How many slots a cache gets, and whether the device can hold them.

A slot costs its row (``dim + state_dim`` float32) plus its key, lock, score and dirty flag; an
LFU cache also keeps one int64 count per row of its tables. `cache_capacity` sizes a cache from
its `CacheConfig` (the default, with neither a capacity nor a load factor, caches the whole
table only when its slots fit the memory budget, and says so once in the log when they do not);
`check_fits` refuses, before anything is allocated, a cache the device cannot hold at all;
`warn_overflow` says when one batch has more unique rows than the cache has slots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from types import FrameType

import torch

from embcache.cache.config import WIDEST_STATE, CacheConfig, device_memory, slot_bytes

logger = logging.getLogger("embcache.cache")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # embcache/
# The standard library's frames between embcache's own: a thread's start, and the `__enter__`
# of a `contextlib.contextmanager` the library enters (a step's phases).
_PLUMBING = (threading.__file__, contextlib.__file__)
_LIBRARY = (_PACKAGE, os.path.dirname(torch.__file__) + os.sep)  # torch: nn.Module.__call__


class CacheOverflowWarning(UserWarning):
    """A batch has more unique rows than the cache has slots: the rest goes through the
    scratch area on every such batch (exact, but each one is a tier read and write)."""


def cache_capacity(
    config: CacheConfig, total_rows: int | None, dim: int, device: torch.device, what: str
) -> int:
    """Rows a cache of ``what`` (its tables, for the log) holds: `CacheConfig.rows_for`. Logs
    once when the memory budget keeps the cache below the whole table."""
    widest = slot_bytes((1 + WIDEST_STATE) * dim)
    capacity = config.rows_for(total_rows, dim, device)
    by_budget = config.capacity is None and config.load_factor is None
    if by_budget and total_rows is not None and capacity < total_rows:
        logger.warning(
            "embcache: the %s rows of %s (dim %d) need %.2f GiB of %s slots, over the cache's "
            "memory budget of %.2f GiB: caching %s rows (load factor %.3g). Give "
            "CacheConfig(capacity=..., load_factor=... or memory_budget=...) to choose.",
            f"{total_rows:,}",
            what,
            dim,
            total_rows * widest / 2**30,
            device.type,
            config.budget(device) / 2**30,
            f"{capacity:,}",
            capacity / total_rows,
        )
    return capacity


def check_fits(
    num_slots: int, width: int, lfu_counts: int, device: torch.device, what: str, dim: int
) -> None:
    """Refuse (ValueError), before anything is allocated, ``num_slots`` slots of ``width``
    values plus ``lfu_counts`` LFU counts that ``device`` cannot hold."""
    need = num_slots * slot_bytes(width) + 8 * lfu_counts
    have = device_memory(device)
    if need > have:
        counts = f" and {lfu_counts:,} LFU counts" if lfu_counts else ""
        raise ValueError(
            f"the cache of {what} (dim {dim}) needs {need:,} bytes of {device.type} memory "
            f"({num_slots:,} slots of {width} float32{counts}), more than the {have:,} bytes "
            "there; give CacheConfig(capacity=...) or a smaller load_factor"
        )


def warn_overflow(unique_rows: int, num_slots: int, what: str, dim: int) -> None:
    """The `CacheOverflowWarning` of a batch of ``unique_rows`` rows (the cache says it once)."""
    warnings.warn(
        f"a batch has {unique_rows:,} unique rows of {what} (dim {dim}), more than the "
        f"cache's {num_slots:,} slots: the overflow goes through the scratch area on every such "
        "batch (exact, but tier traffic); give the cache a capacity above one batch's unique "
        "rows. Said once per cache.",
        CacheOverflowWarning,
        stacklevel=_outside_stacklevel(),
    )


def _outside_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised here at the first caller outside the
    embcache package, torch and the plumbing between them (`_PLUMBING`): the user's forward;
    past the stack's end, which names no line, where every frame is theirs or the thread's
    start (a prefetch worker's)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1  # warn_overflow's frame is level 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(_LIBRARY) or frame.f_code.co_filename in _PLUMBING
    ):
        frame, level = frame.f_back, level + 1
    return level
