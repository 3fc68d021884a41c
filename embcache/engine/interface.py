"""The interface every cached collection implements, one process or sharded over many.

`CachedCollectionInterface` fixes what the rest of embcache relies on: the sparse optimizers
(`attach_sparse_optimizer`, `sparse_gradients`, `apply_sparse_gradients`, `zero_grad`, whole
tables through `table_rows` / `write_table_rows`), `TrainPipeline` (`issue_fused_prefetch`,
`set_fused_prefetch_handle`, `cancel_fused_prefetch`), checkpoints (``store``, ``tables``,
`flush`, `invalidate_caches`), torchrec-style ``state_dict()`` keys and the accessors of
torchrec's ``EmbeddingBagCollectionInterface`` (`embedding_bag_configs`, `is_weighted`,
``device``). Each collection holds an `EngineGroup` (``self.engines``) and its own data path;
neither subclasses the other, as torchrec's sharded modules implement its module interfaces
rather than extend the unsharded ones. The interface itself is the surface and thin
delegations: `build_collection` builds what it declares, and its bodies are parts it holds
or calls (`CollectionLifetime`: the store and closing; `engine.collection_state`: the
``state_dict()`` keys and the refused copies; `engine.collection_setup`: the tables declared).

Threads: a collection trains from one thread at a time. Its first training forward claims it
for the calling thread until that thread's step (or `zero_grad` / `reset_trace`) completes;
another thread's training forward, backward, step, `zero_grad` or prefetch meanwhile raises a
`RuntimeError` naming both threads, before anything changes (`embcache.engine.claim`). Reading
works from any thread as before: inference under ``torch.no_grad()``, `flush`,
``embcache.save``, ``state_dict``, `table_rows`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.devices import resolve_device
from embcache.engine.batch_state import FusedPrefetchHandle, TraceEntry
from embcache.engine.collection_lifetime import CollectionLifetime
from embcache.engine.collection_setup import as_config, declare_tables
from embcache.engine.collection_state import (
    deepcopy_refused,
    load_weights,
    pickle_refused,
    save_weights,
)
from embcache.engine.group import EngineGroup
from embcache.engine.inputs import JaggedBatch, as_jagged, checked_batch
from embcache.engine.optimizer import AttachedOptimizer, DeviceCheck, StepOptimizer
from embcache.engine.options import FUSION_K as FUSION_K  # where the collections import it
from embcache.engine.options import MAX_FUSION_K as MAX_FUSION_K
from embcache.engine.options import CollectionOptions
from embcache.engine.tables import Table, normalize_tables
from embcache.kv.base import Store, TableSpec

UNFUSED_K = 48  # enable_fusion=False: internal fusion with room for ids below 2**48


def checked_fusion_k(options: CollectionOptions, tables: Sequence[Table]) -> int:
    """The fusion width a collection uses (``options.fusion_k``, or 48 bits without
    ``enable_fusion``), after checking its bounded tables fit it (an unbounded table's ids
    beyond it are folded into its bits by a hash, `kernels.ids`); ``fusion_k`` itself was
    checked by `CollectionOptions`."""
    k = options.fusion_k if options.enable_fusion else UNFUSED_K
    if len(tables) > 1 << (62 - k):
        raise ValueError(
            f"{len(tables)} tables do not fit the {62 - k} prefix bits left by fusion_k={k}"
        )
    for t in tables:
        if t.num_embeddings is not None and t.num_embeddings > 1 << k:
            raise ValueError(
                f"table {t.name!r}: num_embeddings={t.num_embeddings} needs more than "
                f"fusion_k={k} bits; raise fusion_k to at least "
                f"{(t.num_embeddings - 1).bit_length()}"
            )
    return k


class WeightedFlag:
    """``is_weighted`` of a collection: call it as torchrec does (``ebc.is_weighted()``) or
    read it as a bool as RecStore-style code does (``if ebc.is_weighted:``); both give the
    same answer."""

    __slots__ = ("_value",)

    def __init__(self, value: bool) -> None:
        self._value = bool(value)

    def __call__(self) -> bool:
        return self._value

    def __bool__(self) -> bool:
        return self._value

    def __eq__(self, other: object) -> bool:
        return self._value == (other._value if isinstance(other, WeightedFlag) else other)

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return repr(self._value)


def summed_cache_stats(caches: Sequence[HotCache]) -> dict[str, float]:
    """Every counter of ``caches`` (`HotCache.cache_stats`) summed, and the hit rate."""
    total: dict[str, float] = {}
    for cache in caches:
        for k, v in cache.cache_stats().items():
            total[k] = total.get(k, 0) + v
    looked_up = total.get("hits", 0) + total.get("misses", 0)
    total["hit_rate"] = total.get("hits", 0) / looked_up if looked_up else 0.0
    return total


def build_collection(
    collection: CachedCollectionInterface,
    tables: Sequence[Any],
    is_weighted: bool,
    options: CollectionOptions,
    cache: CacheConfig | None,
) -> None:
    """Build what every collection shares (`CachedCollectionInterface._setup`): tables,
    store, initialisers, engines; every attribute the interface declares.

    ``options.device=None`` is torch's default device (``with torch.device("meta"):``
    included); ``options.seed=None`` takes the rows' randomness from torch's generator
    (`engine.row_init`). ``cache``: the caches' config when it is a share of ``options.cache``
    (a sharded rank's); None: ``options.cache``. Whether every row is cached, for the rows'
    initialisation, is the whole config's answer. A callable ``options.store`` (a sharded
    collection's, ``store(rank)``) is resolved before.
    """
    c = collection
    c.options = options
    c.tables = normalize_tables(tables, c.pooled)
    c._configs = [as_config(t, cfg) for t, cfg in zip(c.tables, tables, strict=True)]
    c.fusion_k = checked_fusion_k(options, c.tables)
    c.enable_fusion = options.enable_fusion
    c._is_weighted = bool(is_weighted)
    # Resolved here, on the caller's thread: ``cuda`` means its current device.
    device = options.device
    c.device = resolve_device(torch.get_default_device() if device is None else device)
    c.cache_config = cache or options.cache or CacheConfig()
    c.cache_config.check_tables([t.name for t in c.tables])  # before the store opens
    store = cast("Store | str | None", options.store)  # a callable is refused there
    c.lifetime = CollectionLifetime(store, c.device)  # a store it opens is its own
    c.store = c.lifetime.store
    c.update_in_backward = options.applies_in_backward
    c.accumulate_grads = options.accumulate_grads
    c.lr = options.lr
    c.features = list(dict.fromkeys(f for t in c.tables for f in t.feature_names))
    c.output_keys = [k for t in c.tables for k in t.key_names]
    c.output_dims = [t.dim for t in c.tables for _ in t.key_names]
    c.specs = declare_tables(c.store, c.tables, options, c.cache_config, c.device, not c.pooled)
    c.engines = EngineGroup(
        c.tables, c.specs, c.store, c.cache_config, c.device, c.fusion_k, options
    )
    c.engines.set_owner(c)
    # Requires grad, so the pooling op is recorded although the rows are no leaves.
    c.grad_anchor = torch.empty(0, requires_grad=True)
    c.lifetime.watch(c, c.engines)  # after the store's own exit hook: it runs before it


def refuse_replicas(name: str) -> None:
    """Raise if a process group of more than one rank is initialised: a collection named
    ``name`` would train one unsharded copy of its tables per rank (`check_not_replicated`).
    DistributedModelParallel has no sharder for it without embcache's, and
    DistributedDataParallel reduces only parameters, of which it has one zero-size anchor."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return
    world = dist.get_world_size()
    if world > 1:
        raise RuntimeError(
            f"{name} is not sharded, but the process group has {world} "
            "ranks: each rank would train its own copy of the tables and they would "
            "silently diverge (DistributedDataParallel averages only dense parameters, and "
            "DistributedModelParallel leaves it unsharded without embcache's sharder). "
            "Under DistributedModelParallel, a CachedEmbeddingBagCollection takes "
            "sharders=[embcache.torchrec.CachedEmbeddingBagCollectionSharder(...)] and a "
            "plan from embcache.torchrec.CachedEmbeddingShardingPlanner (README: Scaling "
            "out with torchrec). Without torchrec's engine, shard the rows with "
            "embcache.distributed.ShardedEmbeddingBagCollection (same arguments; "
            "DLRM(..., collection_cls=ShardedEmbeddingBagCollection)), or run "
            "`embcache train --nproc N`, which does. To keep one independent replica per "
            "rank on purpose, build the collection with allow_unsharded_replicas=True."
        )


class CachedCollectionInterface(nn.Module, abc.ABC):
    """Pooled embedding lookups over device caches with a write-back tier behind them.

    Subclasses call `_setup` from their constructor and implement the data path (`forward`,
    the prefetch calls) and whole-table access (`table_rows`, `write_table_rows`). The rest
    delegates to the parts the collection holds: its `EngineGroup` (``engines``: steps,
    caches, prefetch handles), its `CollectionLifetime` (``lifetime``: the store, `close`) and
    `engine.collection_state` (``state_dict()`` keys, refused copies).
    """

    # The tables' kind (pooled bags, or one row per value) and the name torchrec gives their
    # weights in ``state_dict()``: ``<weights_prefix>.<table>.weight``.
    pooled = True
    weights_prefix = "embedding_bags"

    # What `_setup` gives every collection (`build_collection`):
    options: CollectionOptions  # as built (a sharded rank's store resolved)
    tables: list[Table]  # normalised (`Table`), in the order given
    store: Store  # the tier
    device: torch.device  # where the caches and outputs live
    engines: EngineGroup  # one `CacheEngine` per embedding dim (or per table given a size)
    lifetime: CollectionLifetime  # the store's owner; `close`
    features: list[str]  # the input keys looked up, each once, in table order
    output_keys: list[str]  # every table's features in table order (or ``feature@table``)
    output_dims: list[int]  # the embedding dim of each output key
    specs: dict[str, TableSpec]  # each table as the store declared it
    cache_config: CacheConfig  # this collection's caches (a sharded rank's share)
    fusion_k: int
    enable_fusion: bool
    update_in_backward: bool
    accumulate_grads: bool
    lr: float | None
    grad_anchor: torch.Tensor
    _configs: list[Any]
    _is_weighted: bool

    def _setup(
        self,
        tables: Sequence[Any],
        is_weighted: bool,
        options: CollectionOptions,
        cache: CacheConfig | None = None,
    ) -> None:
        """Build what every collection shares: tables, store, initialisers, engines
        (`build_collection`, where ``options`` and ``cache`` are explained)."""
        build_collection(self, tables, is_weighted, options, cache)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """Refused, saying what to do instead (`collection_state.deepcopy_refused`)."""
        raise deepcopy_refused(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused (``pickle``, ``torch.save(module)``, ``copy.copy``): checkpoints hold data."""
        raise pickle_refused(self)

    def checked_input(self, features: object, read_lengths: bool = True) -> JaggedBatch:
        """``features`` (a KJT or a `JaggedBatch`) as a checked `JaggedBatch` holding what this
        collection looks up (other keys are ignored, as are weights when not `is_weighted`);
        without ``read_lengths``, the checks of its lengths' values pending
        (`checked_batch`)."""
        return checked_batch(as_jagged(features), self.features, self._is_weighted, read_lengths)

    def check_not_replicated(self) -> None:
        """What a collection that holds every row on each rank checks at each forward: refuse
        to run as one unsharded replica per rank (unless built with
        ``allow_unsharded_replicas=True``) in a process group of more than one rank, where
        each rank's copy of the tables would train on its own batches only: how a
        ``DistributedModelParallel`` or ``DistributedDataParallel`` wrapping it is caught.

        Raises:
            RuntimeError: naming `embcache.torchrec.CachedEmbeddingBagCollectionSharder` (for
                DistributedModelParallel) and `embcache.distributed.ShardedEmbeddingBagCollection`.
        """
        if not self.options.allow_unsharded_replicas:
            refuse_replicas(type(self).__name__)

    # -- torchrec's EmbeddingBagCollectionInterface -----------------------------------------

    @property
    def is_weighted(self) -> WeightedFlag:
        """Whether inputs carry per-sample weights: ``ebc.is_weighted()`` (torchrec) or
        ``bool(ebc.is_weighted)``."""
        return WeightedFlag(self._is_weighted)

    def embedding_bag_configs(self) -> list[Any]:
        """The table configs as given (torchrec ``EmbeddingBagConfig`` objects where given;
        `TableConfig` objects for `TableConfig` objects and dicts)."""
        return self._configs

    # -- the data path (each collection's own) ----------------------------------------------

    @abc.abstractmethod
    def forward(self, features: Any) -> Any: ...

    @abc.abstractmethod
    def issue_fused_prefetch(self, features: Any) -> FusedPrefetchHandle: ...

    @abc.abstractmethod
    def table_rows(self, table: str, chunk_rows: int = 1 << 16) -> torch.Tensor:
        """Every row ``[num_embeddings, dim + state_dim]`` of a table. CPU float32."""

    @abc.abstractmethod
    def write_table_rows(self, table: str, rows: torch.Tensor, columns: slice) -> None:
        """Overwrite ``columns`` of every row of a table (others kept)."""

    def set_fused_prefetch_handle(self, handle: FusedPrefetchHandle | None) -> None:
        """Make the next forward use ``handle`` (which must come from this collection; issuing
        records a handle already, so this is needed only to choose another, or None)."""
        self.engines.set_prefetch(handle, id(self))

    def cancel_fused_prefetch(self, handle: FusedPrefetchHandle) -> None:
        """Release a handle that will not be used (waits for its prefetch first)."""
        self.engines.cancel(handle, id(self))

    @property
    def pending_prefetch(self) -> FusedPrefetchHandle | None:
        """The handle the next forward uses, if any."""
        return self.engines.prefetches.recorded

    _fused_prefetch_handle = pending_prefetch  # RecStore's name

    # -- what a sparse optimizer drives -----------------------------------------------------

    @property
    def _trace(self) -> list[TraceEntry]:
        """The recorded gradients, ``(table_name, ids, grads)`` per table and backward
        (RecStore's ``module._trace``)."""
        return self.engines.entries()

    def attach_sparse_optimizer(self, optimizer: AttachedOptimizer) -> None:
        """Give every row ``optimizer``'s state columns (fresh state, weights kept)."""
        self.engines.attach(optimizer)

    def sparse_gradients(self) -> list[tuple[str, Any, torch.Tensor]]:
        """The gradients the next step applies, as the optimizer checks them for NaN/Inf:
        ``(table_name, ids, grads)`` trace entries, and for a cache on the TBE step its
        pooled gradient (``ids`` None). ``_trace`` gives the per-id rows of every table.

        Raises:
            RuntimeError: another thread is training the collection (an optimizer's ``step()``
                asks every module before it applies any, so nothing has changed).
        """
        self.engines.claim.check("optimizer step")
        return self.engines.gradients_to_check()

    def apply_sparse_gradients(self, optimizer: StepOptimizer) -> None:
        self.engines.apply_trace(self.step_optimizer(optimizer))

    def apply_checked_gradients(self, optimizer: StepOptimizer, check: DeviceCheck | None) -> None:
        """`apply_sparse_gradients`, reading the optimizer's gradient ``check`` with the
        step's lock check (`embcache.optim.protocol.ChecksInStep`): one host read a step."""
        self.engines.apply_trace(self.step_optimizer(optimizer), check=check)

    def step_optimizer(self, optimizer: StepOptimizer) -> StepOptimizer:
        """The optimizer whose rule a step applies: ``optimizer`` (a RecStore collection's
        KV client may name its own)."""
        return optimizer

    def sparse_tables(self) -> list[Table]:
        """The tables whose rows hold the attached optimizer's state."""
        return list(self.tables)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the recorded gradients and the locks of every forward in flight, and release
        every prefetch handle (from the thread training the collection, or when none is)."""
        del set_to_none  # nothing of ours is an nn.Parameter gradient
        self.engines.zero_grad()

    def reset_trace(self) -> None:
        """RecStore's name for `zero_grad`: drop ``_trace`` (and what its forwards and the
        prefetch handles hold)."""
        self.engines.zero_grad()

    # -- caches, statistics, the end of a run -----------------------------------------------

    def flush(self) -> None:
        """Write every dirty cached row back to the tier."""
        self.engines.flush()

    def close(self) -> None:
        """End training: drop pending gradients, write every dirty cached row back, close the
        store if the collection opened it (a URL or None), else flush it (`CollectionLifetime`).
        Leaving ``with collection:`` calls it, as does the exit of the interpreter. Idempotent;
        after a failed write-back nothing is closed and it may be called again. Later training
        calls raise `RuntimeError`; lookups on a closed store fail."""
        self.lifetime.close()

    def __enter__(self) -> CachedCollectionInterface:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def invalidate_caches(self) -> None:
        """Drop pending gradients, write back and empty every cache (the next batch reads
        everything from the tier); prefetch handles issued before become stale."""
        self.engines.invalidate()

    def caches(self) -> list[HotCache]:
        """The caches: one per distinct embedding dim, and one per table a per-table
        ``capacity``/``load_factor`` names (`CacheConfig.split`)."""
        return self.engines.caches()

    def cache_stats(self) -> dict[str, float]:
        """The caches' counters (`HotCache.cache_stats`: hits, misses, evictions, writebacks,
        admissions refused, gradients dropped) summed over the caches, and the hit rate."""
        return summed_cache_stats(self.caches())

    def reset_stats(self) -> None:
        self.engines.reset_stats()

    # -- torchrec's state_dict keys (`engine.collection_state`) -----------------------------

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        save_weights(self, destination, prefix)

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        load_weights(self, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)
