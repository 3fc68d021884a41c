"""RecStore's name and signature for the cached collection, with its tables in the KV client."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from embcache.engine.batch_state import TraceEntry
from embcache.engine.tables import Table, TableConfig
from embcache.kernels.optim import OptimRule, RowUpdate, aggregate_grads
from embcache.models.collection import CachedEmbeddingBagCollection
from embcache.recstore.kv_client import KVClient, get_kv_client


class RecStoreEmbeddingBagCollection(CachedEmbeddingBagCollection):
    """RecStore's name and signature for the same collection; its tables are tensors of its KV
    client (``module.kv_client``), read and written through its caches.

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
        fast_path_mode: ``"auto"`` only (RecStore's shared-memory fast path has no equivalent:
            every lookup goes through the device cache).
        **kwargs: any other `CachedEmbeddingBagCollection` argument (``store``, ``cache``,
            ``device``, ...).

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
        if fast_path_mode != "auto":
            raise ValueError(
                f"fast_path_mode={fast_path_mode!r}: embcache has no RecStore fast path to switch; "
                "every lookup goes through the device cache, sized by cache=CacheConfig(...)"
            )
        del initialize_tables  # see Args: both values mean the same here
        store = kwargs.pop("store", None)
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
        super().__init__(
            tables=embedding_bag_configs,
            store=kv_client.store,
            lr=lr,
            enable_fusion=enable_fusion,
            fusion_k=fusion_k,
            **kwargs,
        )
        self.kv_client = kv_client
        for table in self.tables:
            _register(kv_client, table.name, CollectionTable(self, table), self)


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

    def __init__(self, module: CachedEmbeddingBagCollection, table: Table) -> None:
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
        """One step of the collection's sparse optimizer (else SGD at its lr) on these rows:
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
        group.apply([entry], optimizer)

    def add(self, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        """``rows += deltas`` (duplicates summed), without an optimizer."""
        if not ids.numel():
            return
        unique, summed = aggregate_grads(ids, deltas)
        self.write(unique, self.read(unique) + summed)
