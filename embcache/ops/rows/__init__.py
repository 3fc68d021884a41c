"""The rows family: a step's per-slot work on the device path, one launch for every cache.

* `RowsOps.lock_floors`: the lowest lock among each cache's slots, and `RowsOps.unlock`: one
  lock dropped from each and (``dirty``) its row marked dirty. A training step holds one lock
  on each slot its batch reads, in every cache of the collection (one cache per embedding dim).
  Before the step changes a row it checks that each slot it updates is locked (the lowest lock
  among a cache's slots, read with the step's one host read); after the update it drops those
  locks and marks the rows dirty. Cache by cache that is a gather and a min, then an index add
  and a scatter: four launches a cache. Here one table of device addresses (`SlotTable`: per
  cache its slots, their count, its locks and dirty flags) is uploaded once a step, and two
  kernels serve every cache. A slot of -1 (an id the cache did not admit) is skipped by both.
  The slots of one cache are distinct (a resolve's), and the locks are dropped by integer
  atomics, so the result does not depend on the order programs run in.
* `RowsOps.direct_slots`: direct mapping's slots, locked. A cache whose capacity covers every
  row of its tables gives row ``r`` of table ``t`` the slot ``row_offset[t] + r``
  (`cache.direct`); its plan for a batch's unique fused ids ``key = (t << fusion_k) | r`` is
  that slot, with one lock taken on it: in torch ops a shift, a gather, a mask and an add,
  then an index add on the locks, five launches a cache a step; one kernel here. The ids are
  distinct (a dedup's), so each slot gets one lock; the locks are taken by integer atomics.

The family also moves a cache's and a tier's rows and bookkeeping on the host, where the
compiled CPU passes (numba) take one pass for what torch dispatches as several ops:

* `RowsOps.fill_at`, `RowsOps.add_at`: a value written or added at positions of a 1-D tensor
  (a slot's keys, locks, dirty flags, scores); `RowsOps.copy_rows`: rows written at positions
  (``index_copy_``'s meaning), for the tier's tables and a cache's slots; `RowsOps.scatter_split`
  and `gather_join`: stored rows of float32 weights into a cache's weights and state, and
  out, one pass each instead of a copy per part;
* `RowsOps.unlock_slots`: one cache's locks dropped (and its rows marked dirty), checked in
  the same pass where `RowsOps.unlocks_checked` says so;
* `RowsOps.hashed_uniform`: the default initialiser's rows of new ids (`kv.base.hashed_init`);
* `RowsOps.group_by_table`: a tier transfer's fused ids grouped by table in one pass.

`RowsOps` is the family's protocol; its implementations are `spec.SpecRows` (torch, the
specification), `native.NativeRows` (the compiled CPU passes) and `triton.TritonRows` (the
Triton kernels), one of them bound per cache, tier table or initialiser by
`embcache.ops.registry`. Where the implementation is not `RowsOps.one_launch`, the cache keeps
its own torch code for a step's locks (per cache, through `RowsOps.unlock_slots`) and calls
none of the device path's three. Nothing outside `embcache.ops` imports an implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

INT32_MAX = 2**31 - 1
# A table row: slots' address, their count, the locks' address, the dirty flags' address.
_FIELDS = 4


@dataclass
class SlotTable:
    """Several caches' slots with their locks and dirty flags, as the kernels read them: the
    tensors (kept alive while the table is) and their device addresses, uploaded once."""

    slots: list[torch.Tensor]  # int64 [n_s], contiguous, one per cache
    locks: list[torch.Tensor]  # int32 [slots_s]
    dirty: list[torch.Tensor]  # bool [slots_s]
    table: torch.Tensor  # int64 [S, 4] on the device

    @classmethod
    def of(
        cls, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ) -> SlotTable | None:
        """The table of ``(slots, locks, dirty)`` per cache, all on one device; None when a
        part is not as the kernels read it (slots int64 contiguous, locks int32, dirty bool,
        each contiguous), or there is none."""
        if not parts:
            return None
        device = parts[0][0].device
        rows: list[int] = []
        for slots, locks, dirty in parts:
            if (
                slots.dtype != torch.int64
                or locks.dtype != torch.int32
                or dirty.dtype != torch.bool
                or not (slots.is_contiguous() and locks.is_contiguous() and dirty.is_contiguous())
                or not slots.device == locks.device == dirty.device == device
            ):
                return None
            rows += [slots.data_ptr(), slots.numel(), locks.data_ptr(), dirty.data_ptr()]
        table = torch.tensor(rows, dtype=torch.int64).view(len(parts), _FIELDS)
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        else:
            table = table.to(device)
        return cls([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], table)

    @property
    def max_slots(self) -> int:
        return max(s.numel() for s in self.slots)


class RowsOps(Protocol):
    """One implementation of the rows family.

    Attributes:
        name: ``"spec"``, ``"native"`` or ``"triton"``.
        one_launch: whether these operations are the device path's single launches, which a
            cache prefers to its own torch ops (the Triton kernels); the torch specification
            says ``False``, and its cache runs its torch code instead.
        compiled: whether the host's operations run the compiled CPU passes (numba): a tier
            table that moves float32 rows in its own compiled passes asks it when declared.
    """

    name: str
    one_launch: bool
    compiled: bool

    def lock_floors(self, table: SlotTable) -> torch.Tensor:
        """The lowest lock among each cache's live slots (>= 0), int32 ``[S]`` on the table's
        device (not read; ``INT32_MAX`` where a cache has none): one launch."""
        ...

    def unlock(self, table: SlotTable, dirty: bool) -> None:
        """One lock dropped from each live slot of every cache of ``table`` (checked by the
        caller, e.g. with `lock_floors`), each row marked dirty with ``dirty``: one launch."""
        ...

    def direct_slots(
        self, row_offset: torch.Tensor, keys: torch.Tensor, fusion_k: int, locks: torch.Tensor
    ) -> torch.Tensor:
        """The slot of each of ``keys`` (int64 fused ids, distinct, of bounded tables, checked)
        under direct mapping, ``row_offset[key >> fusion_k] + (key & (2**fusion_k - 1))``, int64
        ``[n]``, each locked once in ``locks`` (int32): one launch. ``row_offset``: int64, the
        first slot of each table index."""
        ...

    # -- rows and bookkeeping on the host (compiled passes on a CPU) ------------------------

    def fill_at(self, t: torch.Tensor, idx: torch.Tensor, value: float | int | bool) -> None:
        """``t[idx] = value`` for a 1-D ``t`` (positions may repeat; one out of range raises
        RuntimeError, as ``scatter_`` does, before anything is written)."""
        ...

    def add_at(self, t: torch.Tensor, idx: torch.Tensor, delta: int) -> None:
        """``t[idx] += delta`` for a 1-D ``t`` (a repeated position is added to once per
        occurrence; one out of range raises IndexError, as ``index_add_`` does)."""
        ...

    def copy_rows(self, dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[idx] = src`` along dim 0, ``idx`` distinct (``index_copy_``'s meaning),
        ``src`` cast to ``dst``'s dtype. On a CPU the write does not bump ``dst``'s autograd
        version counter: ``dst`` must not be saved by a graph that checks it (the cache's
        storage and the tiers' arrays are not)."""
        ...

    def scatter_split(
        self, weights: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """``weights[slots], state[slots] = rows[:, :dim], rows[:, dim:]``: stored rows of
        float32 weights (weights, then state) into a cache's slots (``slots`` distinct)."""
        ...

    def gather_join(
        self, weights: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``out = [weights[slots] | state[slots]]``: a cache's rows at ``slots`` as stored
        rows of float32 weights, into ``out`` ``[n, dim + state_dim]``."""
        ...

    def unlocks_checked(self, slots: torch.Tensor) -> bool:
        """Whether `unlock_slots` checks ``slots``' locks itself (in its pass, before dropping
        any); else the caller checks them first (one device read for several caches)."""
        ...

    def unlock_slots(
        self, locks: torch.Tensor, slots: torch.Tensor, dirty: torch.Tensor | None
    ) -> None:
        """One lock dropped from each of ``slots`` (distinct, checked by the caller unless
        `unlocks_checked`: then RuntimeError and nothing changed when one is not locked), each
        marked in ``dirty`` when given."""
        ...

    def hashed_uniform(
        self, ids: torch.Tensor, salt: int, mid: float, half: float, dim: int
    ) -> torch.Tensor:
        """Rows of ``dim`` float32 values drawn uniformly in ``[mid - half, mid + half)`` from
        24 bits of a counter hash of ``(salt, id, column)``, on the CPU: the same bits from
        every implementation."""
        ...

    def group_by_table(
        self, fused: torch.Tensor, fusion_k: int, ascending: bool, num_tables: int
    ) -> tuple[np.ndarray, torch.Tensor | None, torch.Tensor] | None:
        """Fused ids grouped by table in one pass where that is possible:
        ``(ids per table, order or None when already grouped, raw ids in group order)``, or
        None (the caller sorts: the specification)."""
        ...
