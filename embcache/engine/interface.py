"""The interface every cached collection implements, one process or sharded over many.

`CachedCollectionInterface` fixes what the rest of embcache relies on: the sparse optimizers
(`attach_sparse_optimizer`, `sparse_gradients`, `apply_sparse_gradients`, `zero_grad`, whole
tables through `table_rows` / `write_table_rows`), `TrainPipeline` (`issue_fused_prefetch`,
`set_fused_prefetch_handle`, `cancel_fused_prefetch`), checkpoints (``store``, ``tables``,
`flush`, `invalidate_caches`), torchrec-style ``state_dict()`` keys and the accessors of
torchrec's ``EmbeddingBagCollectionInterface`` (`embedding_bag_configs`, `is_weighted`,
``device``). Each collection holds an `EngineGroup` (``self.engines``) and its own data path;
neither subclasses the other, as torchrec's sharded modules implement its module interfaces
rather than extend the unsharded ones.

Threads: a collection trains from one thread at a time. Its first training forward claims it
for the calling thread until that thread's step (or `zero_grad` / `reset_trace`) completes;
another thread's training forward, backward, step, `zero_grad` or prefetch meanwhile raises a
`RuntimeError` naming both threads, before anything changes (`embcache.engine.claim`). Reading
works from any thread as before: inference under ``torch.no_grad()``, `flush`,
``embcache.save``, ``state_dict``, `table_rows`.
"""

from __future__ import annotations

import abc
import atexit
import functools
import gc
import os
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.devices import resolve_device
from embcache.engine.batch_state import FusedPrefetchHandle, TraceEntry
from embcache.engine.group import EngineGroup
from embcache.engine.inputs import JaggedBatch, as_jagged, checked_batch
from embcache.engine.optimizer import AttachedOptimizer, DeviceCheck, StepOptimizer
from embcache.engine.options import FUSION_K as FUSION_K  # where the collections import it
from embcache.engine.options import MAX_FUSION_K as MAX_FUSION_K
from embcache.engine.options import CollectionOptions
from embcache.engine.row_init import table_inits
from embcache.engine.tables import Table, TableConfig, normalize_tables
from embcache.kv.base import Store, TableSpec
from embcache.kv.host import HostKV
from embcache.kv.url import open_store

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


def _whole_tables(tables: Sequence[Table], cache: CacheConfig, device: torch.device) -> bool:
    """Whether every cache (one per dim, or per table: `CacheConfig.split`) holds all the rows
    of its tables."""
    for config, mine in cache.split(tables):
        sizes = [t.num_embeddings for t in mine]
        if None in sizes:
            return False
        rows = sum(s for s in sizes if s is not None)
        if config.rows_for(rows, mine[0].dim, device) < rows:
            return False
    return True


def _as_config(table: Table, cfg: Any) -> Any:
    """The config object `embedding_bag_configs` returns for one table."""
    if isinstance(cfg, Mapping):
        return TableConfig(
            name=table.name,
            embedding_dim=table.dim,
            num_embeddings=table.num_embeddings,
            feature_names=list(table.feature_names),
            pooling=table.pooling,
            init_fn=table.init_fn,
            data_type=table.dtype,
        )
    if not cfg.feature_names:
        cfg.feature_names = list(table.feature_names)  # torchrec fills it in the same way
    return cfg


class _CloseAtExit:
    """The exit hook of one collection: `CachedCollectionInterface.close` if the collection is
    still alive (a weak reference: a collection garbage-collected before is skipped), in the
    process that built it only. A child forked from that process inherits the hook with a copy
    of the cache, whose dirty rows are older than what the parent has written since: writing
    them back at the child's exit would roll the parent's rows back."""

    def __init__(self, collection: CachedCollectionInterface) -> None:
        self._collection = weakref.ref(collection)
        self._pid = os.getpid()

    def __call__(self) -> None:
        if os.getpid() != self._pid:
            return
        _collect_garbage_once()
        collection = self._collection()
        if collection is not None:
            collection._close_at_exit()


@functools.cache
def _collect_garbage_once() -> None:
    """Collect unreachable reference cycles (a collection is one) before the first exit hook,
    so collections the program dropped are skipped rather than written back."""
    gc.collect()


