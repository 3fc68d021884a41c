"""RecStore's names and signatures for the cached collections, with their tables in the KV
client: `RecStoreEmbeddingBagCollection` (pooled bags, `CachedEmbeddingBagCollection`) and
`RecStoreEmbeddingCollection` (one row per id, `CachedEmbeddingCollection`). What they share —
the client's resolution, the tables' registration as the client's tensors (`CollectionTable`),
the backend optimizer — is `KVClientCollection`'s.

Whose optimizer updates the rows. RecStore's ``SparseSGD.step()`` aggregates the collection's
``_trace`` and calls ``kv_client.update_async(name, ids, grads)``; "the learning rate and the
optimizer formula are handled by the backend". So on a KV client with a backend optimizer
(``get_kv_client(optimizer={"type": "AdaGrad", "learning_rate": 0.05})``) the collection's rows
get that optimizer (rule, lr, eps, weight decay; its state beside each row from construction),
whatever ``SparseSGD(lr=...)`` says; another sparse optimizer must match it (as RecStore's
``SparseRowWiseAdagrad`` checks the server's), else ValueError. On a client without one
(``get_kv_client()`` never given an optimizer, or a client of the collection's own store) the
attached sparse optimizer applies its own rule and hyper-parameters, as for any cached
collection. `DistEmbedding` keeps its Python-side SGD either way.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from embcache.engine.batch_state import TraceEntry
from embcache.engine.options import CollectionOptions, option_names
from embcache.engine.tables import Table, TableConfig
from embcache.kernels.optim import OptimRule, RowUpdate, aggregate_grads
from embcache.kv.base import Store
from embcache.models.collection import CachedEmbeddingBagCollection
from embcache.models.local import LocalCollection
from embcache.models.sequence import CachedEmbeddingCollection
from embcache.recstore.kv_client import KVClient, KVOptimizer, get_kv_client

# RecStore's defaults where they differ from `CollectionOptions`' own.
RECSTORE_DEFAULTS = {"lr": 0.01}


class KVClientCollection(LocalCollection):
    """A cached collection whose tables are tensors of a KV client (``kv_client``), read and
    written through its caches: the part the RecStore collections share. A subclass lists it
    before its cached collection, builds that on the options and client `client_options`
    gives, then joins the client (`join_kv_client`)."""

    kv_client: KVClient  # the client whose store holds the tables
    # What updates the rows when the client has a backend optimizer (the module's docstring),
    # else None; None until `join_kv_client` (a fused optimizer attaches before it).
    backend_optimizer: BackendOptimizer | None = None

    def join_kv_client(self, kv_client: KVClient) -> None:
        """Adopt the client's backend optimizer, if it has one, and register every table as
        one of its tensors.

        Raises:
            ValueError: a table's name is already a tensor of the client, or a table of another
                live collection on it (two caches of the same rows would disagree).
        """
        self.kv_client = kv_client
        if kv_client.backend_optimizer is not None:
            self.backend_optimizer = BackendOptimizer(kv_client.backend_optimizer)
            super().attach_sparse_optimizer(self.backend_optimizer)
        for table in self.tables:
            _register(kv_client, table.name, CollectionTable(self, table), self)

    def attach_sparse_optimizer(self, optimizer: Any) -> None:
        """Attach a sparse optimizer. With a backend optimizer, SparseSGD only drives the
        steps (the backend's rule applies); any other must have the backend's rule and
        hyper-parameters (`BackendOptimizer.admit`).

        Raises:
            ValueError: a non-SGD optimizer that differs from the backend optimizer.
        """
        if self.backend_optimizer is None:
            super().attach_sparse_optimizer(optimizer)
        else:
            self.backend_optimizer.admit(optimizer)

    def step_optimizer(self, optimizer: Any) -> Any:
        """The backend optimizer when the client has one (it applies the trace), else
        ``optimizer``."""
        return self.backend_optimizer or optimizer


def client_options(
    called: dict[str, Any], kwargs: dict[str, Any]
) -> tuple[CollectionOptions, KVClient]:
    """A RecStore collection's options and KV client, from its constructor's locals
    (``called``: RecStore's ``lr``, ``enable_fusion``, ``fusion_k``, ``ps_host``, ``ps_port``,
    ``kv_client``, ``fast_path_mode`` as called) and the cached collection's option keywords
    in its ``kwargs`` (taken out), or ``options=`` (its ``lr`` None: RecStore's 0.01). The
    client is resolved (`resolve_kv_client`, which checks every argument), and the options'
    ``store`` is the client's.
    """
    given = {**called, **{k: kwargs.pop(k) for k in option_names() if k in kwargs}}
    passed = kwargs.pop("options", None)
    options = CollectionOptions.given(passed, given, RECSTORE_DEFAULTS)
    if passed is not None and options.lr is None:  # RecStore's default lr applies
        options = dataclasses.replace(options, lr=RECSTORE_DEFAULTS["lr"])
    store = cast("Store | str | None", options.store)  # a callable is refused there
    client = resolve_kv_client(
        called["kv_client"],
        store,
        called["ps_host"],
        called["ps_port"],
        called["fast_path_mode"],
        options.optimizer_type,
    )
    return dataclasses.replace(options, store=client.store), client


def resolve_kv_client(
    kv_client: KVClient | None,
    store: Store | str | None,
    ps_host: str | None,
    ps_port: int | None,
    fast_path_mode: str,
    optimizer_type: type | None,
) -> KVClient:
    """The client a RecStore collection's constructor arguments name: ``kv_client``, else one
    of its own over ``store`` or the Redis tier at ``ps_host:ps_port``, else `get_kv_client()`.

    Raises:
        ValueError: ``fast_path_mode`` other than ``"auto"``; ``ps_host`` without ``ps_port``
            (or the reverse); two of ``kv_client``, ``store`` and ``ps_host``/``ps_port`` that
            name different stores; ``optimizer_type`` on a client with a backend optimizer
            (that one updates the rows).
    """
    if fast_path_mode != "auto":
        raise ValueError(
            f"fast_path_mode={fast_path_mode!r}: embcache has no RecStore fast path to switch; "
            "every lookup goes through the device cache, sized by cache=CacheConfig(...)"
        )
    if (ps_host is None) != (ps_port is None):
        raise ValueError("ps_host and ps_port go together (the tier's address)")
    if ps_host is not None:
        if store is not None:
            raise ValueError("give either ps_host/ps_port or store, not both")
        store = f"redis://{ps_host}:{int(ps_port)}/0"
    if kv_client is not None and store is not None and store is not kv_client.store:
        raise ValueError("give either kv_client or a store (or ps_host/ps_port), not both")
    if kv_client is None:
        kv_client = get_kv_client() if store is None else KVClient(store)
    if kv_client.backend_optimizer is not None and optimizer_type is not None:
        raise ValueError(
            "optimizer_type: this KV client has a backend optimizer "
            f"({kv_client.backend_optimizer}), which updates the collection's rows"
        )
    return kv_client


class RecStoreEmbeddingBagCollection(KVClientCollection, CachedEmbeddingBagCollection):
    """RecStore's name and signature for the cached bag collection; its tables are tensors of
    its KV client (``module.kv_client``), read and written through its caches.

    Args:
        embedding_bag_configs: TableConfig or EmbeddingBagConfig objects, or dicts.
        lr: learning rate a sparse optimizer uses when given none, and of the SGD that
            ``kv_client.update_async`` applies to these tables while none is attached.
        enable_fusion, fusion_k: as in `CachedEmbeddingBagCollection`.
        ps_host, ps_port: the parameter server's address: here, a Redis tier
            (``redis://ps_host:ps_port/0``).
        kv_client: the client whose store holds the tables (default: `get_kv_client()` when
            no store is given, else a client of its own over ``store``).
        initialize_tables: accepted either way: declaring a table never overwrites rows a
            store already holds, and new rows are created on first touch.
        optimizer_type: refused on a client with a backend optimizer (that one applies).
        fast_path_mode: ``"auto"`` only (RecStore's shared-memory fast path has no equivalent:
            every lookup goes through the device cache).
        **kwargs: any other `CachedEmbeddingBagCollection` argument (``store``, ``cache``,
            ``device``, ...), ``options=CollectionOptions(...)`` included (its ``lr`` None:
            0.01).

    Attributes:
        backend_optimizer: the `BackendOptimizer` that updates the rows when the client has a
            backend optimizer (see the module's docstring), else None.

    Raises:
        ValueError: a table's name is already a tensor of the client, or a table of another
            live collection on it (two caches of the same rows would disagree).
    """

    def __init__(
        self,
        embedding_bag_configs: Sequence[TableConfig | Mapping[str, Any] | Any],
        lr: float = 0.01,
        enable_fusion: bool = True,
        fusion_k: int = 30,
        ps_host: str | None = None,
        ps_port: int | None = None,
        kv_client: KVClient | None = None,
        initialize_tables: bool = True,
        fast_path_mode: str = "auto",
        **kwargs: Any,
    ) -> None:
        del initialize_tables  # see Args: both values mean the same here
        options, client = client_options(locals(), kwargs)  # locals(): the keywords as called
        super().__init__(embedding_bag_configs, options=options, **kwargs)  # the cached one's
        self.join_kv_client(client)


class RecStoreEmbeddingCollection(KVClientCollection, CachedEmbeddingCollection):
    """`RecStoreEmbeddingBagCollection`'s conventions for the sequence collection (one row per
    id, unpooled): its tables are tensors of its KV client (``module.kv_client``), read and
    written through its caches, with the same backend-optimizer rules.

    Example::

        ec = RecStoreEmbeddingCollection(
            embedding_configs=[{"name": "items", "embedding_dim": 16,
                                "num_embeddings": 100_000, "feature_names": ["history"]}],
            lr=0.05,
        )
        opt = SparseSGD([ec])
        ec(kjt)["history"].values().sum().backward()   # values [n, 16]
        opt.step()
        ec.kv_client.pull("items", ids)                 # the rows the next forward reads

    Args:
        embedding_configs: torchrec `EmbeddingConfig` objects, `TableConfig` objects with
            ``pooling="none"``, or dicts (torchrec's name for an EmbeddingCollection's tables).
        lr, enable_fusion, fusion_k, ps_host, ps_port, kv_client, initialize_tables,
        optimizer_type, fast_path_mode: as `RecStoreEmbeddingBagCollection` takes them.
        **kwargs: any other `CachedEmbeddingCollection` argument (``device``,
            ``need_indices``, ``store``, ``cache``, ...).

    Attributes:
        backend_optimizer: as `RecStoreEmbeddingBagCollection`'s.

    Raises:
        ValueError: as `RecStoreEmbeddingBagCollection` raises, and for a pooled table.
    """

    def __init__(
        self,
        embedding_configs: Sequence[TableConfig | Mapping[str, Any] | Any],
        lr: float = 0.01,
        enable_fusion: bool = True,
        fusion_k: int = 30,
        ps_host: str | None = None,
        ps_port: int | None = None,
        kv_client: KVClient | None = None,
        initialize_tables: bool = True,
        fast_path_mode: str = "auto",
        **kwargs: Any,
    ) -> None:
        del initialize_tables  # as in RecStoreEmbeddingBagCollection
        options, client = client_options(locals(), kwargs)  # locals(): the keywords as called
        super().__init__(embedding_configs, options=options, **kwargs)  # the cached one's
        self.join_kv_client(client)


class BackendOptimizer:
    """What `EngineGroup` needs of an optimizer, for a KV client's backend optimizer: its rule
    and hyper-parameters (``update``), its state's shape and start, step counts per table.

    Args:
        config: the client's `KVOptimizer`.
    """

    def __init__(self, config: KVOptimizer) -> None:
        self.config = config
        self.update = config.update
        self.state_init = float(config.initial_accumulator_value)
        self._steps: dict[str, int] = {}

    def state_dim(self, dim: int) -> int:
        return self.update.state_dim(dim)

    def advance_steps(self, module: Any, tables: Sequence[str]) -> dict[str, int]:
        steps = {}
        for name in dict.fromkeys(tables):
            self._steps[name] = steps[name] = self._steps.get(name, 0) + 1
        return steps

    def admit(self, optimizer: Any) -> None:
        """Let ``optimizer`` drive the steps of rows this updates: SparseSGD (it hands the
        gradients over), or one of the same rule and hyper-parameters.

        Raises:
            ValueError: another optimizer.
        """
        mine = (optimizer.update, float(optimizer.state_init))
        if optimizer.rule is not OptimRule.SGD and mine != (self.update, self.state_init):
            raise ValueError(
                f"{type(optimizer).__name__} {optimizer.update} differs from the KV client's "
                f"backend optimizer {self.update}, which updates this collection's rows; "
                "use SparseSGD (it hands the gradients to the backend) or the same settings"
            )

    def check_gradients(self, entries: Sequence[tuple[str, Any, torch.Tensor]]) -> None:
        """Refuse NaN/Inf gradients (``update_in_backward``), naming the table."""
        for table, _, grads in entries:
            if grads.numel() and not bool(torch.isfinite(grads).all()):
                raise ValueError(
                    f"backend optimizer: gradient of table {table!r} holds NaN or Inf; "
                    "nothing was updated"
                )


def _register(client: KVClient, name: str, view: CollectionTable, owner: Any) -> None:
    try:
        client.register(name, view, owner)
    except ValueError:
        # A collection that is garbage but not yet collected (modules hold reference cycles)
        # still holds the name: collect it, then try once more.
        gc.collect()
        client.register(name, view, owner)


class _CollectionSGD:
    """What `EngineGroup.apply` needs of an optimizer, for a collection with none attached:
    SGD at the collection's lr (it keeps no state, so the rows have room for it)."""

    def __init__(self, lr: float) -> None:
        self.update = RowUpdate(OptimRule.SGD, lr=lr)

    def advance_steps(self, module: Any, tables: Sequence[str]) -> dict[str, int]:
        return dict.fromkeys(tables, 1)  # SGD's step does not depend on the count


class CollectionTable:
    """One table of a collection as a KV tensor (`embcache.recstore.kv_client.TableView`):
    every call goes through the collection's cache, so it sees and keeps what training does.

    Holds the collection weakly (the KV client must not keep it alive).
    """

    def __init__(self, module: LocalCollection, table: Table) -> None:
        self._module = weakref.ref(module)
        self.name = table.name
        self.shape = (table.num_embeddings, table.dim)

    def _parts(self) -> tuple[Any, Any, int, torch.Tensor]:
        module = self._module()
        if module is None:
            raise RuntimeError(f"table {self.name!r}: its collection no longer exists")
        group = module.engines
        engine = group.engine_of(self.name)
        return module, group, group.engines.index(engine), engine

    def _fused(self, ids: torch.Tensor) -> torch.Tensor:
        _, group, _, engine = self._parts()
        prefix = group.table_index[self.name] << group.fusion_k
        return (ids | prefix).to(engine.device)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The newest rows ``[n, dim]``: a cached (possibly dirty) copy, else the tier's."""
        _, _, _, engine = self._parts()
        if not ids.numel():
            return torch.empty(0, self.shape[1])
        return engine.cache.read(self._fused(ids))[:, : self.shape[1]].cpu()

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite the weights of distinct ``ids`` (their optimizer state kept)."""
        _, _, _, engine = self._parts()
        if ids.numel():
            engine.cache.write_weights(self._fused(ids), rows)

    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One step of the backend optimizer, else the collection's sparse optimizer, else
        SGD at its lr, on these rows:
        the gradients of duplicate ids summed, the rows and their state updated in the cache,
        as `optimizer.step()` updates a trace."""
        module, group, index, engine = self._parts()
        if not ids.numel():
            return
        unique, summed = aggregate_grads(ids, grads)
        entry = TraceEntry(
            self.name, unique.to(engine.device), summed.to(engine.device), index, None
        )
        optimizer = group.optimizer or _CollectionSGD(float(module.lr or 0.01))
        source = (
            f"its collection's {type(group.optimizer).__name__}"
            if group.optimizer is not None
            else "its collection's lr"
        )
        module.kv_client.check_learning_rate(self.name, optimizer.update.lr, source)
        group.apply([entry], optimizer)

    def add(self, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        """``rows += deltas`` (duplicates summed), without an optimizer."""
        if not ids.numel():
            return
        unique, summed = aggregate_grads(ids, deltas)
        self.write(unique, self.read(unique) + summed)
