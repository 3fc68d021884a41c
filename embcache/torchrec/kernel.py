"""embcache's cache as a torchrec compute kernel: where torchrec's sharded collection would
build an FBGEMM table-batched kernel for a group of table shards (``CUSTOMIZED_KERNEL`` in the
plan), `CachedPooledLookup` builds a `CachedBagKernel`: a `CachedEmbeddingBagCollection` over
the shards this rank holds, their rows in a device cache over a tier of the rank's own.

torchrec's input dist hands the kernel a ``KeyedJaggedTensor`` of the group's features with
ids already local to each shard (row-wise shards: ``id - shard offset``); the kernel pools them
(``[B, sum of the features' shard dims]``) and torchrec's output dist sends the result back.
The backward applies the fused optimizer inside the cached collection (FBGEMM's convention),
and `CachedBagKernel.fused_optimizer` is that collection's torchrec ``KeyedOptimizer``, which
torchrec's sharded collection combines into ``model.fused_optimizer``.

torchrec's own state machinery skips ``CUSTOMIZED_KERNEL`` tables: the kernel keeps its rows
out of ``state_dict()``, and the sharded collections (`embcache.torchrec.state.CachedShards`)
read and write them through `CachedBagKernel.shards` and `load_shard`. `CachedSequenceKernel`
and `CachedSequenceLookup` are the same for torchrec's sharded ``EmbeddingCollection``: one row
per value, ``[nnz, local dim]``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
)
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import (
    GroupedEmbeddingsLookup,
    GroupedPooledEmbeddingsLookup,
)
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embcache.cache.config import CacheConfig
from embcache.models.collection import CachedEmbeddingBagCollection
from embcache.models.sequence import CachedEmbeddingCollection
from embcache.models.torch_optim import row_update
from embcache.torchrec.constraints import ShardCacheOptions

# torchrec's fused optimizers (FBGEMM's names) as the torch classes the collection takes.
_OPTIMIZERS: dict[EmbOptimType, type] = {
    EmbOptimType.SGD: torch.optim.SGD,
    EmbOptimType.EXACT_SGD: torch.optim.SGD,
    EmbOptimType.EXACT_ADAGRAD: torch.optim.Adagrad,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: RowWiseAdagrad,
    EmbOptimType.ROWWISE_ADAGRAD: RowWiseAdagrad,
    EmbOptimType.ADAM: torch.optim.Adam,
}
_HYPER = ("learning_rate", "lr", "eps", "beta1", "beta2", "weight_decay")
_DEFAULT_OPTIMIZER = EmbOptimType.EXACT_SGD  # FBGEMM's TBE default, at its lr 0.01


def fused_optimizer_of(fused_params: Mapping[str, Any] | None) -> tuple[type, dict[str, Any]]:
    """The torch optimizer class and its kwargs (FBGEMM's names kept: the collection reads
    ``learning_rate``, ``beta1``, ``beta2``) named by torchrec's ``fused_params``.

    Raises:
        ValueError: an optimizer the cache has no rule for, naming ``fused_params['optimizer']``.
    """
    fused = dict(fused_params or {})
    name = fused.get("optimizer", _DEFAULT_OPTIMIZER)
    try:
        kind = name if isinstance(name, EmbOptimType) else EmbOptimType(str(name).lower())
        cls = _OPTIMIZERS[kind]
    except (KeyError, ValueError):
        known = sorted(k.value for k in _OPTIMIZERS)
        raise ValueError(
            f"fused_params['optimizer'] = {name!r}: embcache's cache applies {known}"
        ) from None
    kwargs = {k: fused[k] for k in _HYPER if k in fused}
    if cls is torch.optim.SGD:
        kwargs = {k: v for k, v in kwargs.items() if k in ("learning_rate", "lr")}
    if cls in (torch.optim.Adagrad, RowWiseAdagrad):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("beta1", "beta2")}
    # The torch class's own options FBGEMM has no name for (``apply_optimizer_in_backward``'s
    # kwargs: momentum, betas, lr_decay, initial_accumulator_value, amsgrad, ...): the rule
    # applies them or refuses them (`embcache.models.torch_optim.row_update`), never drops them.
    options = inspect.signature(cls).parameters
    kwargs.update(
        (k, v)
        for k, v in fused.items()
        if k in options
        and k not in (*_HYPER, "params")
        and options[k].kind is not inspect.Parameter.VAR_KEYWORD
    )
    return cls, kwargs


def in_backward_optimizer(weight: torch.Tensor, where: str) -> tuple[type, dict[str, Any]] | None:
    """The optimizer ``apply_optimizer_in_backward`` attached to ``weight`` (a cached
    collection's ``grad_anchor``, or a torchrec table's weight), checked as the cache will
    apply it under ``DistributedModelParallel``; None if it has none.

    torchrec's sharded collections read a table weight's ``_optimizer_classes`` and
    ``_optimizer_kwargs`` into that table's fused params, over the sharder's ``fused_params``
    (the class as its ``EmbOptimType``, ``lr`` as ``learning_rate``); FBGEMM's defaults
    (`embcache.models.torch_optim.FBGEMM_DEFAULTS`: eps 1e-8) fill in the rest.

    Args:
        weight: the tensor ``apply_optimizer_in_backward`` was given.
        where: what holds it, for the error messages.

    Raises:
        ValueError: several optimizers on one weight, or a class the cache has no fused rule
            for (naming the ones it has); an option the rule cannot apply (momentum, amsgrad).
        TypeError: an option of a rule that has no such option.
    """
    classes = getattr(weight, "_optimizer_classes", None) or []
    if not classes:
        return None
    all_kwargs = getattr(weight, "_optimizer_kwargs", None) or [{}]
    what = f"apply_optimizer_in_backward on {where} under DistributedModelParallel"
    if len(classes) != 1 or len(all_kwargs) != 1:
        names = [c.__name__ for c in classes]
        raise ValueError(f"{what}: {len(classes)} optimizers {names}; a table takes one")
    cls, kwargs = classes[0], dict(all_kwargs[0])
    try:  # torchrec's own choice of kind, unless the kwargs name one (as it reads them)
        kind = kwargs.get("optimizer") or optimizer_type_to_emb_opt_type(cls)
    except ValueError:
        kind = None
    if kind is None or ("optimizer" not in kwargs and kind not in _OPTIMIZERS):
        raise ValueError(
            f"{what}: {_class_name(cls)} has no fused rule in embcache's cache; it applies "
            f"{', '.join(supported_optimizers())} (torchrec.optim's wrappers of them too)"
        )
    try:
        fused_cls, fused_kwargs = fused_optimizer_of({**kwargs, "optimizer": kind})
        row_update(fused_cls, fused_kwargs, fused=True)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}: {e}") from None
    return cls, kwargs


def mark_in_backward(weight: torch.Tensor, source: torch.Tensor) -> None:
    """Give ``weight`` (a stand-in table weight torchrec's sharded collection reads) the
    in-backward optimizer of ``source``, as ``apply_optimizer_in_backward`` would have: its
    own copy of the kwargs, which torchrec rewrites in place."""
    weight._optimizer_classes = list(source._optimizer_classes)  # type: ignore[attr-defined]
    weight._optimizer_kwargs = [dict(k) for k in source._optimizer_kwargs]  # type: ignore[attr-defined]
    # torchrec's plan helpers (construct_module_sharding_plan) pick the fused kernel for these
    weight._in_backward_optimizers = list(source._in_backward_optimizers)  # type: ignore[attr-defined]


def supported_optimizers() -> list[str]:
    """The torch optimizer classes the cache applies as fused optimizers (`_OPTIMIZERS`)."""
    return list(dict.fromkeys(_class_name(c) for c in _OPTIMIZERS.values()))


def _class_name(cls: type) -> str:
    """``torch.optim.SGD`` rather than ``torch.optim.sgd.SGD``."""
    for package in ("torch.optim", "torchrec.optim"):
        if getattr(sys.modules.get(package), cls.__name__, None) is cls:
            return f"{package}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


class CachedBagKernel(BaseEmbedding, FusedOptimizerModule):
    """One group of table shards on this rank, pooled through embcache's cache
    (`CachedSequenceKernel`: one row per value).

    Args:
        config: torchrec's group of shards (same pooling, weighting and fused params).
        cache_options: per shard (in ``config.embedding_tables`` order), its cache and tier.
        pg: the sharding's process group.
        device: where the cache lives.
        sharding_type: the group's sharding (row-wise MEAN bags are pooled as SUM here and
            divided by torchrec's output callback, as its own kernels do).
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        cache_options: list[ShardCacheOptions],
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        sharding_type: ShardingType | None = None,
    ) -> None:
        super().__init__()
        self._config = config
        self._pg = pg
        shards = config.embedding_tables
        stores = {o.store for o in cache_options}
        if len(stores) > 1:
            raise ValueError(
                f"tables {[s.name for s in shards]} share one cached group but name different "
                f"tiers {sorted(map(str, stores))}: give them the same store"
            )
        store = stores.pop()
        # A tier outside the process (a URL) is shared by the ranks: each shard its own tables.
        self._local_names = _local_names(shards, per_shard=store is not None)
        self._public_names = _local_names(shards, per_shard=False)
        self._keys = [f"{i}" for i in range(config.num_features())]
        pooling = "sum"
        if not self.pooled:
            pooling = "none"
        elif config.pooling == PoolingType.MEAN and sharding_type not in (
            ShardingType.ROW_WISE,
            ShardingType.TABLE_ROW_WISE,
        ):
            pooling = "mean"
        tables, keys = [], iter(self._keys)
        for shard, name in zip(shards, self._local_names, strict=True):
            init = functools.partial(
                nn.init.uniform_, a=shard.get_weight_init_min(), b=shard.get_weight_init_max()
            )
            tables.append(
                {
                    "name": name,
                    "embedding_dim": shard.local_cols,
                    "num_embeddings": shard.local_rows,
                    "pooling": pooling,
                    "init_fn": init,
                    "feature_names": [next(keys) for _ in range(shard.num_features())],
                    "data_type": shard.data_type,
                }
            )
        policies = {o.policy for o in cache_options}
        ways = {o.ways for o in cache_options}
        if len(policies) > 1 or len(ways) > 1:
            raise ValueError(
                f"tables {[s.name for s in shards]} share one cached group but differ in "
                f"cache_policy {sorted(policies)} or cache_ways {sorted(ways)}"
            )
        capacity = {
            name: o.rows
            for name, o, s in zip(self._local_names, cache_options, shards, strict=True)
            if o.rows is not None and o.rows < s.local_rows
        }
        cache = CacheConfig(capacity=capacity or None, policy=policies.pop(), ways=ways.pop())
        optimizer_type, optimizer_kwargs = fused_optimizer_of(config.fused_params)
        options: dict[str, Any] = {
            "cache": cache,
            "store": store,
            "device": device,
            "enable_fusion": False,
            "optimizer_type": optimizer_type,
            "optimizer_kwargs": optimizer_kwargs,
            "allow_unsharded_replicas": True,  # a shard per rank, by design
        }
        self.collection: CachedEmbeddingBagCollection | CachedEmbeddingCollection = (
            CachedEmbeddingBagCollection(tables, is_weighted=config.is_weighted, **options)
            if self.pooled
            else CachedEmbeddingCollection(tables, **options)
        )
        self._optimizer: KernelOptimizer | None = None

    pooled = True  # pooled bags (a `CachedEmbeddingBagCollection`)

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The shards' fused optimizer (`KernelOptimizer`), keyed ``<table>.weight``
        (torchrec's sharded collection prefixes ``embedding_bags.``)."""
        if self._optimizer is None:
            shards = {
                local: (public, shard)
                for local, public, shard in zip(
                    self._local_names,
                    self._public_names,
                    self._config.embedding_tables,
                    strict=True,
                )
            }
            self._optimizer = KernelOptimizer(self.collection.fused_optimizer(), shards, self._pg)
        return self._optimizer

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """``[B, sum of the features' shard dims]``, features in the group's order."""
        if features.variable_stride_per_key():
            raise ValueError(
                "embcache's cached kernel takes one batch size for every feature (no "
                "variable batch per feature)"
            )
        weights = features.weights_or_none() if self._config.is_weighted else None
        local = KeyedJaggedTensor(
            keys=self._keys,
            values=features.values(),
            lengths=features.lengths(),
            weights=weights,
            stride=features.stride(),
        )
        return self.collection(local).values()

    # -- state: kept from torchrec's machinery (see the module docstring) -----------------------

    def state_dict(
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        return destination if destination is not None else {}

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        yield from ()

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()

    def named_parameters_by_table(self) -> Iterator[tuple[str, Any]]:
        yield from ()

    def flush(self) -> None:
        self.collection.flush()

    def purge(self) -> None:
        """Nothing: loading rows (`load_shard`) empties the caches it changes."""

    def shards(self) -> Iterator[tuple[ShardedEmbeddingTable, str]]:
        """Each shard this kernel holds and its table's name in the collection."""
        yield from zip(self._config.embedding_tables, self._local_names, strict=True)

    def load_shard(self, local_name: str, rows: torch.Tensor) -> None:
        """Overwrite a shard's weights (``[local_rows, local_cols]``); optimizer state kept."""
        dim = rows.shape[1]
        self.collection.write_table_rows(local_name, rows, slice(0, dim))


class CachedSequenceKernel(CachedBagKernel):
    """One group of table shards on this rank for torchrec's sharded ``EmbeddingCollection``:
    a `CachedEmbeddingCollection` giving each value its row, ``[nnz, local dim]`` in the
    values' order (feature after feature)."""

    pooled = False

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        if features.variable_stride_per_key():
            raise ValueError(
                "embcache's cached kernel takes one batch size for every feature (no "
                "variable batch per feature)"
            )
        local = KeyedJaggedTensor(
            keys=self._keys,
            values=features.values(),
            lengths=features.lengths(),
            stride=features.stride(),
        )
        rows = self.collection(local)
        return torch.cat([rows[k].values() for k in self._keys])


class KernelOptimizer(FusedOptimizer):
    """A kernel's fused optimizer as torchrec's FUSED kernels expose theirs: the update runs
    inside backward with the hyper-parameters the last ``step()`` handed it, so an LR scheduler
    stepped after ``step()`` takes effect one backward later, exactly as with FBGEMM's kernels
    (the collection underneath would read ``param_groups`` at every update instead);
    ``zero_grad`` and a loaded state dict hand them over too. ``state`` and ``params`` are the
    collection's (`embcache.models.torch_optim.keyed_optimizer`): each table's optimizer state,
    keyed by the table's name (``shards``: the collection's name of a shard -> the table's name
    and the shard) and named as the FUSED kernel names it (`fused_state_name`). As with
    FBGEMM's fused optimizers, each state tensor is a ``ShardedTensor`` of the table's shape
    holding this rank's rows (`ShardState`), so ``torch.distributed.checkpoint`` saves every
    rank's part."""

    def __init__(
        self,
        inner: KeyedOptimizer,
        shards: Mapping[str, tuple[str, ShardedEmbeddingTable]],
        pg: dist.ProcessGroup | None,
    ) -> None:
        self._inner = inner
        groups = [dict(g) for g in inner.param_groups]
        params, state = {}, {}
        for key, param in inner.params.items():
            table = key.removesuffix(".weight")
            public, shard = shards[table]
            params[f"{public}.weight"] = param
            if param in inner.state:
                state[param] = {
                    fused_state_name(n, table, public): ShardState(
                        v, shard, pg, whole=public == shard.name
                    )
                    for n, v in inner.state[param].items()
                }
        super().__init__(params, state, groups)

    def step(self, closure: Any = None) -> None:
        self._hand_over()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """No gradient is kept; the hyper-parameters reach the rows, as FBGEMM's fused
        optimizers take their learning rate in ``zero_grad`` too."""
        self._hand_over()

    def post_load_state_dict(self) -> None:
        """Loaded ``param_groups`` (``save_param_groups(True)``) reach the rows at once: a
        resumed job's first backward runs at the checkpoint's rates."""
        self._hand_over()

    def _hand_over(self) -> None:
        for mine, theirs in zip(self.param_groups, self._inner.param_groups, strict=True):
            theirs.update((k, v) for k, v in mine.items() if k != "params")


def fused_state_name(name: str, table: str, public: str) -> str:
    """The name torchrec's FUSED kernel gives an optimizer state tensor (``t0.momentum1``,
    ``t0.momentum2``) for the collection's (``<table>.weight.momentum_1``), so a DMP
    checkpoint moves between that kernel and the cache."""
    part = name.removeprefix(f"{table}.weight.")
    return f"{public}.{part.replace('momentum_', 'momentum')}"


class ShardState:
    """One optimizer state tensor of one shard (`embcache.models.torch_optim.TableState`, read
    and written in the tier), with the stateful protocol a torchrec ``KeyedOptimizer`` calls:
    ``state_dict()`` gives a ``ShardedTensor`` of the table's shape (``[rows, cols]`` as the
    weight, or row-wise AdaGrad's ``[rows]``) holding this rank's rows; ``load_state_dict``
    takes one (its local shard) or this shard's rows as a tensor.

    ``whole`` False (the table has several shards on this rank: column-wise) or a row-wise
    state of a column shard give the local tensor itself, which is this rank's only."""

    def __init__(
        self, state: Any, shard: ShardedEmbeddingTable, pg: dist.ProcessGroup | None, whole: bool
    ) -> None:
        self.state, self.shard, self.pg, self.whole = state, shard, pg, whole

    def _metadata(self, local: torch.Tensor) -> tuple[ShardMetadata, Any] | None:
        shard = self.shard
        meta, glob = shard.local_metadata, shard.global_metadata
        if not self.whole or meta is None or glob is None:
            return None
        if local.dim() == 2:
            return meta, glob
        if any(m.shard_sizes[1] != glob.size[1] for m in glob.shards_metadata):
            return None  # column shards: one row-wise value per shard, not per row
        one_d = [
            ShardMetadata([m.shard_offsets[0]], [m.shard_sizes[0]], m.placement)
            for m in glob.shards_metadata
        ]
        mine = ShardMetadata([meta.shard_offsets[0]], [meta.shard_sizes[0]], meta.placement)
        properties = dataclasses.replace(glob.tensor_properties, dtype=local.dtype)
        return mine, ShardedTensorMetadata(one_d, torch.Size([glob.size[0]]), properties)

    def state_dict(self) -> torch.Tensor:
        local = self.state.state_dict().contiguous()
        found = self._metadata(local)
        if found is None:
            return local
        meta, glob = found
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(tensor=local, metadata=meta)], glob, process_group=self.pg
        )

    def load_state_dict(self, value: torch.Tensor) -> None:
        if isinstance(value, ShardedTensor):
            (local,) = value.local_shards()
            value = local.tensor
        self.state.load_state_dict(value)


