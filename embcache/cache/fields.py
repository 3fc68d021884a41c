"""What the parts of a `HotCache` share, declared once: the attributes its constructor and
`storage.SlotRows._allocate` set, and the methods one part calls on another.

`SetPlan`, `DirectMapping`, `ScratchArea`, `SlotLocks`, `SlotRows` and `PolicyState` are base
classes of `HotCache` that read and set the cache's own state; each derives from `CacheFields`,
so a type checker knows that state in every one of them and checks each method that one part
defines against what the others call. At run time the class holds annotations only: the
attributes are set on the cache, and the methods declared here are those of its parts.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from embcache.backend import Backend
from embcache.cache.config import CacheConfig
from embcache.cache.dedup import RowDedup
from embcache.cache.policy import EvictionPolicy
from embcache.cache.sketch import Admission, LfuCounts
from embcache.cache.transfer import Staged, TierTransfer
from embcache.kv.base import Store, TableSpec


class CacheFields:
    """The state of a `HotCache` (see its docstring for what each holds)."""

    # Set once by `HotCache.__init__` (``state_dim`` and ``_specs`` also by `set_state`).
    dim: int
    dtype: torch.dtype
    state_dim: int
    config: CacheConfig
    policy: str  # the eviction policy's registered name
    store: Store
    transfer: TierTransfer
    device: torch.device
    backend: Backend
    device_path: bool
    fusion_k: int
    pins: bool
    direct: bool
    ways: int
    num_sets: int
    num_slots: int
    eviction: EvictionPolicy
    dedup: RowDedup
    lock: threading.RLock
    storage_lock: threading.RLock
    _resolve_mutex: threading.RLock
    _specs: dict[int, TableSpec]
    _row_offset: torch.Tensor
    _key_limits: torch.Tensor
    _index_rows: int
    _counts: LfuCounts | None
    _admission: Admission | None

    # The slot storage and the arrays beside it (`storage.SlotRows._allocate`).
    weights: torch.Tensor
    state: torch.Tensor
    slot_keys: torch.Tensor
    locks: torch.Tensor
    dirty: torch.Tensor
    scores: torch.Tensor
    batch_of: torch.Tensor
    _where: torch.Tensor | None
    _filled: bool

    # Clocks, counters and per-batch state.
    _tick: int
    _lookups: int
    _batch_seq: int
    _scratch_used: int
    _seen: torch.Tensor | None
    _seen_batch: int
    _served: int
    _stamps: torch.Tensor | None
    _deferred: list[Staged]
    hits: int
    misses: int
    evictions: int
    writebacks: int
    admissions_refused: int
    gradients_dropped: int

    if TYPE_CHECKING:
        # Defined by one part (or `HotCache`) and called by another.

        @property
        def width(self) -> int: ...  # storage.SlotRows

        @property
        def scratch_rows(self) -> int: ...  # storage.SlotRows

        def row_index(self, keys: torch.Tensor) -> torch.Tensor: ...  # HotCache

        def write_deferred(self) -> None: ...  # HotCache

        def invalidate(self) -> None: ...  # HotCache

        def _touch(
            self, ids: torch.Tensor, slots: torch.Tensor, n_main: int | None = None
        ) -> None: ...  # HotCache

        def _lookup(self, ids: torch.Tensor) -> torch.Tensor: ...  # plan.SetPlan

        def _empty_ids(self) -> torch.Tensor: ...  # plan.SetPlan

        def _grow_scratch(self, needed_free: int) -> None: ...  # scratch.ScratchArea

        def _find_in_scratch(
            self, ids: torch.Tensor, slots: torch.Tensor
        ) -> None: ...  # scratch.ScratchArea

        def _live(
            self, slots: torch.Tensor, n_live: int | None = None
        ) -> torch.Tensor: ...  # locks.SlotLocks

        def rows_of(self, slots: torch.Tensor) -> torch.Tensor: ...  # storage.SlotRows

        def _allocate(self, scratch_rows: int) -> None: ...  # storage.SlotRows

        def _index(self, keys: torch.Tensor, slots: torch.Tensor) -> None: ...  # SlotRows

        def _unindex(self, keys: torch.Tensor) -> None: ...  # storage.SlotRows

        def _reindex(self) -> None: ...  # storage.SlotRows

        def _write_host(self, host: torch.Tensor, slots: torch.Tensor) -> None: ...  # SlotRows
