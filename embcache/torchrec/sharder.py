"""torchrec's ``DistributedModelParallel`` over embcache's cached collections.

`CachedEmbeddingBagCollectionSharder` shards a `CachedEmbeddingBagCollection` the way torchrec's
``EmbeddingBagCollectionSharder`` shards an ``EmbeddingBagCollection``: torchrec's planner picks
table-wise, row-wise or column-wise shards, torchrec's input and output dists move ids and
pooled rows between the ranks, and each rank's shards run on embcache's kernel
(`embcache.torchrec.kernel.CachedBagKernel`: the rows in a device cache over a tier of the
rank's own) instead of FBGEMM's. The sharded module is torchrec's
``ShardedEmbeddingBagCollection`` with three seams of its own
(`ShardedCachedEmbeddingBagCollection`): the lookups it builds, the rows in ``state_dict()`` /
``load_state_dict()`` (torchrec skips a ``CUSTOMIZED_KERNEL`` table's state), and
``reset_parameters`` (a cached shard draws its own rows).

The plan may come from torchrec's own ``EmbeddingShardingPlanner``, which sees the tables on the
kernel the cache stands in for (`embcache.torchrec.constraints.stand_in_kernel`; a
``cache_params.load_factor`` in its constraints sizes the caches), or from
`CachedEmbeddingShardingPlanner`, which names embcache's kernel and counts the caches in its
storage estimate; either way every table of the collection trains on the cache.

Example (each rank)::

    model = DLRM(...)   # holding an embcache.CachedEmbeddingBagCollection
    sharder = CachedEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05},
        constraints=constraints)
    plan = CachedEmbeddingShardingPlanner(topology, constraints).collective_plan(
        model, [sharder], pg)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg),
                                   sharders=[sharder], plan=plan)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    PoolingType,
    data_type_to_dtype,
)

from embcache.kernels.pooling import PoolingMode
from embcache.models.collection import CachedEmbeddingBagCollection
from embcache.torchrec.constraints import (
    CACHED_KERNEL,
    CachedKernelSharder,
    CachedParameterConstraints,
    on_cached_kernel,
    stand_in_kernel,
)
from embcache.torchrec.kernel import (
    CachedPooledLookup,
    in_backward_optimizer,
    mark_in_backward,
)
from embcache.torchrec.state import CachedShards

# Sharding types whose shardings hold their groups as `_grouped_embedding_configs`.
_SHARDING_TYPES = [
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
]
DTYPES = {  # torch dtype -> torchrec DataType
    torch.float32: DataType.FP32,
    torch.float16: DataType.FP16,
    torch.bfloat16: DataType.BF16,
}


class ShardedCachedEmbeddingBagCollection(CachedShards, ShardedEmbeddingBagCollection):
    """torchrec's ``ShardedEmbeddingBagCollection`` whose ``CUSTOMIZED_KERNEL`` tables run on
    embcache's cache (any other table on torchrec's kernels).

    ``state_dict()`` holds every cached table as torchrec does, ``embedding_bags.<t>.weight``
    a ``ShardedTensor`` of the ranks' shards (a collective; the caches are flushed first);
    ``load_state_dict()`` takes those or whole tensors and writes each rank's rows into its
    tier (the caches are emptied). Optimizer state is in ``fused_optimizer`` (each rank's
    shards, not yet as ShardedTensors).

    Args:
        cache_options: ``(table, local_rows, fused_params) -> ShardCacheOptions``.
        other arguments: torchrec's.
    """

    def __init__(
        self,
        module: Any,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        cache_options: Any,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
        module_fqn: str | None = None,
    ) -> None:
        self._cache_options = cache_options
        super().__init__(
            module=module,
            table_name_to_parameter_sharding=table_name_to_parameter_sharding,
            env=env,
            fused_params=fused_params,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        self._register_cached_state()

    _weights_prefix = "embedding_bags"

    def _table_configs(self) -> list[Any]:
        return self._embedding_bag_configs

    def _create_lookups(self) -> None:
        for sharding, sharding_type in zip(
            self._embedding_shardings, self._sharding_types, strict=True
        ):
            groups = getattr(sharding, "_grouped_embedding_configs", None)
            cached = groups is not None and any(
                g.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL for g in groups
            )
            if groups is None or not cached:
                self._lookups.append(sharding.create_lookup())
                continue
            if sharding_type not in _SHARDING_TYPES:
                raise ValueError(
                    f"embcache's cached kernel does not run {sharding_type!r} sharding; "
                    f"plan its tables {_SHARDING_TYPES}"
                )
            row_wise = sharding_type == ShardingType.ROW_WISE.value
            self._lookups.append(
                CachedPooledLookup(
                    grouped_configs=groups,
                    cache_options=self._cache_options,
                    device=sharding._device,
                    pg=sharding._pg,
                    sharding_type=ShardingType.ROW_WISE if row_wise else None,
                    env=sharding._env,
                )
            )


# -- the unsharded collection as torchrec's sharded collection reads it --------------------------


class _TablesOf(nn.Module):
    """What torchrec's sharded collection reads of the collection it shards, for a
    `CachedEmbeddingBagCollection`: torchrec table configs, weighting, and each table's
    ``embedding_bags.<t>.weight`` as a meta tensor (its shape and dtype; no row is read),
    carrying the optimizer ``apply_optimizer_in_backward`` gave the collection's parameters
    (`embcache.torchrec.kernel.in_backward_optimizer`), which torchrec reads into each
    table's fused params as it does from its own collection's weights."""

    device = torch.device("meta")

    def __init__(self, module: CachedEmbeddingBagCollection) -> None:
        super().__init__()
        self._configs = torchrec_configs(module)
        self._is_weighted = module.is_weighted()
        self.embedding_bags = nn.ModuleDict()
        anchor = module.grad_anchor  # what apply_optimizer_in_backward reached
        in_backward = in_backward_optimizer(anchor, f"{type(module).__name__}'s parameters")
        for c in self._configs:
            holder = nn.Module()
            holder.weight = nn.Parameter(
                torch.empty(
                    c.num_embeddings,
                    c.embedding_dim,
                    dtype=data_type_to_dtype(c.data_type),
                    device="meta",
                ),
                requires_grad=False,
            )
            if in_backward is not None:
                mark_in_backward(holder.weight, anchor)
            self.embedding_bags[c.name] = holder

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def weight(self, table: str) -> nn.Parameter:
        holder: Any = self.embedding_bags[table]
        return holder.weight

    def is_weighted(self) -> bool:
        return self._is_weighted


def torchrec_configs(module: CachedEmbeddingBagCollection) -> list[EmbeddingBagConfig]:
    """The collection's tables as torchrec ``EmbeddingBagConfig``s.

    Raises:
        ValueError: a table torchrec cannot shard (MAX pooling, unbounded rows), named.
    """
    out = []
    for t in module.tables:
        if t.num_embeddings is None:
            raise ValueError(
                f"table {t.name!r} is unbounded (num_embeddings=None): torchrec's planner "
                "shards tables of known rows"
            )
        if t.pooling not in (PoolingMode.SUM, PoolingMode.MEAN):
            raise ValueError(
                f"table {t.name!r} pools by {t.pooling}: torchrec's sharded collections pool "
                "SUM or MEAN"
            )
        pooling = PoolingType.SUM if t.pooling == PoolingMode.SUM else PoolingType.MEAN
        out.append(
            EmbeddingBagConfig(
                name=t.name,
                embedding_dim=t.dim,
                num_embeddings=t.num_embeddings,
                feature_names=list(t.feature_names),
                pooling=pooling,
                data_type=DTYPES[t.dtype],
            )
        )
    return out


class CachedEmbeddingBagCollectionSharder(CachedKernelSharder, EmbeddingBagCollectionSharder):
    """torchrec's sharder for embcache's `CachedEmbeddingBagCollection` (``module_type``).
    Every table trains on embcache's cache, whichever kernel the plan names (torchrec's planner
    sees `stand_in_kernel`, `CachedEmbeddingShardingPlanner` embcache's own).

    Args:
        fused_params: torchrec's: the fused optimizer (``"optimizer"``: an ``EmbOptimType``
            of EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, ADAM; ``"learning_rate"``,
            ``"eps"``, ``"beta1"``, ``"beta2"``, ``"weight_decay"``), applied in backward.
            None: FBGEMM's default, SGD at lr 0.01.
        constraints: the planner's constraints; a table's `CachedParameterConstraints` sizes
            its shards' caches and names their tier.
        cache: the cache of tables without such constraints (``capacity`` rows per shard, or
            ``load_factor`` of a shard's rows); None: the collection's own ``CacheConfig``.
        store: the tier of tables without such constraints: None (a host tier in each rank's
            memory) or a URL.
        qcomm_codecs_registry: torchrec's.
    """

    @property
    def module_type(self) -> type[CachedEmbeddingBagCollection]:
        return CachedEmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[ShardedCachedEmbeddingBagCollection]:
        return ShardedCachedEmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """Table-, row- and column-wise (and table-column-wise), on CPU and CUDA alike."""
        return list(_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if self.names_cached_kernel:
            return [CACHED_KERNEL]
        return [stand_in_kernel(compute_device_type)]

    def shardable_parameters(self, module: Any) -> dict[str, nn.Parameter]:
        tables = _TablesOf(module)
        return {c.name: tables.weight(c.name) for c in tables.embedding_bag_configs()}

    def shard(
        self,
        module: CachedEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedCachedEmbeddingBagCollection:
        cache = self._cache if self._cache is not None else module.cache_config
        return ShardedCachedEmbeddingBagCollection(
            module=_TablesOf(module),
            table_name_to_parameter_sharding=on_cached_kernel(params),
            env=env,
            cache_options=functools.partial(self.cache_options, cache),
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )


class CachingEmbeddingBagCollectionSharder(CachedKernelSharder, EmbeddingBagCollectionSharder):
    """torchrec's sharder for its own ``EmbeddingBagCollection`` (``module_type``), which can
    also put tables in embcache's cache: a table whose constraints are
    `CachedParameterConstraints` is planned on embcache's kernel (by
    `CachedEmbeddingShardingPlanner`, which keeps the other tables on torchrec's kernels) and
    trains in a cache over a tier of its rank's own; the rest are torchrec's, as its
    ``EmbeddingBagCollectionSharder`` shards them. Row-wise sharding is offered on a CPU too.

    Here the plan's kernel is what tells a cached table from torchrec's, so the cache needs
    `CachedEmbeddingShardingPlanner`: torchrec's own planner is offered torchrec's kernels only
    and plans every table on them (``shard`` refuses a plan that leaves a table of this
    sharder's `CachedParameterConstraints` off the cache).

    Args: as `CachedEmbeddingBagCollectionSharder`'s (``cache`` and ``store`` apply to cached
        tables without constraints of their own).
    """

    @property
    def sharded_module_type(self) -> type[ShardedCachedEmbeddingBagCollection]:
        return ShardedCachedEmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        if ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        kernels = list(super().compute_kernels(sharding_type, compute_device_type))
        if self.names_cached_kernel and sharding_type in _SHARDING_TYPES:
            kernels.append(CACHED_KERNEL)
        return kernels

    def shard(
        self,
        module: Any,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedCachedEmbeddingBagCollection:
        for name, p in params.items():
            wanted = isinstance(self._constraints.get(name), CachedParameterConstraints)
            if wanted and p.compute_kernel != CACHED_KERNEL:
                raise ValueError(
                    f"table {name!r} has CachedParameterConstraints but is planned on "
                    f"{p.compute_kernel!r}: plan with "
                    "embcache.torchrec.CachedEmbeddingShardingPlanner to cache it"
                )
            if p.compute_kernel == CACHED_KERNEL:
                in_backward_optimizer(module.embedding_bags[name].weight, f"table {name!r}")
        return ShardedCachedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            cache_options=functools.partial(self.cache_options, self._cache),
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
