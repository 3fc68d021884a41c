"""CachedEmbeddingBagCollection: torchrec's EmbeddingBagCollection over a device cache.

Example::

    ebc = CachedEmbeddingBagCollection(
        tables=[TableConfig(name="t0", embedding_dim=16, num_embeddings=10_000,
                            feature_names=["f0", "f1"])],   # or torchrec EmbeddingBagConfig
        cache=CacheConfig(load_factor=0.1),
    )
    opt = SparseAdaGrad([ebc], lr=0.05)
    # kjt: torchrec KeyedJaggedTensor (or embcache.JaggedBatch), keys ["f0", "f1"], B bags each
    kt = ebc(kjt)                       # KeyedTensor, keys ["f0", "f1"], values [B, 32]
    kt.values().sum().backward()        # one gradient row per unique id, into ebc._trace
    opt.step()                          # fused update in the cache slots; trace cleared

One training step, top to bottom (`embcache.engine` holds each piece):

1. ``forward`` checks the input (`engine.inputs`), then `EngineGroup.prepare` has each
   `CacheEngine` (one per embedding dim, or per table given a size of its own) fuse its
   features' ids (``fused = id | (table_idx << fusion_k)``; a bad id raises before anything
   changes), dedup
   them and resolve them to cache slots, locked until the step (nothing is locked under
   ``torch.no_grad()``);
2. `engine.lookup.GroupLookup` (run as one autograd node, `CachedLookup`) pools each bag
   straight from the slots (SUM/MEAN/MAX, per-sample weights);
3. its backward turns the pooled gradient into one row per unique id, and
   `EngineGroup.record_backward` appends ``(table_name, ids, grads)`` to ``_trace`` (or, with
   ``update_in_backward=True``, applies the attached optimizer at once);
4. the optimizer's ``step()`` calls `apply_sparse_gradients`: each engine applies the
   optimizer's rule to its rows and state in place, marks them dirty and unlocks them.

A forward whose output is never backpropagated holds its locks only until the next forward; a
forward while an un-stepped trace exists is an error unless ``accumulate_grads=True``.

A collection trains from one thread at a time: the first training forward (or prefetch) claims
it for its thread until that thread's step (or ``zero_grad``) completes, and another thread's
training calls meanwhile raise, naming both threads, before anything changes
(`embcache.engine.claim`); inference under ``torch.no_grad()``, ``flush``, ``state_dict`` and
``table_rows`` work from any thread.

The torchrec way works too (see `models.torch_optim`): a torch optimizer over
``model.parameters()`` (the collection's ``grad_anchor`` stands for its tables), or
``optimizer_type=``/``optimizer_kwargs=`` as torchrec's ``FusedEmbeddingBagCollection`` takes
them, the update then running inside backward, with ``fused_optimizer()`` a torchrec
``KeyedOptimizer``. Where torchrec is imported, the class is registered as a torchrec
``EmbeddingBagCollectionInterface``, so torchrec's model classes take it.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, overload

import torch

from embcache.cache.config import CacheConfig
from embcache.engine.engine import CacheEngine
from embcache.engine.inputs import JaggedBatch, pooled_output
from embcache.engine.lookup import GroupLookup, KeyedOutput, lookup
from embcache.engine.options import FUSION_K, CollectionOptions
from embcache.engine.tables import TableConfig
from embcache.kv.base import Store
from embcache.models.local import LocalCollection, fx_leaf, opaque_to_compile


class ExportName:
    """The name a ``torch.export`` program of a collection calls it by when it runs: its
    tables (name, rows, dim, features) unless set. A program saved with ``torch.export.save``
    runs in any process holding one live collection of that name (a serving process builds
    the same model and loads its weights, then ``torch.export.load``); set distinct names on
    collections of the same tables that live in one process.

    A data descriptor (``collection.export_name``, read or set); the name set is the
    collection's ``_export_name``.
    """

    @overload
    def __get__(self, collection: None, owner: type | None = None) -> ExportName: ...

    @overload
    def __get__(self, collection: Any, owner: type | None = None) -> str: ...

    def __get__(self, collection: Any, owner: type | None = None) -> ExportName | str:
        if collection is None:
            return self
        name = collection.__dict__.get("_export_name")
        if name is not None:
            return str(name)
        return ";".join(
            f"{t.name}[{t.num_embeddings}x{t.dim}]({','.join(t.feature_names)})"
            for t in collection.tables
        )

    def __set__(self, collection: Any, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"export_name must be a non-empty str, got {name!r}")
        collection.__dict__["_export_name"] = name


class CachedEmbeddingBagCollection(LocalCollection):
    """Pooled embedding lookups over a device cache with a write-back tier behind it.

    Same input, output, keys and values as `torchrec.EmbeddingBagCollection` given the same
    weights (and, built without a ``seed`` with every row cached, the same initial weights
    after the same ``torch.manual_seed``), plus MAX pooling; tables may be far larger than the
    device, only the cached rows live there.

    Args:
        tables: `TableConfig` objects, torchrec `EmbeddingBagConfig` objects or dicts (``name``,
            ``embedding_dim``, ``num_embeddings``, ``feature_names``, optional ``pooling``:
            SUM, MEAN or MAX, ``init_fn``, ``data_type``). May be empty.
        is_weighted: the inputs carry per-sample weights.
        cache: capacity and policy of each cache (one per distinct dim; a ``capacity`` or
            ``load_factor`` dict by table name gives those tables a cache each); None caches
            everything that fits the memory budget.
        store: the tier: a `Store`, a URL (``"redis://127.0.0.1:6379/0"``) or None for an
            in-process `HostKV`.
        device: where the caches live; None: torch's default device (``with
            torch.device("meta"):`` builds a collection of shapes only, which allocates no row).
        enable_fusion: fuse ids of all tables into one key space with ``fusion_k`` bits for the
            raw id (RecStore's layout). With False, the collection still fuses internally but
            with 48 id bits, so only ``num_embeddings`` limits ids.
        fusion_k: bits of the raw id inside a fused id; every table needs
            ``num_embeddings <= 2**fusion_k``.
        update_in_backward: apply the attached optimizer inside backward (FBGEMM-style) instead
            of recording a trace for ``step()``; same numbers.
        accumulate_grads: allow several forward/backward passes before one ``step()``, whose
            gradients are summed per id.
        lr: learning rate a sparse optimizer uses when given none (RecStore compatibility).
        seed: seed of the row initialisers (rows drawn per id, never materialised); None: the
            randomness comes from torch's generator (`embcache.engine.row_init`).
        optimizer_type: a fused optimizer, as torchrec's ``FusedEmbeddingBagCollection`` takes
            it (``torch.optim.SGD``, ``Adagrad``, ``Adam``, torchrec's ``RowWiseAdagrad``),
            applied inside backward; see `fused_optimizer`.
        optimizer_kwargs: its hyper-parameters (``{"lr": 0.02}``), by the torch names.
        location: accepted for ``FusedEmbeddingBagCollection``'s signature; the cache decides
            what lives on the device.
        allow_unsharded_replicas: let a process group of several ranks train one independent
            copy of the tables per rank. Without it, a forward on more than one rank raises
            (`check_not_replicated`): torchrec's ``DistributedModelParallel`` has no plan for
            this collection and ``DistributedDataParallel`` averages only the dense
            parameters, so each rank's tables would silently diverge. Shard the rows with
            `embcache.distributed.ShardedEmbeddingBagCollection` instead.
        options: every option above (``cache`` to ``allow_unsharded_replicas``, ``location``
            and ``is_weighted`` aside) as one `CollectionOptions`, which checks them, to share
            between collections; a keyword given a value other than its default beside it
            raises `TypeError`, naming it.

    Copies: ``copy.deepcopy``, ``pickle`` and ``torch.save(module)`` raise `TypeError` (the
    rows live in a cache and a tier, not in the module; `CachedCollectionInterface`).
    """

    def __init__(
        self,
        tables: Sequence[TableConfig | Mapping[str, Any] | Any],
        is_weighted: bool = False,
        cache: CacheConfig | None = None,
        store: Store | str | None = None,
        device: torch.device | str | None = None,
        enable_fusion: bool = True,
        fusion_k: int = FUSION_K,
        update_in_backward: bool = False,
        accumulate_grads: bool = False,
        lr: float | None = None,
        seed: int | None = None,
        optimizer_type: type | None = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        location: Any = None,
        allow_unsharded_replicas: bool = False,
        *,
        options: CollectionOptions | None = None,
    ) -> None:
        options = CollectionOptions.given(options, locals())  # the keywords as called
        del location  # the cache decides placement
        super().__init__(tables, is_weighted, options)
        self._keyed: KeyedOutput | None = None  # `_keyed_output`, made on first use
        register_with_torchrec()
        _LIVE.add(self)

    # The name a ``torch.export`` program of it calls it by (`ExportName`).
    export_name = ExportName()

    # -- the data path -----------------------------------------------------------------------

    # Opaque to dynamo: the input checks and the cache resolve read host values (a graph break
    # each), so ``torch.compile`` of a model breaks its graph once, at this call, and runs the
    # lookup eagerly (its autograd function included) between the compiled parts.
    @opaque_to_compile
    def forward(self, features: JaggedBatch | Any) -> Any:
        """Pooled embeddings of every feature ``[B, sum of dims]``, keyed by the tables' feature
        names in table order (as torchrec orders them): a torchrec `KeyedTensor` for a KJT
        input, a `PooledEmbeddings` for a `JaggedBatch`. Under ``torch.fx`` tracing the call is
        one leaf node; under ``torch.compile`` it runs eagerly, one graph break.

        Raises:
            RuntimeError: in a process group of several ranks without
                ``allow_unsharded_replicas=True`` (`check_not_replicated`).
        """
        if isinstance(features, torch.fx.Proxy):
            return fx_leaf(self, features, "CachedEmbeddingBagCollection")
        if torch.compiler.is_exporting():
            return exported_forward(self, features)
        if self.device.type == "meta":  # shapes only, as torchrec's meta weights give
            values = torch.empty(features.stride(), sum(self.output_dims), device="meta")
            return pooled_output(features, self.output_keys, self.output_dims, values)
        self.check_not_replicated()
        # Features a prefetch was issued for were checked then (the handle keeps the batch).
        batch = self.engines.checked_prefetch(features)
        if batch is None:  # on the device path, the lengths are checked with the ids
            batch = self.checked_input(features, not self.engines.checks_lengths_late)
        if not self.tables:
            values = torch.empty(batch.stride(), 0, device=self.device)
            return pooled_output(features, self.output_keys, self.output_dims, values)
        values = self._pooled(batch, training=torch.is_grad_enabled())
        return pooled_output(features, self.output_keys, self.output_dims, values)

    def _pooled(self, batch: JaggedBatch, training: bool) -> torch.Tensor:
        """The lookup's pooled values ``[B, sum of dims]`` in the output keys' order: on the
        device path with several engines (or one whose features come in another order), each
        pools into one output at its features' columns (`KeyedOutput`), so that nothing joins
        the engines' outputs after, nor splits their gradient in the backward."""
        engines = self.engines
        with engines.forward_shares(batch, training) as (prepared, inflight):
            step = GroupLookup(engines, prepared, inflight, batch.stride(), self._keyed_output())
            outs = lookup(self.grad_anchor, step)
        if step.keyed is not None:
            return outs[0]
        return keyed_columns(engines.engines, outs, self.output_keys)

    def _keyed_output(self) -> KeyedOutput | None:
        """The one output's columns (made once), or None where the engine's output is it, or
        off the device path (the twins find a feature's columns by reading them)."""
        engines = self.engines.engines
        if len(engines) == 1 and engines[0].layout.keys == self.output_keys:
            return None
        if not all(e.cache.device_path for e in engines):
            return None
        if self._keyed is None:
            start, at = 0, {}
            for k, dim in zip(self.output_keys, self.output_dims, strict=True):
                at[k] = start
                start += dim
            columns = [
                torch.tensor([at[k] for k in e.layout.keys], dtype=torch.int64, device=e.device)
                for e in engines
            ]
            self._keyed = KeyedOutput(columns, start)
        return self._keyed


def keyed_columns(
    engines: Sequence[CacheEngine], outs: tuple[torch.Tensor, ...], keys: list[str]
) -> torch.Tensor:
    """The engines' pooled outputs ``[B, F_e * dim_e]`` as one ``[B, sum of dims]`` block whose
    columns follow ``keys`` (the output's order): the one output as it is when it has them in
    that order already."""
    if len(outs) == 1 and engines[0].layout.keys == keys:
        return outs[0]
    blocks: dict[str, torch.Tensor] = {}
    for engine, out in zip(engines, outs, strict=True):
        for i, k in enumerate(engine.layout.keys):
            blocks[k] = out[:, i * engine.dim : (i + 1) * engine.dim]
    return torch.cat([blocks[k] for k in keys], dim=1)


def exported_forward(collection: CachedEmbeddingBagCollection, features: Any) -> Any:
    """The forward as ``torch.export`` records it: one ``embcache::pooled_lookup`` op that
    calls the live collection named `export_name` when the exported program runs, in this
    process or another (inference: the op records no gradient).

    Raises:
        ValueError: another live collection has the same `export_name`.
    """
    name = collection.export_name
    live = len(_live_named(name))
    if live > 1:
        raise ValueError(
            f"torch.export: {live} live collections are named "
            f"{name!r} (the same tables): set a distinct export_name on each "
            "(collection.export_name = 'user_tower'), and the same in the process that "
            "runs the program"
        )
    keys = features.keys()
    if keys != collection.features:
        features = features.permute([keys.index(f) for f in collection.features])
    weights = features.weights_or_none() if collection.is_weighted else None
    values = pooled_lookup(
        name,
        features.values(),
        features.lengths(),
        weights,
        features.stride(),
        sum(collection.output_dims),
    )
    return pooled_output(features, collection.output_keys, collection.output_dims, values)


# Every live collection, for the exported programs that name one (`export_name`).
_LIVE: weakref.WeakSet[CachedEmbeddingBagCollection] = weakref.WeakSet()


def _live_named(name: str) -> list[CachedEmbeddingBagCollection]:
    """The live collections whose `export_name` is ``name`` (garbage ones collected first when
    there is more than one: modules hold reference cycles)."""
    found = [c for c in list(_LIVE) if c.export_name == name]
    if len(found) > 1:
        del found
        gc.collect()
        found = [c for c in list(_LIVE) if c.export_name == name]
    return found


@torch.library.custom_op("embcache::pooled_lookup", mutates_args=())
def pooled_lookup(
    collection: str,
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    batch_size: int,
    width: int,
) -> torch.Tensor:
    """The pooled lookup of the live collection whose `export_name` is ``collection``, as one
    op, for programs ``torch.export`` recorded: ``values``, ``lengths`` (``[F * B]``) and
    ``weights`` hold the collection's features in its order; returns ``[B, width]``."""
    found = _live_named(collection)
    if len(found) != 1:
        raise RuntimeError(
            f"this exported program looks up the embedding collection {collection!r}, and "
            f"{len(found)} live collections have that export_name in this process: build the "
            "model (the same tables) and load its weights before running the program"
            + (", and give each collection a distinct export_name" if found else "")
        )
    owner = found[0]
    if owner.output_dims and sum(owner.output_dims) != width:
        raise RuntimeError(
            f"this exported program expects {width} pooled columns from {collection!r}, "
            f"the live collection gives {sum(owner.output_dims)}"
        )
    batch = JaggedBatch.from_lengths(owner.features, values, lengths, weights)
    with torch.no_grad():
        return owner(batch).values().clone()


@pooled_lookup.register_fake
def _pooled_lookup_shape(collection, values, lengths, weights, batch_size, width):
    return values.new_empty(batch_size, width, dtype=torch.float32)


def register_with_torchrec() -> None:
    """Register the collection as a torchrec ``EmbeddingBagCollectionInterface`` (an ABC's
    virtual subclass) once torchrec is imported; never imports torchrec itself."""
    module = sys.modules.get("torchrec.modules.embedding_modules")
    if module is not None:
        module.EmbeddingBagCollectionInterface.register(CachedEmbeddingBagCollection)


register_with_torchrec()
