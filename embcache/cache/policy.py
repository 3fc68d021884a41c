"""Eviction policies of a set-associative `HotCache`: which misses get ways first, what a
slot's score is, and whether a miss may displace a resident row.

* `LruPolicy`: a slot's score is the tick of its last use; misses compete for their set's
  ways in an order shuffled every batch; any miss displaces the least recently used way.
* `LfuPolicy`: a slot's score is its row's frequency (`sketch.LfuCounts`, decayed every
  ``lfu_decay_interval`` lookups when ``lfu_decay`` is set); the most frequent misses choose
  first, and a miss displaces a resident row only if asked for more often (the others are
  served from scratch for the batch while their counts grow, so popular rows get in and stay).

The cache keeps the slots and the clocks; a policy keeps the counts and the rules, and is
given the score tensor (replaced when the cache reallocates) on each call. Both have compiled
CPU plans (`PlanOps.plan_lru`, `PlanOps.plan_lfu`), which run when the plan family bound for
the cache's backend is the compiled one (`PlanOps.compiled`, `embcache.ops`); the torch code
is their specification.

Policies are chosen by name (`CacheConfig.policy`) from `embcache.cache.policy_registry`: a
new one is a subclass here or anywhere (`order_misses` and `touch` at least) and its line
there; `make_policy` builds the one a cache's config names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from embcache.backend import Backend
from embcache.cache.config import CacheConfig
from embcache.cache.lockstep import first_true
from embcache.cache.policy_registry import policy_class
from embcache.cache.sketch import LfuCounts
from embcache.indexing import put, select, true_at
from embcache.ops.registry import bind

PlanArrays = tuple[np.ndarray, np.ndarray, np.ndarray]


def main_slots(
    slots: torch.Tensor, num_slots: int, n_main: int | None, numpy: bool
) -> torch.Tensor:
    """The slots of ``slots`` in the cache proper (not -1, not scratch); ``n_main``: how
    many, when known (no host read then; ``numpy`` as `lockstep.first_true`'s)."""
    main = (slots >= 0) & (slots < num_slots)
    return select(slots, main) if n_main is None else slots.index_select(
        0, first_true(main, n_main, numpy))  # fmt: skip


def orders_padded_misses(policy: EvictionPolicy) -> bool:
    """Whether ``policy`` orders a device plan's padded misses (`order_padded_misses`) as its
    `order_misses` orders misses: both defined by one class, not the base (a subclass that
    reorders misses but inherits a padded order would place them differently)."""

    def owner(name: str) -> type:
        return next(c for c in type(policy).__mro__ if name in vars(c))

    found = owner("order_padded_misses")
    return found is not EvictionPolicy and found is owner("order_misses")


class EvictionPolicy(ABC):
    """What varies between policies in a cache's plan (`SetPlanner.plan_sets`).

    Args:
        counts: the row frequencies (for a policy that `needs_counts`; None for the others
            and for a direct cache).
        config: the cache's config (``lfu_decay``, ``lfu_decay_interval``).
        backend: the cache's implementation family (`embcache.backend`), whose plan family
            (`embcache.ops.plan`, bound here) hashes sets and, compiled, plans and counts an
            exact LFU's requests.
        fusion_k: bits of the raw id inside a fused id.
    """

    # Whether the cache counts its rows' uses for this policy (`LfuCounts`, exact or in a
    # sketch, as `CacheConfig.lfu_counters` says), handed to it as ``counts``.
    needs_counts = False
    # `NativePlan.reserve` scores the batch's slots as LRU does: a policy whose scores are
    # something else touches them again after a compiled plan.
    rescores_compiled_plan = False

    def __init__(
        self, counts: LfuCounts | None, config: CacheConfig, backend: Backend, fusion_k: int
    ) -> None:
        self.counts = counts
        self.config = config
        self.backend = backend
        self.ops = bind(backend).plan
        self.rows = bind(backend).rows  # the scores' writes
        self.fusion_k = fusion_k

    def _numpy_reads(self, scores: torch.Tensor) -> bool:
        """`SlotStore.numpy_reads` of the cache whose ``scores`` these are."""
        return scores.device.type == "cpu" and self.rows.compiled

    @abstractmethod
    def order_misses(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, miss_ids: torch.Tensor,
        shuffle: torch.Tensor, num_sets: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """The order misses compete for their sets' ways in: their positions in ``ids`` and
        their sets, sorted by set (runs, for `PlanOps.assign_ways`), and each
        one's priority for `admit` (None: every miss may displace a row).

        Args:
            ids: the batch's ids.
            miss_pos: the misses' positions in ``ids``, ascending; ``miss_ids`` their ids.
            shuffle: a hash of each miss that changes every batch (`hashing.mix64`).
            num_sets: sets of the cache.
        """

    def order_padded_misses(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, salt: int, num_sets: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`order_misses` for a plan that orders its misses before it has read how many
        there are (`SetPlanner._choose_ways_ahead`), on the device path: ``miss_pos`` holds
        the misses' positions, ascending, then -1 (padding), and the shuffle is
        ``mix64(id ^ salt)``. Returns the misses' ids (in the order of ``miss_pos``), then
        the positions and sets sorted as `order_misses` sorts them, the padding last with set
        ``num_sets``. A policy that overrides it lets a device plan under it (admitting
        every miss) order and place its misses before reading their number: one read
        fewer (`orders_padded_misses` says whether it applies)."""
        raise NotImplementedError(f"{type(self).__name__} does not order padded misses")

    def admit(
        self, assigned: torch.Tensor, set_scores: torch.Tensor, touched: torch.Tensor,
        owner: torch.Tensor, priority: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """The ways of ``assigned`` (-1: none) that each miss may take, given the scores of
        the ways (``set_scores``, ``[num_sets, ways]``), the ``touched`` sets, the run of each
        miss (``owner``) and the misses' ``priority`` (`order_misses`)."""
        return assigned

    def compiled(self) -> bool:
        """Whether a CPU cache with a row index that admits every id plans in compiled
        passes (`plan_compiled`); a policy without them plans in torch ops."""
        return False

    def plan_compiled(
        self, ids: torch.Tensor, where: torch.Tensor, row_offset: torch.Tensor,
        scores: torch.Tensor, locks: torch.Tensor, batch_of: torch.Tensor,
        geometry: tuple[int, int, int], tick: int, batch_seq: int, slots: torch.Tensor,
    ) -> PlanArrays:  # fmt: skip
        """`PlanOps.plan_lru` or `PlanOps.plan_lfu` (``geometry``: slots, sets, ways): fills
        ``slots`` and returns the misses' positions, their order and their places. Called
        only when `compiled` says so."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled plan")

    @abstractmethod
    def touch(
        self, ids: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor,
        n_main: int | None, all_main: bool, tick: int, lookups: int,
    ) -> None:  # fmt: skip
        """Update ``scores`` for a batch's ``slots`` (of ``ids``). ``n_main``: how many of
        ``slots`` are in the cache proper (not -1, not scratch), when known; ``all_main``:
        every one is."""


class LruPolicy(EvictionPolicy):
    """Least recently used: a slot's score is the tick of its last use."""

    def order_misses(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, miss_ids: torch.Tensor,
        shuffle: torch.Tensor, num_sets: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        # One sort: by set, then by the batch's shuffle (20 low bits; num_sets < 2**43).
        miss_sets = self.ops.set_index(miss_ids, num_sets)
        # (sets << 20) | low bits, as one add: the sets are >= 0 and the low bits below 2**20.
        key = torch.add(shuffle & 0xFFFFF, miss_sets, alpha=1 << 20)
        order = torch.sort(key, stable=True).indices
        return miss_pos.index_select(0, order), miss_sets.index_select(0, order), None

    def order_padded_misses(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, salt: int, num_sets: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The same key as `order_misses`, the padding's set past every set: one kernel.
        miss_ids, miss_sets, key = self.ops.miss_keys(ids, miss_pos, salt, num_sets)
        order = torch.sort(key, stable=True).indices
        return miss_ids, miss_pos.index_select(0, order), miss_sets.index_select(0, order)

    def compiled(self) -> bool:
        return True

    def plan_compiled(
        self, ids: torch.Tensor, where: torch.Tensor, row_offset: torch.Tensor,
        scores: torch.Tensor, locks: torch.Tensor, batch_of: torch.Tensor,
        geometry: tuple[int, int, int], tick: int, batch_seq: int, slots: torch.Tensor,
    ) -> PlanArrays:  # fmt: skip
        num_slots, num_sets, ways = geometry
        return self.ops.plan_lru(
            ids.numpy(), where.numpy(), row_offset.numpy(), self.fusion_k, scores.numpy(),
            locks.numpy(), batch_of.numpy(), num_slots, num_sets, ways, tick, batch_seq,
            slots.numpy(),
        )  # fmt: skip

    def touch(
        self, ids: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor,
        n_main: int | None, all_main: bool, tick: int, lookups: int,
    ) -> None:  # fmt: skip
        # Every slot of the batch is resident and in the cache proper unless some went to
        # scratch (or were refused): select only then.
        self.rows.fill_at(
            scores,
            slots
            if all_main
            else main_slots(slots, scores.numel(), n_main, self._numpy_reads(scores)),
            tick,
        )


class LfuPolicy(EvictionPolicy):
    """Least frequently used: a slot's score is its row's frequency (`LfuCounts`)."""

    needs_counts = True
    rescores_compiled_plan = True

    def order_misses(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, miss_ids: torch.Tensor,
        shuffle: torch.Tensor, num_sets: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        # The most frequent first, ties in the batch's shuffled order.
        assert self.counts is not None
        miss_pos = miss_pos.index_select(0, torch.argsort(shuffle))
        miss_freq = self.counts.get(ids.index_select(0, miss_pos)) + 1  # with this request
        by_freq = torch.argsort(miss_freq, descending=True, stable=True)
        miss_pos, miss_freq = miss_pos.index_select(0, by_freq), miss_freq[by_freq]
        miss_sets = self.ops.set_index(ids.index_select(0, miss_pos), num_sets)
        miss_sets, order = torch.sort(miss_sets, stable=True)
        return miss_pos.index_select(0, order), miss_sets, miss_freq[order]

    def admit(
        self, assigned: torch.Tensor, set_scores: torch.Tensor, touched: torch.Tensor,
        owner: torch.Tensor, priority: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        assert priority is not None  # `order_misses` gives each miss's frequency
        # An empty way has score -1: any miss takes it.
        victim_score = set_scores[touched[owner], assigned.clamp(min=0)]
        admit = (assigned >= 0) & (victim_score < priority)
        return torch.where(admit, assigned, torch.full_like(assigned, -1))

    def compiled(self) -> bool:
        return self.counts is not None and self.counts.sketch is None

    def plan_compiled(
        self, ids: torch.Tensor, where: torch.Tensor, row_offset: torch.Tensor,
        scores: torch.Tensor, locks: torch.Tensor, batch_of: torch.Tensor,
        geometry: tuple[int, int, int], tick: int, batch_seq: int, slots: torch.Tensor,
    ) -> PlanArrays:  # fmt: skip
        assert self.counts is not None
        _, num_sets, ways = geometry
        return self.ops.plan_lfu(
            ids.numpy(), where.numpy(), row_offset.numpy(), self.fusion_k,
            self.counts.exact.numpy(), self.counts.row_offset.numpy(),
            scores.numpy(), locks.numpy(), batch_of.numpy(), num_sets,
            ways, tick, batch_seq, slots.numpy(),
        )  # fmt: skip

    def touch(
        self, ids: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor,
        n_main: int | None, all_main: bool, tick: int, lookups: int,
    ) -> None:  # fmt: skip
        assert self.counts is not None
        if self.ops.compiled and self.counts.sketch is None:
            # Counted exactly: one compiled pass, the decay (when due) after it, which gives
            # the same counts and scores as before the scores are set (each value is rounded
            # down once either way).
            self.ops.touch_lfu(
                ids.numpy(), slots.numpy(), self.counts.exact.numpy(),
                self.counts.row_offset.numpy(), self.fusion_k, scores.numpy(), scores.numel(),
            )  # fmt: skip
            self._decay_when_due(scores, lookups)
            return
        self.counts.add(ids)
        self._decay_when_due(scores, lookups)
        main = (slots >= 0) & (slots < scores.numel())
        at = (
            true_at(main) if n_main is None else first_true(main, n_main, self._numpy_reads(scores))
        )
        put(scores, slots.index_select(0, at), self.counts.get(ids.index_select(0, at)))

    def _decay_when_due(self, scores: torch.Tensor, lookups: int) -> None:
        """With ``lfu_decay``: every ``lfu_decay_interval`` lookups, all frequencies and the
        scores of resident rows are multiplied by it (rounded down)."""
        decay = self.config.lfu_decay
        if decay is not None and lookups % self.config.lfu_decay_interval == 0:
            assert self.counts is not None
            self.counts.decay(decay)
            decayed = (scores.double() * decay).long()
            scores.copy_(torch.where(scores >= 0, decayed, scores))


def policy_type(kind: str) -> type[EvictionPolicy]:
    """The class registered as policy ``kind`` (`embcache.cache.policy_registry`).

    Raises:
        ValueError: no policy of that name, naming the registered ones.
        TypeError: the registered class is no `EvictionPolicy`.
    """
    cls = policy_class(kind)
    if not issubclass(cls, EvictionPolicy):
        raise TypeError(f"eviction policy {kind!r} is {cls!r}, not an EvictionPolicy subclass")
    return cls


def scores_by_tick(policy: EvictionPolicy) -> bool:
    """Whether ``policy``'s touch scores a batch's slots with the plan's clock and nothing
    else (`LruPolicy.touch`, not overridden): a group plan (`cache.group_plan`) scores them so
    in its reservation's kernel."""
    return type(policy).touch is LruPolicy.touch


def make_policy(
    kind: str, counts: LfuCounts | None, config: CacheConfig, backend: Backend, fusion_k: int
) -> EvictionPolicy:
    """The policy object of ``kind``, a registered name (`policy_type`)."""
    return policy_type(kind)(counts, config, backend, fusion_k)
