"""What the single-process cached collections share: construction, the fused optimizer, the
lookup through the engines, prefetch and whole tables. `CachedEmbeddingBagCollection`
(`models.collection`: pooled bags) and `CachedEmbeddingCollection` (`models.sequence`: one row
per value) add their outputs and torchrec's names.

A collection trains from one thread at a time: the first training forward (or prefetch) claims
it for its thread until that thread's step (or ``zero_grad``) completes, and another thread's
training calls meanwhile raise, naming both threads, before anything changes
(`embcache.engine.claim`); inference under ``torch.no_grad()``, ``flush``, ``state_dict`` and
``table_rows`` work from any thread.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from embcache.engine.batch_state import FusedPrefetchHandle
from embcache.engine.inputs import JaggedBatch
from embcache.engine.interface import CachedCollectionInterface
from embcache.engine.lookup import GroupLookup, lookup
from embcache.engine.options import CollectionOptions
from embcache.engine.tables import Table
from embcache.models.torch_optim import FusedOptimizerConventions
from embcache.models.whole_tables import LocalTables


def opaque_to_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a `LocalCollection` subclass's method ``torch.compiler.disable``d: dynamo runs it
    eagerly, one graph break, instead of breaking the graph at every host read inside it.

    The mark is applied when ``torch._dynamo`` is loaded (at once if it already is): importing
    it takes about a second, which a process that never compiles (a CLI run, a test's worker)
    need not pay. ``torch.compile`` loads it before it traces anything, so every trace sees the
    disabled method."""
    fn._embcache_opaque = True  # type: ignore[attr-defined]
    return fn


_WHEN_DYNAMO_LOADS: list[Callable[[], None]] = []


class _DynamoWatch(importlib.abc.MetaPathFinder):
    """Runs `_WHEN_DYNAMO_LOADS` right after ``torch._dynamo`` is first imported, then leaves
    ``sys.meta_path``."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def run(module: Any) -> None:
            exec_module(module)
            sys.modules.setdefault(name, module)
            for action in _WHEN_DYNAMO_LOADS:
                action()
            _WHEN_DYNAMO_LOADS.clear()

        loader.exec_module = run  # type: ignore[method-assign]
        return spec


def _when_dynamo_loads(action: Callable[[], None]) -> None:
    if "torch._dynamo" in sys.modules:
        action()
        return
    if not _WHEN_DYNAMO_LOADS:
        sys.meta_path.insert(0, _DynamoWatch())
    _WHEN_DYNAMO_LOADS.append(action)


def _disable(cls: type, name: str, fn: Callable[..., Any]) -> None:
    setattr(cls, name, torch.compiler.disable(fn))


class LocalCollection(FusedOptimizerConventions, CachedCollectionInterface):
    """The rows of one process's tables in its device caches, over a write-back tier, built
    from the tables, ``is_weighted`` and the `CollectionOptions` its public constructor made.
    Subclasses give ``forward`` its output; the tables' `TableWeights` stand under their
    torchrec name (`weights_prefix`), and its `LocalTables` (``whole_tables``) reads and
    writes them whole."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            if getattr(value, "_embcache_opaque", False):
                _when_dynamo_loads(functools.partial(_disable, cls, name, value))

    def __init__(
        self, tables: Sequence[Any], is_weighted: bool, options: CollectionOptions
    ) -> None:
        super().__init__()
        self._setup(tables, is_weighted, options)
        self.allow_unsharded_replicas = options.allow_unsharded_replicas
        self.whole_tables = LocalTables(self.tables, self.store, self.engines, self.device)
        setattr(self, self.weights_prefix, table_weights(self, self.weights_prefix))
        self._setup_torch_training(options)

    # -- torchrec's accessors (the fused optimizer's: `FusedOptimizerConventions`) -----------

    def embedding_configs(self) -> list[Any]:
        """The table configs as given: torchrec's ``EmbeddingCollection`` accessor, and for a
        bag collection the same as `embedding_bag_configs` (torchrec's managed-collision
        wrapper asks any module that is not its own ``EmbeddingBagCollection`` under this
        name)."""
        return self.embedding_bag_configs()

    # -- the data path -----------------------------------------------------------------------

    def _lookup(self, batch: JaggedBatch, training: bool) -> tuple[torch.Tensor, ...]:
        """`forward`'s lookup (`engine.lookup.GroupLookup`) over the shares the engines' step
        protocol gives it (`EngineGroup.forward_shares`): one output per engine,
        ``[B, F_e * dim_e]`` pooled or ``[nnz_e, dim_e]`` unpooled."""
        engines = self.engines
        with engines.forward_shares(batch, training) as (prepared, inflight):
            step = GroupLookup(engines, prepared, inflight, batch.stride())
            return lookup(self.grad_anchor, step)

    def issue_fused_prefetch(self, features: JaggedBatch | Any) -> FusedPrefetchHandle:
        """Start the dedup and cache resolve (tier I/O included) of a batch ahead of its
        forward and return at once; the work runs on the collection's prefetch worker, and the
        forward on the same features waits only for what is left. Ids are validated here (a bad
        id raises before anything changes).

        The handle is recorded as the one the next forward uses (RecStore's
        ``_fused_prefetch_handle``); its slots stay locked until that forward's step, and a
        handle that will not be used is released (`embcache.engine.prefetch`).
        """
        self.check_not_replicated()
        engines = self.engines
        with engines.claimed("prefetch"):  # part of the step its forward starts
            batch = self.checked_input(features)
            return engines.prefetch(id(self), batch, source=features)

    # -- whole tables (`LocalTables`) --------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # torch's: a dict or destination
        """torchrec's keys and shapes: ``embedding_bags.<table>.weight``, a CPU float32
        ``[num_embeddings, dim]`` tensor per table (the weights, without optimizer state).

        Cost: every table is materialised whole in host memory (``4 * num_embeddings * dim``
        bytes each, all tables at once), after a flush of the dirty cached rows; each row is
        read from the tier, and rows never trained are computed by the initialiser without
        being created there (about 1M rows/s on one CPU core: 1.6 s for 26 tables of 65,536
        rows). For large tables or a checkpoint use `embcache.save`, which streams only the
        rows trained.
        """
        return super().state_dict(*args, **kwargs)

    def table_rows(self, table: str, chunk_rows: int = 1 << 16) -> torch.Tensor:
        """Every row ``[num_embeddings, dim + state_dim]`` of a table (weights and optimizer
        state), CPU float32, read through the tier after a flush (`LocalTables.rows`; an
        unbounded table raises `ValueError`: `embcache.save` holds its rows)."""
        return self.whole_tables.rows(table, chunk_rows)

    def write_table_rows(self, table: str, rows: torch.Tensor, columns: slice) -> None:
        """Overwrite ``columns`` of every row of a table (others kept); empties the caches
        (`LocalTables.write`: only rows whose value changes are written)."""
        self.whole_tables.write(table, rows, columns)

    def table_weight(self, table: str) -> torch.Tensor:
        """A copy ``[num_embeddings, dim]`` of a table's current weights on the collection's
        device, in its ``data_type`` (a meta tensor on the meta device)."""
        return self.whole_tables.weight(table)


