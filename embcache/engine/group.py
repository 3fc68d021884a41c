"""EngineGroup: the engines of one collection (one per embedding dim) and what its training step
holds between forward and optimizer step.

A forward prepares every engine's share of the batch (all ids validated before any cache
changes) and, when training, keeps them as one `InFlight` batch whose slots stay locked; its
backward hands each engine's gradient rows to `record_backward`, which appends
``(table_name, ids, grads)`` entries to the trace (or applies the optimizer at once with
``update_in_backward``). The optimizer's ``step()`` calls `apply_trace`, which asks each engine
to apply the optimizer's rule to its entries, then releases the slots.

Rules for a batch that is never backpropagated (a validation pass with gradients enabled, in
``eval()`` or not): its locks last until the next training forward (`begin_batch`), `flush`
(`release_forward_only`), `zero_grad` or `release_all`; a backward that comes after that is
still applied exactly (`InFlight.released`). A forward under ``torch.no_grad()`` locks nothing
and leaves them (it may run between a training forward and its backward). A training
forward while an un-stepped trace exists is an error unless the collection accumulates
gradients.

A batch prefetched ahead of its forward (`issue`) is resolved on the `Prefetcher`'s worker
thread; its forward takes what it resolved (`take_prefetch`). The rules that release a
prefetch that will not be used are in `embcache.engine.prefetch`.

The step belongs to one thread at a time (``claim``, `embcache.engine.claim`): a training
forward claims it, the step (`apply_trace`) or `zero_grad` ends the claim, and another thread's
training calls raise before they change anything.

The collections do not sequence these calls themselves: each phase has one entry point here.
A local forward (bags or sequences) runs its lookup inside `forward_shares`, which claims,
opens the forward, takes the prefetch or prepares, records the batch and, without gradients,
gives it back; a local prefetch is `prefetch`; a backward is `record_backward`; a step is
`apply_trace`. The sharded collections, whose ranks agree between the phases, call `claimed`,
`open_forward`, `take_prefetch`, `begin_batch` and `start` one by one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import torch

from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache, unlock_together
from embcache.cache.storage import check_floors, lock_floors
from embcache.engine.batch_state import (
    FusedPrefetchHandle,
    InFlight,
    Prefetched,
    Prepared,
    TraceEntry,
)
from embcache.engine.claim import StepClaim
from embcache.engine.engine import CacheEngine, masked_together
from embcache.engine.inputs import JaggedBatch
from embcache.engine.layout import CacheLayout, bounds_together
from embcache.engine.optimizer import AttachedOptimizer, DeviceCheck, StepOptimizer
from embcache.engine.options import CollectionOptions
from embcache.engine.prefetch import Prefetcher
from embcache.engine.shares import CheckedShare, ShareMaker
from embcache.engine.tables import Table
from embcache.engine.tbe_step import PendingUpdate, TbeStep
from embcache.kv.base import Store, TableSpec

_EXACT_IN_FLOAT32 = (torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def _holds_handles(prefetches: Prefetcher) -> bool:
    """Whether ``prefetches`` holds a handle: issued, recorded, or garbage collected and not
    yet collected. Else it has nothing to take or release, and a loop without prefetch does
    not call it."""
    return bool(prefetches.issued or prefetches.dropped) or prefetches.recorded is not None


def _read_together(values: list[torch.Tensor]) -> list[float]:
    """The values of 0-d device tensors (float or integer) on the host: one read per device
    (a collection's are on one), in order. Joined by one ``cat``, which promotes them to a
    common dtype (a step's float32 sums and int32 lock floors: float32, exact for floors
    below 2**24, far above any count of locks); with int64 among them, each is read as float64
    first."""
    by_device: dict[torch.device, list[int]] = {}
    for k, t in enumerate(values):
        by_device.setdefault(t.device, []).append(k)
    out = [0.0] * len(values)
    for at in by_device.values():
        parts = [values[k] for k in at]
        if all(p.is_floating_point() or p.dtype in _EXACT_IN_FLOAT32 for p in parts):
            read = torch.cat([p.reshape(1) for p in parts]).tolist()
        else:
            read = torch.stack([p.to(torch.float64) for p in parts]).tolist()
        for k, v in zip(at, read, strict=True):
            out[k] = v
    return out


class StepGradients(Protocol):
    """What a training forward tells the collection's rows' gradient, as torch's gradient
    utilities see it (`models.row_grads.RowGradients`)."""

    def drop_if_zeroed(self) -> None:
        """A gradient made and then zeroed in place is dropped (with its step's claim)."""

    def forward_started(self) -> None:
        """The gradient the forward's backward records is nobody's yet."""


class EngineGroup:
    """The engines of a collection and the state of its step.

    Args:
        tables: the collection's tables.
        specs: their tier specs, by name (declared in ``store``).
        store: the tier.
        cache_config: capacity and policy of each cache (a sharded rank's share).
        device: where the caches live (resolved).
        fusion_k: bits of the raw id inside a fused id (as the collection uses it).
        options: the collection's options: whether the update runs in backward
            (`CollectionOptions.applies_in_backward`) and whether backwards accumulate.
    """

    def __init__(
        self,
        tables: list[Table],
        specs: dict[str, TableSpec],
        store: Store,
        cache_config: CacheConfig,
        device: torch.device,
        fusion_k: int,
        options: CollectionOptions,
    ) -> None:
        self.tables = tables
        self.specs = specs
        self.store = store
        self.device = device
        self.fusion_k = fusion_k
        self.update_in_backward = options.applies_in_backward
        self.accumulate_grads = options.accumulate_grads
        self.table_index = {t.name: t.index for t in tables}
        self.engines: list[CacheEngine] = []
        # One cache per dim, and one per table a per-table size names (`CacheConfig.split`).
        for config, mine in cache_config.split(tables):
            cache = HotCache(
                [(t.index, specs[t.name]) for t in mine], config, store, device, fusion_k
            )
            self.engines.append(
                CacheEngine(CacheLayout.of_tables(mine[0].dim, mine), cache, fusion_k, device)
            )
        # Each engine's table names (the step counts' keys), and joined (a gradient's name).
        self._names = [[t.name for t in e.layout.tables] for e in self.engines]
        self._joined_names = [", ".join(names) for names in self._names]
        self.shares = ShareMaker(self.engines, fusion_k, device)
        self._entries: list[TraceEntry] = []
        self._pending: list[PendingUpdate] = []  # TBE step updates not yet applied
        self.inflight: list[InFlight] = []
        self.prefetches = Prefetcher(self.release_shares, device)
        self.generation = 0  # bumped when caches are emptied: older handles become stale
        self.optimizer: AttachedOptimizer | None = None
        self.owner: object = self  # the step counts' key at the optimizer (the collection)
        self.gradients: StepGradients | None = None  # the collection's, told of each forward
        self.claim = StepClaim("collection")  # the collection names itself (`set_owner`)

    def set_owner(self, owner: object) -> None:
        """The collection these engines serve: the optimizer's key for its step counts, and
        the name the step's claim gives it in messages."""
        self.owner = owner
        self.claim.name = type(owner).__name__

    def release_claim_if_idle(self) -> None:
        """End the step's claim when nothing of a step is left: no gradient awaits a step,
        every forward in flight was backpropagated (and, without a trace, applied) and no
        prefetch awaits its forward (a prefetch issued during a step is the next step's)."""
        if self.has_gradients or not all(b.backward_done for b in self.inflight):
            return
        if _holds_handles(self.prefetches):
            self.prefetches.collect_dropped()
        if not self.prefetches.issued:
            self.claim.release()

    def entries(self) -> list[TraceEntry]:
        """The recorded gradients, ``(table_name, ids, grads)`` per table and backward. TBE
        step updates recorded since become entries first (their per-id gradient rows computed,
        once) and then take the ordinary path; the list returned is the trace itself."""
        if self._pending:
            pending, self._pending = self._pending, []
            for u in pending:
                engine = self.engines[u.engine]
                p = engine.materialize(u.batch.prepared[u.engine])
                assert p.unique is not None  # materialized
                grads = engine.grad_rows(p, u.batch_size, u.grad_out, u.columns, [None])
                self._entries += engine.trace_entries(p.unique, grads, u.engine, u.batch)
        return self._entries

    def replace_entries(self, entries: list[TraceEntry]) -> None:
        """Make ``entries`` the trace (no TBE update pending)."""
        self._pending = []
        self._entries = entries

    @property
    def checks_lengths_late(self) -> bool:
        """Whether a forward's batch may leave its lengths' checks pending
        (`checked_batch(read_lengths=False)`): every engine fuses on the device path, where
        `ShareMaker._fuse_together` folds those checks into the ids' own, read with the dedup's."""
        return all(e.cache.device_path and e.tbe_step is None for e in self.engines)

    @property
    def has_gradients(self) -> bool:
        """Whether a backward's gradients await their step (without computing any rows)."""
        return bool(self._entries or self._pending)

    def gradients_to_check(self) -> list[tuple[str, Any, torch.Tensor]]:
        """What the optimizer checks for NaN/Inf before a step: the trace entries, and for a
        TBE update its pooled gradient and per-sample weights (a row's gradient is a
        weighted sum of them, finite when they are)."""
        out: list[tuple[str, Any, torch.Tensor]] = list(self._entries)
        for u in self._pending:
            names = self._joined_names[u.engine]
            out.append((names, None, u.grad))
            weights = u.batch.prepared[u.engine].weights
            if weights is not None:
                out.append((names, None, weights.unsqueeze(1)))
        return out

    def engine_of(self, table: str) -> CacheEngine:
        for engine in self.engines:
            if engine.owns(table):
                return engine
        raise KeyError(f"unknown table {table!r}; tables: {[t.name for t in self.tables]}")

    # -- the step protocol: one entry point per phase -----------------------------------------
    #
    # forward: `forward_shares` (a local collection) or `claimed` + `open_forward` + `start`
    # (a sharded one, whose ranks agree between them); backward: `record_backward`; step:
    # `apply_trace`; prefetch: `prefetch` (a local collection's), `take_prefetch`.

    @contextlib.contextmanager
    def claimed(self, what: str | None) -> Iterator[None]:
        """The step claimed for the calling thread while the block runs (``what`` names the
        call in the refusal; None: nothing to claim, a forward without gradients); a claim
        taken here ends if the block fails and nothing of a step is left."""
        fresh = self.claim.take(what) if what is not None else False
        try:
            yield
        except BaseException:
            if fresh:
                self.release_claim_if_idle()
            raise

    @contextlib.contextmanager
    def forward_shares(
        self, batch: JaggedBatch, training: bool
    ) -> Iterator[tuple[list[Prepared], InFlight | None]]:
        """One forward of a collection in one process, around its lookup: yields every
        engine's share of the checked ``batch`` and, when ``training``, the `InFlight` batch
        its backward records against (its slots locked until the step).

        In order: the step is claimed for this thread (`claimed`; another thread's training
        raises here, before anything changes); a training forward is opened (`open_forward`);
        the recorded prefetch is taken when it was issued for this batch (`take_prefetch`),
        else the batch is prepared (`prepare`: ids checked, deduplicated and resolved); a
        training forward's shares are recorded (`start`). After the block, a forward without
        gradients gives back what it used (`finish_untracked`); a failure ends a claim taken
        here when nothing of a step is left."""
        with self.claimed("training forward" if training else None):
            if training:
                self.open_forward()
            # The recorded prefetch is the training thread's next batch: an inference from
            # another thread meanwhile reads synchronously and leaves it alone.
            use_prefetch = training or not self.claim.held_elsewhere()
            prefetched = self.take_prefetch(batch) if use_prefetch else None
            # A local prefetch holds every engine's share (`prefetch`); None entries are the
            # sharded collection's.
            prepared = (
                cast(list[Prepared], prefetched.prepared)
                if prefetched
                else self.prepare(batch, lock=training)
            )
            inflight = self.start(prepared) if training else None
            try:
                yield prepared, inflight
            finally:
                if not training:
                    self.finish_untracked(prepared)

    def open_forward(self, release_stale: bool = True) -> None:
        """A training forward's first phase, before it changes anything: a gradient zeroed in
        place is dropped and the collection's gradient hears of the forward
        (`StepGradients`); an un-stepped trace is refused (`refuse_pending_trace`); with
        ``release_stale``, the locks of forwards never backpropagated are dropped
        (`begin_batch`: a sharded collection does that once its ranks agree). A refusal
        releases every prefetch handle, whose locks would belong to no batch."""
        try:
            if self.gradients is not None:
                self.gradients.drop_if_zeroed()  # zero_grad(set_to_none=False) ran
            if release_stale:
                self.begin_batch()
            else:
                self.refuse_pending_trace()
            if self.gradients is not None:
                self.gradients.forward_started()
        except RuntimeError:
            self.prefetches.release_all()
            raise

    def refuse_pending_trace(self) -> None:
        """Refuse a training forward while a backward's gradients await their step, unless
        they accumulate (the message says what to do, with or without an optimizer)."""
        if not self.has_gradients or self.accumulate_grads:
            return
        if self.optimizer is None:
            raise RuntimeError(
                "forward called while the previous backward's gradients of this "
                "collection await a step, and no optimizer has stepped them yet. To "
                "sum the gradients of several backwards before one step, build the "
                "collection with accumulate_grads=True; to drop them, call "
                "zero_grad() (the optimizer's, or model.zero_grad()). If nothing "
                "trains its tables, give its parameters (model.parameters()) to the "
                "torch optimizer, build it with optimizer_type=..., or attach an "
                "embcache optimizer (embcache.SparseAdaGrad([collection], lr=...)) "
                "and call step()"
            )
        raise RuntimeError(
            "forward called while the previous backward's gradients are still in _trace: "
            "call optimizer.step() first (or drop them with zero_grad(): the optimizer's "
            "or model.zero_grad()), or build the collection with accumulate_grads=True to "
            "sum the gradients of several backwards before one step"
        )

    def begin_batch(self) -> None:
        """Before a training forward: refuse to mix in an un-stepped trace; drop the locks of
        forwards that were never backpropagated."""
        self.refuse_pending_trace()
        kept = []
        for batch in self.inflight:
            if not batch.backward_done:
                self.release(batch)
                batch.released = True
            elif any(p.locked for p in batch.prepared):
                kept.append(batch)  # backpropagated, waiting for step (accumulate_grads)
        self.inflight = kept

    def release_forward_only(self) -> None:
        """Give back the slots of forwards whose backward has not run (at a flush): nothing
        is left locked by a pass that only read. Not while another thread trains the
        collection (its forward awaits its backward)."""
        if self.claim.held_elsewhere() or all(b.backward_done for b in self.inflight):
            return
        for batch in self.inflight:
            if not batch.backward_done:
                self.release(batch)
                batch.released = True
        self.inflight = [b for b in self.inflight if b.backward_done]
        self.release_claim_if_idle()

    def prepare(self, batch: JaggedBatch, lock: bool) -> list[Prepared]:
        """Every engine's share of a checked batch (`ShareMaker.prepare`)."""
        return self.shares.prepare(batch, lock)

    def check(self, batch: JaggedBatch, lock: bool) -> list[Prepared | CheckedShare]:
        """Every engine's share of a checked batch, validated and not yet resolved
        (`ShareMaker.check`)."""
        return self.shares.check(batch, lock)

    def start(self, prepared: list[Prepared]) -> InFlight:
        """Record a training forward's shares as a batch in flight (of the claimed step)."""
        batch = InFlight(prepared)
        self.inflight.append(batch)
        self.claim.record(batch)
        return batch

    def finish_untracked(self, prepared: list[Prepared]) -> None:
        """After a forward without gradients: unlock and release what it used."""
        for engine, p in zip(self.engines, prepared, strict=True):
            engine.release(p)
            engine.cache.release()

    def record_backward(
        self, batch: InFlight | None, grad_rows: Sequence[torch.Tensor | PendingUpdate]
    ) -> None:
        """Record every engine's gradient rows of one backward (or apply them all at once);
        an engine on the TBE step hands a `PendingUpdate` instead of rows."""
        if batch is None:
            return
        self.claim.check_backward(batch)
        batch.backward_done = True
        entries, pending, rows = [], [], []
        for i, (engine, p, grads) in enumerate(
            zip(self.engines, batch.prepared, grad_rows, strict=True)
        ):
            if isinstance(grads, PendingUpdate):
                pending.append(grads)
            else:
                assert p.unique is not None  # a share not on the TBE step has its ids
                rows.append((i, engine, p.unique, grads))
        # Every cache's per-table cut of its ids: read by the forward's dedup (`Prepared.
        # bounds`), or else in one host read for all (none with a table a cache).
        bounds = [batch.prepared[i].bounds for i, _, _, _ in rows]
        if missing := [k for k, b in enumerate(bounds) if b is None]:
            items = [(rows[k][1].layout, rows[k][2], self.fusion_k) for k in missing]
            for k, b in zip(missing, bounds_together(items), strict=True):
                bounds[k] = b
        # Every cache's raw ids in one op where their unique ids share one buffer.
        raws = masked_together([unique for _, _, unique, _ in rows], (1 << self.fusion_k) - 1)
        for (i, engine, unique, grads), cut, raw in zip(rows, bounds, raws, strict=True):
            entries += engine.trace_entries(unique, grads, i, batch, cut, raw)
        self._entries += entries
        self._pending += pending
        if self.update_in_backward:
            if self.optimizer is None:
                raise RuntimeError(
                    "update_in_backward=True needs a sparse optimizer attached to the collection "
                    "(construct e.g. SparseSGD([collection], lr=...) before the first backward)"
                )
            try:
                # All engines at once: a bad gradient anywhere is refused before any update.
                self.optimizer.check_gradients(self.gradients_to_check())
                self.apply_trace(self.optimizer, release=False)
            except ValueError:
                self._entries, self._pending = [], []
                self.release(batch)
                raise
            finally:  # the step ran inside this backward
                self.release_claim_if_idle()

    # -- the optimizer's side ----------------------------------------------------------------

    def attach(self, optimizer: AttachedOptimizer) -> None:
        """Give every row the state columns of ``optimizer`` (fresh state, weights kept).
        Gradients of a backward still pending stay in the trace for the next step, which
        locates their rows again (their forwards' slots are released here)."""
        fresh = self.claim.take("attaching an optimizer")
        try:
            # TBE step updates become entries while their batch holds.
            pending = list(self.entries())
            self._entries, self._pending = [], []
            self.release_all()  # forwards that were never (or already) backpropagated
            self.prefetches.release_all()
            for engine in self.engines:
                engine.cache.set_state(optimizer.state_dim(engine.dim), optimizer.state_init)
                # Several backwards summed per id before one step need the per-id rows.
                engine.tbe_step = (
                    None if self.accumulate_grads else TbeStep.for_engine(engine, optimizer)
                )
            for name in self.specs:
                self.specs[name] = self.store.table_spec(name)
            self.generation += 1
            self.optimizer = optimizer
            self._entries = pending
        finally:
            if fresh:
                self.release_claim_if_idle()

    def apply(
        self,
        entries: list[TraceEntry],
        optimizer: StepOptimizer,
        check: DeviceCheck | None = None,
    ) -> None:
        """Apply ``optimizer``'s rule to trace entries, engine by engine, all or nothing: every
        engine's rows are located first (an accumulated trace is resolved again, which may
        read the tier and fail, leaving everything as it was); then one host read answers the
        gradients' ``check`` (`DeviceCheck`) and every engine's lock check (`lock_floors`),
        and a refusal gives back what locating locked; only then do the step counts advance
        and rows change, with no tier call left to fail.

        Raises:
            ValueError: ``check`` found a NaN/Inf gradient; nothing changed.
            RuntimeError: a located slot is not locked; nothing changed.
        """
        located = []
        try:
            for i, engine in enumerate(self.engines):
                mine = [e for e in entries if e.engine == i]
                if mine:
                    located.append((engine, engine.locate(mine, self.table_index)))
            pairs = [(engine.cache, loc.slots) for engine, loc in located]
            floors = lock_floors(pairs)
            sums = [] if check is None else check.sums
            values = _read_together([*sums, *floors.values])
            if check is not None:
                check.judge(values[: len(sums)])
            check_floors(values[len(sums) :])
        except BaseException:
            for engine, loc in located:
                engine.abandon(loc)
            raise
        steps = optimizer.advance_steps(self.owner, [e.table_name for e in entries])
        # On the device path one launch unlocks every engine's rows and marks them dirty.
        dirty_on_unlock = floors.table is not None
        try:
            for engine, loc in located:
                engine.update(loc, optimizer.update, steps, mark_dirty=not dirty_on_unlock)
        finally:  # every engine's locks, checked above, dropped
            unlock_together(pairs, dirty=dirty_on_unlock, floors=floors)
            for _, loc in located:
                if loc.prepared is not None:
                    loc.prepared.locked = False

    def apply_trace(
        self, optimizer: StepOptimizer, release: bool = True, check: DeviceCheck | None = None
    ) -> None:
        """Apply the recorded gradients, then clear them and (``release``) every batch in
        flight. Retriable: a tier error leaves the trace in place and nothing applied; calling
        again once the tier is back applies each gradient exactly once. ``check``: the
        optimizer's gradient check, read with the step's lock check (`apply`) or, with no
        entries to locate, on its own, before anything changes (ValueError: nothing changed).

        TBE step updates run the TBE's backward (no tier call, so nothing to retry); one the
        TBE cannot apply (the optimizer changed, the cache storage moved) becomes entries.
        """
        if release:
            self.claim.take("optimizer step")
        try:
            # A batch released before its backward holds no slots: its rows are located
            # again, as entries.
            if any(u.batch.released or not self._tbe_applies(u, optimizer) for u in self._pending):
                self.entries()  # materialises every pending update as entries
            if self._entries:
                self.apply(self._entries, optimizer, check)
            elif check is not None:
                check.verify()
            if self._pending:
                names = [name for u in self._pending for name in self._names[u.engine]]
                optimizer.advance_steps(self.owner, names)
                for u in self._pending:
                    engine = self.engines[u.engine]
                    assert engine.tbe_step is not None  # `_tbe_applies`
                    p = u.batch.prepared[u.engine]
                    # The update writes only this batch's rows, which its locks keep in their
                    # slots: it holds the storage lock, not the cache's, so that a prefetch's
                    # resolve of the next batch runs beside it (`HotCache.storage_lock`).
                    engine.tbe_step.apply(u, p)
                    with engine.cache.lock:
                        engine.mark_dirty(p, release=True)
            self._entries, self._pending = [], []
            if release:
                self.release_all()
        finally:
            if release:  # the step completed (or left its trace to retry: the claim stays)
                self.release_claim_if_idle()

    def _tbe_applies(self, u: PendingUpdate, optimizer: StepOptimizer) -> bool:
        tbe_step = self.engines[u.engine].tbe_step
        return tbe_step is not None and tbe_step.can_apply(u, optimizer.update)

    def zero_grad(self) -> None:
        """Drop the recorded gradients and the locks of every forward in flight, prefetched
        ones included; ends the step's claim. Allowed after close (there is nothing to drop)."""
        if not self.claim.closed:
            self.claim.take("zero_grad")
        self._entries, self._pending = [], []
        self.release_all()
        if _holds_handles(self.prefetches):
            self.prefetches.release_all()
        self.claim.release()

    def release(self, batch: InFlight) -> None:
        for engine, p in zip(self.engines, batch.prepared, strict=True):
            engine.release(p)

    def release_all(self) -> None:
        for batch in self.inflight:
            self.release(batch)
            batch.released = True
        self.inflight = []

    # -- prefetch ----------------------------------------------------------------------------

    def prepare_fused(
        self,
        shares: list[Prepared | CheckedShare],
        lock: bool,
        defer_writeback: bool = False,
    ) -> list[Prepared]:
        """`prepare` after `check` (`ShareMaker.prepare_fused`)."""
        return self.shares.prepare_fused(shares, lock, defer_writeback)

    def release_shares(self, prepared: list[Prepared | None]) -> None:
        """Unlock the shares of a batch that will not run (a prefetch released unused)."""
        self.shares.release_shares(prepared)

    def prefetch(
        self, owner_id: int, batch: JaggedBatch, source: object = None
    ) -> FusedPrefetchHandle:
        """A local collection's prefetch of a checked batch (under the step's claim,
        `claimed`): its ids validated here (a bad id raises before anything changes), its
        dedup and resolve queued on the worker (`issue`), each cache's victims written back
        after the handle is ready."""
        shares = self.check(batch, lock=True)
        job = functools.partial(self._prefetched, shares)
        return self.issue(owner_id, batch, job, then_write_back=True, source=source)

    def _prefetched(self, shares: list[Prepared | CheckedShare], seq: int) -> Prefetched:
        """Worker-thread body of `prefetch`: the batch's rows resolved, the victims'
        write-back left for the worker's next call (`issue`)."""
        try:
            prepared = self.prepare_fused(shares, lock=True, defer_writeback=True)
            return Prefetched(cast(list[Prepared | None], prepared))  # list is invariant
        except Exception as e:  # the forward reads synchronously (and meets it again)
            return Prefetched([], error=e)

    def issue(
        self,
        owner_id: int,
        batch: JaggedBatch,
        job: Callable[[int], Prefetched],
        then_write_back: bool = False,
        source: object = None,
    ) -> FusedPrefetchHandle:
        """Queue a prefetch (``job(seq) -> Prefetched`` on the worker); returns its handle.
        ``then_write_back``: the job defers its victims' write-back (`prepare_fused`), and
        the worker makes it next (`write_deferred`), after the handle is ready and before
        any later prefetch. ``source``: the features object ``batch`` was checked from
        (`checked_prefetch`)."""
        self.claim.take("prefetch")  # part of the step its forward starts
        handle = self.prefetches.issue(owner_id, self.generation, batch, job, source)
        if then_write_back:
            self.prefetches.submit_after(self.write_deferred)
        return handle

    def checked_prefetch(self, features: object) -> JaggedBatch | None:
        """The checked batch of the handle the next forward takes, when it was issued for
        this very ``features`` object (its check need not run again), else None."""
        handle = self.prefetches.recorded
        if handle is None or handle.source is not features or handle.used:
            return None
        return handle.batch if handle.generation == self.generation else None

    def write_deferred(self) -> None:
        """Write to the tier the victims each cache's last resolve left staged (a tier error
        propagates; the rows stay staged for the cache's next tier access)."""
        for cache in self.caches():
            cache.write_deferred()

    def check_handle(self, handle: FusedPrefetchHandle, owner_id: int) -> None:
        if not isinstance(handle, FusedPrefetchHandle):
            raise TypeError(f"expected a FusedPrefetchHandle, got {type(handle).__name__}")
        if handle.module_id != owner_id:
            raise ValueError("prefetch handle was issued by another collection")
        if handle.used or handle.generation != self.generation:
            raise ValueError(
                "prefetch handle is stale: already used or released (a newer forward, "
                "zero_grad, reset_trace), or the cache was emptied"
            )

    def set_prefetch(self, handle: FusedPrefetchHandle | None, owner_id: int) -> None:
        """Make the next forward use ``handle`` (None: no handle)."""
        self.claim.check("choosing the prefetch handle")
        if handle is not None:
            self.check_handle(handle, owner_id)
        self.prefetches.record(handle, explicit=True)

    def cancel(self, handle: FusedPrefetchHandle, owner_id: int) -> None:
        """Release a handle that will not be used."""
        self.claim.take("cancelling a prefetch")
        if handle.module_id == owner_id:
            self.prefetches.release(handle.state)
        self.release_claim_if_idle()

    def take_prefetch(self, batch: JaggedBatch) -> Prefetched | None:
        """What the handle recorded for this forward resolved (None: read synchronously), after
        waiting for its worker; releases the handles no forward can use any more."""
        if not _holds_handles(self.prefetches):
            return None
        handle = self.prefetches.take(batch)
        if handle is not None and handle.generation != self.generation:
            self.prefetches.release(handle.state)
            handle = None
        return self.prefetches.use(handle)

    # -- caches ------------------------------------------------------------------------------

    def caches(self) -> list[HotCache]:
        return [engine.cache for engine in self.engines]

    def invalidate(self) -> None:
        """Drop pending gradients and locks, write back and empty every cache; handles issued
        before become stale."""
        self.zero_grad()
        for cache in self.caches():
            cache.invalidate()
        self.generation += 1

    def flush(self) -> None:
        """Write every dirty row back, after releasing the forwards never backpropagated
        (`release_forward_only`), so that a save after a validation pass finds no slot
        locked."""
        self.release_forward_only()
        for cache in self.caches():
            cache.flush()

    def cache_stats(self) -> dict[str, float]:
        """Hits, misses, evictions and writebacks summed over the caches, and the hit rate."""
        total: dict[str, float] = {"hits": 0, "misses": 0, "evictions": 0, "writebacks": 0}
        for cache in self.caches():
            for k, v in cache.cache_stats().items():
                if k in total:
                    total[k] += v
        looked_up = total["hits"] + total["misses"]
        total["hit_rate"] = total["hits"] / looked_up if looked_up else 0.0
        return total

    def reset_stats(self) -> None:
        for cache in self.caches():
            cache.reset_stats()