class CachedCollectionInterface(nn.Module, abc.ABC):
    """Pooled embedding lookups over device caches with a write-back tier behind them.

    Subclasses call `_setup` from their constructor and implement the data path (`forward`,
    the prefetch calls) and whole-table access (`table_rows`, `write_table_rows`).

    Attributes:
        options: the `CollectionOptions` it was built with (a sharded rank's store resolved).
        tables: the normalised tables (`Table`), in the order given.
        store: the tier.
        device: where the caches and outputs live.
        engines: the `EngineGroup` (one `CacheEngine` per embedding dim).
        features: the input keys looked up, each once, in table order.
        output_keys: the output's keys: every table's features, in table order
            (``feature@table`` for a feature several tables look up).
        output_dims: the embedding dim of each output key.
    """

    # The tables' kind (pooled bags, or one row per value) and the name torchrec gives their
    # weights in ``state_dict()``: ``<weights_prefix>.<table>.weight``.
    pooled = True
    weights_prefix = "embedding_bags"

    def _setup(
        self,
        tables: Sequence[Any],
        is_weighted: bool,
        options: CollectionOptions,
        cache: CacheConfig | None = None,
    ) -> None:
        """Build what every collection shares: tables, store, initialisers, engines.

        ``options.device=None`` is torch's default device (``with torch.device("meta"):``
        included); ``options.seed=None`` takes the rows' randomness from torch's generator
        (`engine.row_init`). ``cache``: the caches' config when it is a share of
        ``options.cache`` (a sharded rank's); None: ``options.cache``. Whether every row is
        cached, for the rows' initialisation, is the whole config's answer. A callable
        ``options.store`` (a sharded collection's, ``store(rank)``) is resolved before.
        """
        self.options = options
        self.tables = normalize_tables(tables, self.pooled)
        self._configs = [_as_config(t, cfg) for t, cfg in zip(self.tables, tables, strict=True)]
        self.fusion_k = checked_fusion_k(options, self.tables)
        self.enable_fusion = options.enable_fusion
        self._is_weighted = bool(is_weighted)
        # Resolved here, on the caller's thread: ``cuda`` means its current device.
        device = options.device
        self.device = resolve_device(torch.get_default_device() if device is None else device)
        whole_cfg = options.cache or CacheConfig()
        self.cache_config = cache or whole_cfg
        self.cache_config.check_tables([t.name for t in self.tables])  # before the store opens
        # A store the collection opened (a URL, None) is its own: `close` closes it.
        store = cast("Store | str | None", options.store)  # a callable is refused there
        self._owns_store = not isinstance(store, Store)
        self.store = open_store(store)
        self.update_in_backward = options.applies_in_backward
        self.accumulate_grads = options.accumulate_grads
        self.lr = options.lr
        self.features = list(dict.fromkeys(f for t in self.tables for f in t.feature_names))
        self.output_keys = [k for t in self.tables for k in t.key_names]
        self.output_dims = [t.dim for t in self.tables for _ in t.key_names]
        cfg = self.cache_config
        whole = whole_cfg.tier_capacity is None and _whole_tables(
            self.tables, whole_cfg, self.device
        )
        seed = options.seed
        inits = table_inits(self.tables, seed, whole, self.device, per_table=not self.pooled)
        weight_dtype = cfg.weight_dtype
        assert weight_dtype is None or isinstance(weight_dtype, torch.dtype)  # __post_init__
        self.specs = {
            t.name: TableSpec(
                t.name,
                t.dim,
                t.num_embeddings,
                init=inits[t.name],
                seed=seed or 0,
                dtype=weight_dtype or t.dtype,
                capacity=cfg.tier_capacity_of(t.name),
                score=cfg.tier_policy,
            )
            for t in self.tables
        }
        for spec in self.specs.values():
            self.store.init_table(spec)
        self.engines = EngineGroup(
            self.tables, self.specs, self.store, self.cache_config, self.device, self.fusion_k,
            options,
        )  # fmt: skip
        self.engines.set_owner(self)
        # Requires grad, so the pooling op is recorded although the rows are no leaves.
        self.grad_anchor = torch.empty(0, requires_grad=True)
        # Registered after the store was opened (and its own exit hook, a Redis tier's lease
        # release), so it runs before it: atexit runs last-registered first.
        self._closed = False
        self._exit_hook = _CloseAtExit(self)
        atexit.register(self._exit_hook)

    # -- copies: refused, with what to do instead ------------------------------------------

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """Refused: the rows live in the caches and the tier, not in the module (a copy would
        have to duplicate a tier that may be far larger than memory, or share it and break
        the one-writer-per-row rule)."""
        raise TypeError(
            f"copy.deepcopy of a {type(self).__name__} is not supported: its rows live in a "
            "device cache and a tier, not in the module. To copy it, build a new collection "
            "with the same tables and call new.load_state_dict(old.state_dict()) (the "
            "weights), or embcache.save(path, old_model, optimizers) then "
            "embcache.load(path, new_model, optimizers) (weights and optimizer state)"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused (``pickle``, ``torch.save(module)``, ``copy.copy``): checkpoints hold data,
        never pickled modules."""
        raise TypeError(
            f"a {type(self).__name__} cannot be pickled (pickle, torch.save(module), "
            "copy.copy): its rows live in a device cache and a tier, not in the module. Save "
            "the data instead: embcache.save(path, model, optimizers) (weights and optimizer "
            "state, checksummed) or torch.save(model.state_dict()) (torchrec's keys); rebuild "
            "the model and load it with embcache.load(path, model, optimizers) or "
            "model.load_state_dict(...)"
        )

    def checked_input(self, features: object, read_lengths: bool = True) -> JaggedBatch:
        """``features`` (a KJT or a `JaggedBatch`) as a checked `JaggedBatch` holding what this
        collection looks up (other keys are ignored, as are weights when not `is_weighted`);
        without ``read_lengths``, the checks of its lengths' values pending
        (`checked_batch`)."""
        return checked_batch(as_jagged(features), self.features, self._is_weighted, read_lengths)

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

    @property
    def _fused_prefetch_handle(self) -> FusedPrefetchHandle | None:
        """RecStore's name for `pending_prefetch`."""
        return self.engines.prefetches.recorded

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

    # -- caches, statistics -----------------------------------------------------------------

    def flush(self) -> None:
        """Write every dirty cached row back to the tier."""
        self.engines.flush()

    # -- the end of a run ---------------------------------------------------------------------

    def close(self) -> None:
        """End training: drop pending gradients (and prefetch handles), write every dirty
        cached row back, then close the store if the collection opened it (a URL or None; a
        Redis tier releases its owner leases, so the next job opens the tables at once) or
        flush it if it was given (`Store.flush`: a tiered store writes its host rows through)
        and left open for its owner. Leaving ``with collection:`` calls it, and so does the
        interpreter's exit for a collection still alive then.

        Idempotent. If the write-back fails nothing is closed, the rows stay dirty in the
        cache, and the call (or the exit) may try again. Later training calls (a forward with
        gradients, a prefetch, an optimizer step) raise `RuntimeError`; lookups on a closed
        store fail.
        """
        if self._closed:
            return
        if self.device.type != "meta":
            self.engines.zero_grad()  # waits for an in-flight prefetch before the write-back
            self.engines.flush()
        if self._owns_store:
            self.store.close()
        else:
            self.store.flush()
        self._closed = True
        self.engines.claim.closed = True  # training calls are refused from now on
        atexit.unregister(self._exit_hook)

    def __enter__(self) -> CachedCollectionInterface:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_at_exit(self) -> None:
        """`close` at interpreter exit; a failure is one line on stderr (the collection, the
        error, the dirty rows left unwritten), never a traceback."""
        if self._closed:
            return
        if isinstance(self.store, HostKV):
            return  # in-process rows end with the process: nothing to write back
        # concurrent.futures refuses new work once the interpreter is shutting down, so the
        # caches make their tier calls in turn (an instance attribute over the class's).
        self.store.parallel_io = False
        try:
            self.close()
        except Exception as e:
            print(
                f"embcache: {type(self).__name__} of tables {[t.name for t in self.tables]} "
                f"on {self.store!r} could not write back its cache at exit "
                f"({type(e).__name__}: {' '.join(str(e).split())}); {self._dirty_rows()} "
                "dirty rows not written",
                file=sys.stderr,
            )

    def _dirty_rows(self) -> int | str:
        try:
            return sum(int(cache.dirty.sum()) for cache in self.caches())
        except Exception:
            return "an unknown number of"

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
        total: dict[str, float] = {}
        for cache in self.caches():
            for k, v in cache.cache_stats().items():
                total[k] = total.get(k, 0) + v
        looked_up = total.get("hits", 0) + total.get("misses", 0)
        total["hit_rate"] = total.get("hits", 0) / looked_up if looked_up else 0.0
        return total

    def reset_stats(self) -> None:
        self.engines.reset_stats()

    # -- torchrec's state_dict keys ---------------------------------------------------------

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        # An unbounded table has no [num_embeddings, dim] tensor: `embcache.save` holds its rows.
        for t in self.tables:
            if t.num_embeddings is None:
                continue
            key = f"{prefix}{self.weights_prefix}.{t.name}.weight"
            if self.device.type == "meta":
                destination[key] = torch.empty(
                    t.num_embeddings, t.dim, dtype=t.dtype, device="meta"
                )
            else:
                destination[key] = self.table_rows(t.name)[:, : t.dim].to(t.dtype)

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
        expected = {
            f"{prefix}{self.weights_prefix}.{t.name}.weight": t
            for t in self.tables
            if t.num_embeddings is not None
        }
        updates = []
        for key, t in expected.items():
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                error_msgs.append(
                    f"{key} has dtype {getattr(value, 'dtype', type(value).__name__)}; table "
                    f"weights must be floating point"
                )
                continue
            if tuple(value.shape) != (t.num_embeddings, t.dim):
                error_msgs.append(
                    f"size mismatch for {key}: checkpoint has {tuple(value.shape)}, table "
                    f"{t.name!r} is {(t.num_embeddings, t.dim)}"
                )
                continue
            if not value.is_meta and not bool(torch.isfinite(value).all()):
                error_msgs.append(f"{key} holds NaN or Inf values")
                continue
            updates.append((t, value))
        # Every key under this module's prefix is ours: its parameters stand for the tables,
        # which state_dict() holds under these keys, and its children hold nothing.
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
        if error_msgs or (strict and (missing_keys or unexpected_keys)):
            return  # nn.Module raises with these messages; nothing was written
        if self.device.type == "meta":
            return  # no rows to write, as torchrec's meta weights take no values
        for t, value in updates:
            self.write_table_rows(t.name, value.detach(), slice(0, t.dim))