def table_weights(owner: LocalCollection, weights_prefix: str) -> nn.ModuleDict:
    """The ``nn.ModuleDict`` of `TableWeights` a collection holds under ``weights_prefix``,
    where torchrec's collection holds its tables' modules.

    Raises:
        ValueError: a table name that cannot key it (a method of ``nn.ModuleDict``, or a dot).
    """
    clash = [t.name for t in owner.tables if hasattr(nn.ModuleDict, t.name) or "." in t.name]
    if clash:  # torchrec's ModuleDict of tables refuses them too, less clearly
        raise ValueError(
            f"table names {clash} cannot key the collection's {weights_prefix} "
            "ModuleDict (a method of nn.ModuleDict, or a dot): rename them"
        )
    return nn.ModuleDict({t.name: TableWeights(owner, t) for t in owner.tables})


def fx_leaf(module: nn.Module, features: torch.fx.Proxy, name: str) -> torch.fx.Proxy:
    """``module``'s call as one leaf node of the ``torch.fx`` trace ``features`` belongs to
    (symbolic_trace's tracer, which knows the module's path); ``name`` is the collection's
    class in the error.

    Raises:
        TypeError: the collection itself is being traced.
    """
    tracer = cast(torch.fx.Tracer, features.tracer)
    path = tracer.path_of_module(module)
    if not path:
        raise TypeError(
            f"a {name} is a leaf of torch.fx traces: trace the model that holds it, not the "
            "collection itself"
        )
    return tracer.create_proxy("call_module", path, (features,), {})


class TableWeights(nn.Module):
    """What stands in ``embedding_bags[name]`` (``embeddings[name]``) where torchrec has an
    ``nn.EmbeddingBag`` (``nn.Embedding``): ``weight`` is a copy of the table's current rows
    (writing to it changes nothing; load weights with ``load_state_dict``). It holds no
    parameter; the collection saves and loads the table under
    ``embedding_bags.<name>.weight`` (``embeddings.<name>.weight``)."""

    def __init__(self, owner: LocalCollection, table: Table) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)  # a plain reference would make the owner its child
        self.table = table

    @property
    def weight(self) -> torch.Tensor:
        owner = self._owner()
        if owner is None:
            raise RuntimeError(f"the collection of table {self.table.name!r} no longer exists")
        return owner.table_weight(self.table.name)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the collection loads the table."""

    def extra_repr(self) -> str:
        t = self.table
        mode = "none" if t.pooling is None else t.pooling.name.lower()
        return f"{t.num_embeddings}, {t.dim}, mode={mode}"