def _local_names(shards: list[ShardedEmbeddingTable], per_shard: bool) -> list[str]:
    """A collection table name per shard: the table's own, or the table's with the shard's
    offsets (``t0_rows500_cols0``) for several shards of one table on this rank (column-wise)
    or, with ``per_shard``, always (the tables of a tier that other ranks share)."""
    counts: dict[str, int] = {}
    for s in shards:
        counts[s.name] = counts.get(s.name, 0) + 1
    names = []
    for s in shards:
        row, col = s.local_metadata.shard_offsets if s.local_metadata else (0, 0)
        unique = counts[s.name] == 1 and not per_shard
        names.append(s.name if unique else f"{s.name}_rows{row}_cols{col}")
    return names


class CachedPooledLookup(GroupedPooledEmbeddingsLookup):
    """torchrec's grouped pooled lookup whose ``CUSTOMIZED_KERNEL`` groups are
    `CachedBagKernel`s (other groups get torchrec's kernels).

    Args:
        cache_options: the cache of a shard, given its table, rows and fused params.
        other arguments: torchrec's.
    """

    def __init__(
        self,
        grouped_configs: list[GroupedEmbeddingConfig],
        cache_options: Any,
        device: torch.device | None = None,
        pg: dist.ProcessGroup | None = None,
        sharding_type: ShardingType | None = None,
        env: ShardingEnv | None = None,
    ) -> None:
        self._cache_options = cache_options
        super().__init__(
            grouped_configs=grouped_configs,
            device=device,
            pg=pg,
            sharding_type=sharding_type,
            env=env,
        )

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> BaseEmbedding:
        if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return super()._create_embedding_kernel(config, device, pg, sharding_type, env)
        options = [
            self._cache_options(t.name, t.local_rows, t.fused_params)
            for t in config.embedding_tables
        ]
        return CachedBagKernel(config, options, pg, device, sharding_type)

    def cached_kernels(self) -> Iterator[CachedBagKernel]:
        for m in self._emb_modules:
            if isinstance(m, CachedBagKernel):
                yield m


class CachedSequenceLookup(GroupedEmbeddingsLookup):
    """torchrec's grouped sequence lookup whose ``CUSTOMIZED_KERNEL`` groups are
    `CachedSequenceKernel`s (other groups get torchrec's kernels); arguments as
    `CachedPooledLookup`'s."""

    def __init__(
        self,
        grouped_configs: list[GroupedEmbeddingConfig],
        cache_options: Any,
        device: torch.device | None = None,
        pg: dist.ProcessGroup | None = None,
        env: ShardingEnv | None = None,
    ) -> None:
        self._cache_options = cache_options
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, env=env)

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        env: ShardingEnv | None = None,
    ) -> BaseEmbedding:
        if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return super()._create_embedding_kernel(config, pg, device, env)
        options = [
            self._cache_options(t.name, t.local_rows, t.fused_params)
            for t in config.embedding_tables
        ]
        return CachedSequenceKernel(config, options, pg, device)

    def cached_kernels(self) -> Iterator[CachedBagKernel]:
        for m in self._emb_modules:
            if isinstance(m, CachedBagKernel):
                yield m
