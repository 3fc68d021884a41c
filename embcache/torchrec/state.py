"""What torchrec's sharded collections skip for a ``CUSTOMIZED_KERNEL`` table and embcache's
sharded collections add (`CachedShards`, mixed into `ShardedCachedEmbeddingBagCollection` and
`ShardedCachedEmbeddingCollection`): the rows in ``state_dict()`` (a ``ShardedTensor`` per table
of the ranks' flushed shards, as torchrec holds its tables), ``load_state_dict()`` (this rank's
rows, from such a ShardedTensor or a whole tensor, written into its tier), and
``reset_parameters`` for the tables left on torchrec's kernels only (a cached shard drew its
rows when it was built)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype

from embcache.torchrec.constraints import CACHED_KERNEL
from embcache.torchrec.kernel import CachedBagKernel, CachedPooledLookup, CachedSequenceLookup

_OWN_INIT = {  # torchrec's kernels that initialise their own rows
    EmbeddingComputeKernel.KEY_VALUE.value,
    EmbeddingComputeKernel.SSD_VIRTUAL_TABLE.value,
    EmbeddingComputeKernel.DRAM_VIRTUAL_TABLE.value,
    EmbeddingComputeKernel.DRAM_SSD_VIRTUAL_TABLE.value,
}


class CachedShards:
    """The cached tables of a torchrec sharded collection. The class it is mixed into gives
    ``_weights_prefix`` (``"embedding_bags"``/``"embeddings"``, torchrec's name) and
    `_table_configs`; torchrec's class gives ``_lookups``, ``module_sharding_plan``,
    ``_table_name_to_config``, ``_env`` and ``_device``."""

    _weights_prefix: str
    _lookups: list[Any]
    module_sharding_plan: Any
    _table_name_to_config: Any
    _env: Any
    _device: Any

    def _table_configs(self) -> list[Any]:
        raise NotImplementedError

    def _register_cached_state(self) -> None:
        register: Any = self
        register._register_state_dict_hook(_cached_state_dict_hook)
        register._register_load_state_dict_pre_hook(_cached_load_pre_hook, with_module=True)

    def cached_kernels(self) -> list[CachedBagKernel]:
        """This rank's cached kernels, in lookup order."""
        out: list[CachedBagKernel] = []
        for lookup in self._lookups:
            while isinstance(lookup, DistributedDataParallel):
                lookup = lookup.module
            if isinstance(lookup, CachedPooledLookup | CachedSequenceLookup):
                out.extend(lookup.cached_kernels())
        return out

    def cached_tables(self) -> list[str]:
        """Tables of the collection on embcache's kernel, in the collection's order."""
        plan = self.module_sharding_plan
        return [
            c.name for c in self._table_configs() if plan[c.name].compute_kernel == CACHED_KERNEL
        ]

    def reset_parameters(self) -> None:
        """torchrec's initialisation for tables on its kernels; a cached shard has drawn its
        own rows (``init_fn`` bounds of its table, per row) when it was built."""
        if self._device is not None and self._device.type == "meta":
            return
        cached = set(self.cached_tables())
        holders: Any = getattr(self, self._weights_prefix)
        for config in self._table_configs():
            sharding = self.module_sharding_plan[config.name]
            if config.name in cached or sharding.compute_kernel in _OWN_INIT:
                continue
            assert config.init_fn is not None
            param = holders[config.name].weight
            config.init_fn(param)
            if sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
                with torch.no_grad():
                    torch.distributed.broadcast(param.data, src=0, group=self._env.process_group)

    def _sharded_weight_metadata(self, table: str) -> Any:
        config = self._table_name_to_config[table]
        spec = self.module_sharding_plan[table].sharding_spec
        assert spec is not None
        return spec.build_metadata(
            tensor_sizes=torch.Size([config.num_embeddings, config.embedding_dim]),
            tensor_properties=TensorProperties(dtype=data_type_to_dtype(config.data_type)),
        )


def _cached_state_dict_hook(
    module: CachedShards, destination: dict[str, Any], prefix: str, _local_metadata: Any
) -> None:
    """Add ``<prefix><weights>.<t>.weight`` of every cached table: a ShardedTensor of the rows
    this rank's kernels hold (flushed), empty where it holds none."""
    shards: dict[str, list[Shard]] = {t: [] for t in module.cached_tables()}
    for kernel in module.cached_kernels():
        kernel.flush()
        for shard, local_name in kernel.shards():
            weight = kernel.collection.table_weight(local_name).contiguous()
            shards[shard.name].append(Shard(tensor=weight, metadata=shard.local_metadata))
    for table, local in shards.items():
        destination[f"{prefix}{module._weights_prefix}.{table}.weight"] = (
            ShardedTensor._init_from_local_shards_and_global_metadata(
                local_shards=local,
                sharded_tensor_metadata=module._sharded_weight_metadata(table),
                process_group=module._env.process_group,
            )
        )


def _cached_load_pre_hook(
    module: CachedShards, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Take every cached table's weights out of ``state_dict`` (a ShardedTensor with this
    rank's shards, or the whole table) and write this rank's rows into its tier."""
    for table in module.cached_tables():
        key = f"{prefix}{module._weights_prefix}.{table}.weight"
        if key not in state_dict:
            continue
        value = state_dict.pop(key)
        for kernel in module.cached_kernels():
            for shard, local_name in kernel.shards():
                if shard.name == table:
                    kernel.load_shard(local_name, _rows_of_shard(value, shard, key))


def _rows_of_shard(value: Any, shard: Any, key: str) -> torch.Tensor:
    offsets = list(shard.local_metadata.shard_offsets)
    sizes = list(shard.local_metadata.shard_sizes)
    if isinstance(value, ShardedTensor):
        for s in value.local_shards():
            if list(s.metadata.shard_offsets) == offsets and list(s.metadata.shard_sizes) == sizes:
                return s.tensor
        raise ValueError(
            f"{key}: the ShardedTensor has no local shard at offsets {offsets} of sizes "
            f"{sizes} (this rank's shard); load a state_dict of the same plan or whole tensors"
        )
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        raise ValueError(f"{key}: expected a 2-D tensor or ShardedTensor")
    (r, c), (nr, nc) = offsets, sizes
    if value.shape[0] < r + nr or value.shape[1] < c + nc:
        raise ValueError(
            f"{key}: shape {tuple(value.shape)} lacks this rank's shard at rows {r}:{r + nr}, "
            f"columns {c}:{c + nc}"
        )
    return value[r : r + nr, c : c + nc]
