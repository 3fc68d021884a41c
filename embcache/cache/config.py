"""Configuration of a device cache: how many rows, which eviction policy, how associative."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from embcache.kv.base import host_memory_bytes

CPU_MEMORY_BUDGET = 1 << 30  # bytes of slots a default cache takes on the CPU
GPU_MEMORY_FRACTION = 0.25  # ... and the fraction of a GPU's memory it takes there
SLOT_OVERHEAD = 8 + 4 + 1 + 8  # bytes of a slot besides its row: key, lock, dirty flag, score
WIDEST_STATE = 2  # state values per weight of the widest optimizer (Adam)


def slot_bytes(width: int) -> int:
    """Device bytes of one slot holding a row of ``width`` float32 values."""
    return 4 * width + SLOT_OVERHEAD


class CachePolicy(enum.Enum):
    """Which resident row a miss evicts.

    LRU evicts the way of its set used longest ago. LFU evicts the way whose row has been asked
    for least often; frequencies are kept per row of the whole table (as FBGEMM does), so they
    survive eviction and the cache converges to the most frequent rows.
    """

    LRU = "lru"
    LFU = "lfu"


@dataclass
class CacheConfig:
    """Size and policy of the device cache of a collection (one cache per embedding dim).

    Attributes:
        capacity: rows held on the device, per cache. Mutually exclusive with ``load_factor``.
        load_factor: capacity as a fraction of the rows of the tables a cache serves.
            With neither given, the whole table is cached when its slots fit
            ``memory_budget``; otherwise the cache holds the rows that fit (a load factor
            below 1, said once in the log).
        memory_budget: bytes the slots of a cache may take when neither ``capacity`` nor
            ``load_factor`` is given, each slot counted at its widest (weights, Adam's two
            state values per weight, its key, lock, score and dirty flag). None: a quarter of
            a GPU's memory, 1 GiB on the CPU.
        policy: ``"lru"`` or ``"lfu"`` (or a `CachePolicy`).
        ways: associativity: slots per set. A capacity below ``ways`` gives one set.
        max_scratch_rows: bound on the scratch area that serves the rows of a batch that find
            no free way in their set (or do not fit the cache at all). It grows on demand up to
            this many rows; a batch needing more is refused with an error saying what to set.
        lfu_decay: LFU only: every ``lfu_decay_interval`` lookups all frequencies are multiplied
            by this factor (0 < decay < 1), for traffic whose popular ids drift. None: no decay.
        lfu_decay_interval: lookups (batches) between two decays.

    A capacity at least the number of rows of a cache's (bounded) tables maps every row to its
    own slot: nothing is ever evicted and no lookup is needed.
    """

    capacity: int | None = None
    load_factor: float | None = None
    policy: CachePolicy | str = CachePolicy.LRU
    ways: int = 32
    memory_budget: int | None = None
    max_scratch_rows: int = 1 << 20
    lfu_decay: float | None = None
    lfu_decay_interval: int = 1000

    def __post_init__(self) -> None:
        if self.capacity is not None and self.load_factor is not None:
            raise ValueError("CacheConfig: give capacity or load_factor, not both")
        if self.capacity is not None and (
            isinstance(self.capacity, bool) or not isinstance(self.capacity, int)
        ):
            raise TypeError(f"CacheConfig.capacity must be an int, got {self.capacity!r}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"CacheConfig.capacity must be >= 1 row, got {self.capacity}")
        if self.load_factor is not None and not (0.0 < float(self.load_factor) <= 1.0):
            raise ValueError(f"CacheConfig.load_factor must be in (0, 1], got {self.load_factor}")
        try:
            self.policy = CachePolicy(
                self.policy.lower() if isinstance(self.policy, str) else self.policy
            )
        except ValueError:
            raise ValueError(
                f"CacheConfig.policy must be 'lru' or 'lfu', got {self.policy!r}"
            ) from None
        if self.memory_budget is not None and (
            isinstance(self.memory_budget, bool)
            or not isinstance(self.memory_budget, int)
            or self.memory_budget < 1
        ):
            raise ValueError(
                f"CacheConfig.memory_budget must be an int >= 1 (bytes), got {self.memory_budget!r}"
            )
        if not isinstance(self.ways, int) or self.ways < 1:
            raise ValueError(f"CacheConfig.ways must be an int >= 1, got {self.ways!r}")
        if not isinstance(self.max_scratch_rows, int) or self.max_scratch_rows < 0:
            raise ValueError(
                f"CacheConfig.max_scratch_rows must be an int >= 0, got {self.max_scratch_rows!r}"
            )
        if self.lfu_decay is not None and not (0.0 < self.lfu_decay < 1.0):
            raise ValueError(f"CacheConfig.lfu_decay must be in (0, 1), got {self.lfu_decay}")
        if self.lfu_decay_interval < 1:
            raise ValueError("CacheConfig.lfu_decay_interval must be >= 1")

    def rows_for(
        self,
        table_rows: int | None,
        dim: int | None = None,
        device: torch.device | str = "cpu",
    ) -> int:
        """Capacity in rows for a cache serving ``table_rows`` rows (None: unbounded tables).

        With neither ``capacity`` nor ``load_factor`` and rows of ``dim`` weights, the rows
        whose slots fit `budget` on ``device``, each slot counted at its widest (weights and
        Adam's two state values per weight) so that attaching any optimizer keeps to it: all
        of them when they fit, at least one. Without ``dim``: all of them.
        """
        if self.capacity is not None:
            return self.capacity if table_rows is None else min(self.capacity, table_rows)
        if table_rows is None:
            raise ValueError(
                "CacheConfig: a cache serving an unbounded (hashed-id) table needs an explicit "
                "capacity; load_factor is a fraction of a known row count"
            )
        if self.load_factor is None and dim is not None:
            widest = slot_bytes((1 + WIDEST_STATE) * dim)
            return max(1, min(table_rows, self.budget(device) // widest))
        return max(1, math.ceil((self.load_factor or 1.0) * table_rows))

    def budget(self, device: torch.device | str) -> int:
        """``memory_budget``, or the default one on ``device`` (see the class docstring)."""
        if self.memory_budget is not None:
            return self.memory_budget
        device = torch.device(device)
        if device.type == "cuda":
            return int(GPU_MEMORY_FRACTION * device_memory(device))
        return CPU_MEMORY_BUDGET


def device_memory(device: torch.device | str) -> int:
    """Total bytes of memory of ``device``: a GPU's, or this machine's physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()
