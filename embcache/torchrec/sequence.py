"""torchrec's ``DistributedModelParallel`` over embcache's `CachedEmbeddingCollection` (sequence
embeddings: one row per id): `CachedEmbeddingCollectionSharder` and
`ShardedCachedEmbeddingCollection`, the bag sharder's twins (`embcache.torchrec.sharder`) on
torchrec's ``ShardedEmbeddingCollection``, each rank's shards on a `CachedSequenceKernel`."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import EmbeddingConfig, data_type_to_dtype

from embcache.models.sequence import CachedEmbeddingCollection
from embcache.torchrec.constraints import (
    CACHED_KERNEL,
    CachedKernelSharder,
    on_cached_kernel,
    stand_in_kernel,
)
from embcache.torchrec.kernel import (
    CachedSequenceLookup,
    in_backward_optimizer,
    mark_in_backward,
)
from embcache.torchrec.sharder import DTYPES
from embcache.torchrec.state import CachedShards

# torchrec's sequence shardings that hold their groups as `_grouped_embedding_configs`.
_SHARDING_TYPES = [
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
]


class ShardedCachedEmbeddingCollection(CachedShards, ShardedEmbeddingCollection):
    """torchrec's ``ShardedEmbeddingCollection`` whose ``CUSTOMIZED_KERNEL`` tables run on
    embcache's cache; ``state_dict()`` as `ShardedCachedEmbeddingBagCollection`'s, under
    ``embeddings.<t>.weight``.

    Args:
        cache_options: ``(table, local_rows, fused_params) -> ShardCacheOptions``.
        other arguments: torchrec's.
    """

    _weights_prefix = "embeddings"

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
            module,
            table_name_to_parameter_sharding,
            env,
            fused_params,
            device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        self._register_cached_state()

    def _table_configs(self) -> list[Any]:
        return self._embedding_configs

    def _create_lookups(self) -> None:
        for sharding_type, sharding in self._sharding_type_to_sharding.items():
            groups = getattr(sharding, "_grouped_embedding_configs", None)
            cached = groups is not None and any(
                g.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL for g in groups
            )
            if groups is None or not cached:
                lookup = sharding.create_lookup()
                if self.enable_embedding_update and sharding.enable_embedding_update:
                    self._updates.append(sharding.create_update(lookup))
                self._lookups.append(lookup)
                continue
            if sharding_type not in _SHARDING_TYPES:
                raise ValueError(
                    f"embcache's cached kernel does not run {sharding_type!r} sharding of "
                    f"sequence tables; plan them {_SHARDING_TYPES}"
                )
            self._lookups.append(
                CachedSequenceLookup(
                    grouped_configs=groups,
                    cache_options=self._cache_options,
                    device=sharding._device,
                    pg=sharding._pg,
                    env=sharding._env,
                )
            )


class _SequenceTablesOf(nn.Module):
    """What torchrec's sharded sequence collection reads of a `CachedEmbeddingCollection`:
    torchrec ``EmbeddingConfig``s, the collection's options, and meta-tensor weights with the
    collection's in-backward optimizer (as `embcache.torchrec.sharder._TablesOf`'s)."""

    device = torch.device("meta")

    def __init__(self, module: CachedEmbeddingCollection) -> None:
        super().__init__()
        self._configs = sequence_configs(module)
        self._need_indices = module.need_indices()
        self._names_by_table = module.embedding_names_by_table()
        self.embeddings = nn.ModuleDict()
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
            self.embeddings[c.name] = holder

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs

    def embedding_dim(self) -> int:
        return self._configs[0].embedding_dim

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._names_by_table

    def use_gather_select(self) -> bool:
        return False

    def use_gather_select_per_sharding(self) -> None:
        return None

    def weight(self, table: str) -> nn.Parameter:
        holder: Any = self.embeddings[table]
        return holder.weight


def sequence_configs(module: CachedEmbeddingCollection) -> list[EmbeddingConfig]:
    """The collection's tables as torchrec ``EmbeddingConfig``s.

    Raises:
        ValueError: an unbounded table, or tables of different dims (torchrec's sharded
            sequence collection takes one dim), named.
    """
    out = []
    for t in module.tables:
        if t.num_embeddings is None:
            raise ValueError(
                f"table {t.name!r} is unbounded (num_embeddings=None): torchrec's planner "
                "shards tables of known rows"
            )
        out.append(
            EmbeddingConfig(
                name=t.name,
                embedding_dim=t.dim,
                num_embeddings=t.num_embeddings,
                feature_names=list(t.feature_names),
                data_type=DTYPES[t.dtype],
            )
        )
    dims = {c.embedding_dim for c in out}
    if len(dims) > 1:
        raise ValueError(
            f"tables of dims {sorted(dims)}: torchrec's sharded EmbeddingCollection takes "
            "tables of one embedding_dim"
        )
    return out


class CachedEmbeddingCollectionSharder(CachedKernelSharder, EmbeddingCollectionSharder):
    """torchrec's sharder for embcache's `CachedEmbeddingCollection` (``module_type``):
    table-, row- and column-wise shards of its tables on embcache's cache, whichever kernel
    the plan names. Arguments as `CachedEmbeddingBagCollectionSharder`'s."""

    @property
    def module_type(self) -> type[CachedEmbeddingCollection]:
        return CachedEmbeddingCollection

    @property
    def sharded_module_type(self) -> type[ShardedCachedEmbeddingCollection]:
        return ShardedCachedEmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if self.names_cached_kernel:
            return [CACHED_KERNEL]
        return [stand_in_kernel(compute_device_type)]

    def shardable_parameters(self, module: Any) -> dict[str, nn.Parameter]:
        tables = _SequenceTablesOf(module)
        return {c.name: tables.weight(c.name) for c in tables.embedding_configs()}

    def shard(
        self,
        module: CachedEmbeddingCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedCachedEmbeddingCollection:
        cache = self._cache if self._cache is not None else module.cache_config
        return ShardedCachedEmbeddingCollection(
            module=_SequenceTablesOf(module),
            table_name_to_parameter_sharding=on_cached_kernel(params),
            env=env,
            cache_options=functools.partial(self.cache_options, cache),
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
