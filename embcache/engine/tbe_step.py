"""The CPU fast path of a cache's step: FBGEMM's table-batched embedding (TBE) over the cache.

On a CPU, pooling, the backward's per-id gradient sums and the optimizer's row update are three
passes over the batch's rows through torch ops (the twins). FBGEMM's CPU TBE does the backward
and the row update in one pass, and its pooling is as fast as any. fbgemm-gpu-cpu lets a
TBE own no memory of its own (``preallocated_host_buffers``): here its one "table" is the cache's
slot storage, ``weights [R, dim]`` and the optimizer state ``[R, S]`` beside it, and its indices
are the batch's slots, so the TBE reads and updates the cache's rows in place. A cache that maps
every row directly holds its tables one after another in those slots: a second TBE over the same
storage, one table per cache table (``feature_table_map``), reads the batch's raw ids as they
come (`pool_direct`, for `CacheEngine.direct_share`).

    step = TbeStep.for_engine(engine, optimizer)         # None when it does not apply
    pooled, bound = step.pool(prepared, lr, B)           # [B * F, dim], the TBE's graph kept
    ...                                                  # backward: the pooled gradient only
    step.apply(pending)                                  # the TBE's backward: rows updated

What a step records in between is a `PendingUpdate`: the TBE's output and the pooled gradient.
The optimizer's step applies it with one backward call; anything that needs the per-id gradient
rows (reading ``_trace``, accumulating over several backwards) turns it into ordinary trace
entries first, with the same numbers up to float32 rounding order.

It applies to the rules whose spec names an FBGEMM CPU optimizer (`RuleSpec.fbgemm_cpu`: SGD,
AdaGrad, row-wise AdaGrad) without weight decay or ``lr_decay`` (`fbgemm_type`, the one
predicate both the choice of the path and each update ask), to float32 rows of a dim that is a
multiple of 4, to caches that admit every id (no ``admit_after``), and to caches whose features
share one pooling mode, SUM or MEAN (unweighted MEAN: FBGEMM's weighted MEAN differs from the
twins'); everything else takes the twins' path.
Any backend but ``auto`` (`embcache.backend`) turns it off (the twins are the specification);
the backend is asked once, when the step is made for an engine.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from embcache.engine.batch_state import InFlight, Prepared
from embcache.kernels.optim import OptimRule
from embcache.kernels.optim_rules import RULES
from embcache.kernels.pooling import PoolingMode
from embcache.profiling import profiled


def fbgemm_type(update: Any) -> str | None:
    """FBGEMM's ``EmbOptimType`` whose CPU TBE applies ``update`` exactly (its rule's
    `RuleSpec.fbgemm_cpu`), or None: no such optimizer, or an option the TBE is not given
    (weight decay; AdaGrad's ``lr_decay``, whose rate changes with the step count while the
    TBE's graph keeps the rate of its forward)."""
    if update is None or update.weight_decay != 0.0 or getattr(update, "lr_decay", 0.0) != 0.0:
        return None
    return RULES[update.rule].fbgemm_cpu


_FBGEMM: list[tuple[Any, Any, Any] | None] = []  # [its modules or None], filled on first use


def _fbgemm() -> tuple[Any, Any, Any] | None:
    """fbgemm_gpu's TBE classes, or None when fbgemm-gpu-cpu cannot be imported here."""
    if not _FBGEMM:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # it warns about optional CUDA parts on import
                from fbgemm_gpu import split_embedding_configs as configs
                from fbgemm_gpu import split_table_batched_embeddings_ops_common as common
                from fbgemm_gpu import split_table_batched_embeddings_ops_training as training
            _FBGEMM.append((configs, common, training))
        except Exception:
            _FBGEMM.append(None)
    return _FBGEMM[0]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor over ``t``'s memory with a version counter of its own.

    The TBE's graph saves its weights for the backward; the cache writes other slots of the
    same storage in between (a prefetch copying rows in), which would bump a shared counter and
    make autograd refuse the backward although the batch's own rows, locked, did not change.
    """
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    return flat.set_(t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,))


@dataclass
class PendingUpdate:
    """One cache's share of a backward, not yet applied: the TBE's pooled output (with its
    autograd graph) and the gradient of it, ``[B * F, dim]`` (sample-major: the pooled
    gradient ``[B, F * dim]`` the engine saw, as it stands), which also turns into per-id
    gradient rows when asked."""

    engine: int  # index of the cache's engine in its group
    batch: InFlight
    pooled: torch.Tensor
    grad: torch.Tensor
    grad_out: torch.Tensor
    batch_size: int
    columns: torch.Tensor  # first output column of each feature, as the engine pools
    bound: tuple[int, int, int]  # the storage the TBE's graph reads and writes
    lr: float  # the learning rate the TBE's graph applies (fixed at its forward)


class TbeStep:
    """A TBE bound to one cache's slot storage, for one optimizer rule. The batch's bags reach
    it sample-major through the cache's ids family (`IdsOps.bags_sample_major`: one compiled
    pass where that family is numba's).

    Args:
        cache: the `HotCache` whose ``weights`` and ``state`` the TBE reads and updates, and
            whose bound ops (``ops``) move the bags.
        mode: the pooling mode of every feature of the cache (SUM or MEAN).
        rule: the optimizer rule; ``eps`` its epsilon.
    """

    def __init__(self, cache: Any, mode: PoolingMode, rule: OptimRule, eps: float) -> None:
        self.cache = cache
        self.ids = cache.ops.ids  # the family bound for the cache (`HotCache.ops`)
        self.mode = mode
        self.rule = rule
        self.eps = eps
        self._tbe: Any = None
        self._bound: tuple[int, int, int] = (0, 0, 0)
        # Direct mapping: each table's rows (in slot order) and the table of each feature;
        # None when the cache is set-associative (the TBE then reads slots).
        self.direct_tables: list[int] | None = None
        self.feature_tables: list[int] = []
        self._direct_tbe: Any = None
        self._direct_bound: tuple[int, int, int] = (0, 0, 0)
        self._lrs: dict[int, float] = {}  # the learning rate each TBE (by id) was given
        # `can_apply`'s answer for the last update it was asked about, but for the lr.
        self._checked: Any = None
        self._checked_fits = False

    @property
    def direct(self) -> bool:
        """Whether batches can be pooled by table and raw id (`pool_direct`)."""
        return self.direct_tables is not None

    @staticmethod
    def for_engine(engine: Any, optimizer: Any) -> TbeStep | None:
        """The TBE step of ``engine`` under ``optimizer``, or None when it does not apply."""
        update = getattr(optimizer, "update", None)
        if (
            update is None
            or engine.device.type != "cpu"
            or not engine.cache.backend.tbe  # the native family (`embcache.backend`)
            or fbgemm_type(update) is None
            or engine.cache.weights.dtype != torch.float32
            or not engine.cache.admits_all  # ids not admitted have slot -1
            or engine.dim % 4  # FBGEMM's CPU TBE takes dims that are multiples of 4
            or len(engine.layout.lookups) != 1
            or engine.layout.lookups[0].mode not in (PoolingMode.SUM, PoolingMode.MEAN)
            or _fbgemm() is None
        ):
            return None
        step = TbeStep(engine.cache, engine.layout.lookups[0].mode, update.rule, update.eps)
        if engine.cache.direct:
            # The cache's slots hold its tables one after another (ascending table index): a
            # TBE with those tables reads rows by raw id, each feature mapped to its table.
            order = sorted(t.index for t in engine.layout.tables)
            rows = {t.index: t.num_embeddings for t in engine.layout.tables}
            step.direct_tables = [rows[i] for i in order]
            step.feature_tables = [order.index(t.index) for t in engine.layout.feature_table]
        return step

    def _storage(self) -> tuple[int, int, int]:
        weights, state = self.cache.weights, self.cache.state
        return (weights.data_ptr(), state.data_ptr(), weights.shape[0])

    def _table(self) -> Any:
        """The TBE over the cache's current storage (made again when the cache reallocated
        it: a grown scratch area, a new optimizer state layout): one table, its rows the
        slots."""
        with self.cache.storage_lock:  # a prefetch growing the scratch area replaces both
            bound = self._storage()
            if self._tbe is None or bound != self._bound:
                self._tbe = self._make([self.cache.weights.shape[0]], None)
                self._bound = bound
            return self._tbe

    def _direct_table(self) -> Any:
        """The TBE over a direct-mapped cache's storage as its tables: one per table of the
        cache, in slot order, read by raw id."""
        with self.cache.storage_lock:
            bound = self._storage()
            if self._direct_tbe is None or bound != self._direct_bound:
                assert self.direct_tables is not None
                assert sum(self.direct_tables) == self.cache.weights.shape[0]
                self._direct_tbe = self._make(self.direct_tables, self.feature_tables)
                self._direct_bound = bound
            return self._direct_tbe

    def _make(self, table_rows: list[int], feature_tables: list[int] | None) -> Any:
        fbgemm, optim_type = _fbgemm(), RULES[self.rule].fbgemm_cpu
        assert fbgemm is not None and optim_type is not None  # as `for_engine` checked
        configs, common, training = fbgemm
        self._lrs.clear()  # the TBE it replaces may leave its id to the new one
        weights, state = self.cache.weights, self.cache.state
        dim = weights.shape[1]
        buffers = {"weights": _alias(weights)}
        if RULES[self.rule].state:  # FBGEMM's one state buffer: the rule's state columns
            buffers["momentum1"] = _alias(state)
        pooling = (
            common.PoolingMode.SUM if self.mode == PoolingMode.SUM else common.PoolingMode.MEAN
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return training.SplitTableBatchedEmbeddingBagsCodegen(
                [
                    (rows, dim, common.EmbeddingLocation.HOST, common.ComputeDevice.CPU)
                    for rows in table_rows
                ],
                feature_table_map=feature_tables,
                optimizer=getattr(configs.EmbOptimType, optim_type),
                learning_rate=0.0,  # set before each forward: its graph keeps it
                eps=self.eps,
                pooling_mode=pooling,
                # Slots are in range by making; raw ids were checked against their tables.
                bounds_check_mode=common.BoundsCheckMode.NONE,
                preallocated_host_buffers=buffers,
            )

    def _set_lr(self, tbe: Any, lr: float) -> None:
        """Give ``tbe`` the learning rate ``lr`` (a tensor fill, skipped when it has it)."""
        if self._lrs.get(id(tbe)) != lr:
            tbe.set_learning_rate(lr)
            self._lrs[id(tbe)] = lr

    def takes(self, weights: torch.Tensor | None) -> bool:
        """Whether a batch share with per-sample ``weights`` can go through the TBE (weighted
        MEAN cannot: the twins divide a weighted sum by the bag's length, which FBGEMM's MEAN
        does not)."""
        return weights is None or self.mode == PoolingMode.SUM

    @profiled("engine.pool")
    def pool(
        self, p: Prepared, lr: float, batch_size: int
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The batch's bags pooled by the TBE, ``[B * F, dim]`` sample-major (so that it is the
        ``[B, F * dim]`` output as it stands), with its autograd graph (whose backward is the
        TBE's row update at learning rate ``lr``), and the storage that graph is bound to."""
        tbe = self._table()
        self._set_lr(tbe, lr)  # the CPU op reads it at the forward
        # Moving the ids costs less than transposing the pooled rows and their gradient.
        assert p.slots is not None and p.inverse is not None  # resolved: not a direct share
        indices, offsets, weights = self.ids.bags_sample_major(
            p.slots, p.inverse, p.offsets, p.weights, batch_size
        )
        with torch.enable_grad():
            pooled = tbe(indices, offsets, per_sample_weights=weights)
        return pooled, self._bound

    @profiled("engine.pool")
    def pool_direct(
        self, p: Prepared, lr: float, batch_size: int
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """`pool` for a share served directly (`CacheEngine.direct_share`): the TBE reads the
        rows by table and raw id, the bags as the batch holds them, and pools ``[B, F * dim]``
        (the engine's output as it stands)."""
        assert p.direct is not None
        tbe = self._direct_table()
        self._set_lr(tbe, lr)
        with torch.enable_grad():
            pooled = tbe(p.direct.values, p.offsets, per_sample_weights=p.weights)
        return pooled, self._direct_bound

    def can_apply(self, pending: PendingUpdate, update: Any) -> bool:
        """Whether ``pending`` can be applied by the TBE under ``update``: the rule, learning
        rate and epsilon its graph was built with, and what `fbgemm_type` asks."""
        if update is not self._checked:  # a `RowUpdate` is frozen: asked once per object
            self._checked_fits = (
                update.rule == self.rule
                and fbgemm_type(update) is not None
                and update.eps == self.eps
            )
            self._checked = update
        return self._checked_fits and update.lr == pending.lr

    @profiled("engine.tbe_update")
    def apply(self, pending: PendingUpdate, p: Prepared) -> None:
        """Run the TBE's backward for ``pending``: every row of the batch updated in place.

        When the cache reallocated its storage since the forward (a prefetch grew the scratch
        area; rows keep their slots), the graph is built again over the new storage first, so
        the update lands there with the same arithmetic."""
        with self.cache.storage_lock:  # not `lock`: a prefetch may resolve meanwhile
            pooled = pending.pooled
            if pending.bound != self._storage():
                again = self.pool_direct if p.direct is not None else self.pool
                pooled, _ = again(p, pending.lr, pending.batch_size)
            torch.autograd.backward(pooled, pending.grad)
