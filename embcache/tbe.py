"""`CachedTBE`: FBGEMM's table-batched embedding call shape over a cached collection.

FBGEMM users build ``SplitTableBatchedEmbeddingBagsCodegen(embedding_specs, feature_table_map,
cache_load_factor=..., optimizer=EmbOptimType...)`` and call it with ``(indices, offsets,
per_sample_weights)``; the optimizer runs inside backward. `CachedTBE` takes the same
arguments and calls, so such code changes one line::

    tbe = embcache.tbe.CachedTBE(
        embedding_specs=[(1_000_000, 64, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CPU),
                         (5_000, 32, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        feature_table_map=[0, 0, 1],        # features 0 and 1 look up table 0
        cache_load_factor=0.1,              # the MANAGED_CACHING tables: 10% of their rows
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-8,
    )
    out = tbe(indices, offsets)            # [B, 64 + 64 + 32], features side by side
    out.sum().backward()                   # rows updated here, as FBGEMM's fused backward
    weights = tbe.split_embedding_weights()

It is a thin adapter: tables ``t0, t1, ...`` and features ``f0, f1, ...`` of a
`CachedEmbeddingBagCollection` (``collection``), the batch read with
`JaggedBatch.from_offsets`, the optimizer the sparse optimizer of the same rule
(`kernels.optim_rules.by_fbgemm`), applied inside backward. Given the same weights, its outputs
and updated rows are FBGEMM's CPU TBE's bit for bit (on a CPU with fbgemm-gpu installed, the
collection's step is FBGEMM's own TBE over the cache's storage; `engine.tbe_step`).

Differences: the initial rows are torchrec's (uniform in ``±sqrt(1 / rows)``, from torch's
generator), not FBGEMM's: load FBGEMM's with `load_split_embedding_weights`;
`split_embedding_weights` returns copies (writing to them changes nothing); the tables may be
larger than memory (the rows live in ``store``); ``cache_load_factor`` sizes one cache per
MANAGED_CACHING table (`CacheConfig` per-table sizes), other locations are cached whole.
Pooling SUM and MEAN (NONE: `embcache.CachedEmbeddingCollection`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import embcache.optim as sparse_optimizers
from embcache.cache.config import CacheConfig
from embcache.engine.inputs import JaggedBatch
from embcache.engine.tables import TableConfig
from embcache.kernels.optim_rules import RULES, by_fbgemm
from embcache.kv.base import Store
from embcache.models.collection import CachedEmbeddingBagCollection

# EmbeddingLocation names whose tables FBGEMM caches (cache_load_factor applies).
_CACHED_LOCATIONS = ("MANAGED_CACHING",)


def _name(value: Any, where: str) -> str:
    """An FBGEMM enum member (or its name, or a RecStore-style string) as its name."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, str):
        return value.upper()
    raise TypeError(f"{where} must be an FBGEMM enum member or its name, got {value!r}")


class CachedTBE(nn.Module):
    """FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` over device caches and a tier (see
    the module docstring).

    Args:
        embedding_specs: per table ``(num_embeddings, embedding_dim[, EmbeddingLocation[,
            ComputeDevice]])``; the location decides whether ``cache_load_factor`` applies
            (MANAGED_CACHING, or none given) or the table is cached whole.
        feature_table_map: the table of each feature (default: one feature per table).
        cache_load_factor: fraction of a cached table's rows held on the device.
        optimizer: FBGEMM's ``EmbOptimType`` (or its name): EXACT_SGD, EXACT_ADAGRAD,
            EXACT_ROWWISE_ADAGRAD.
        learning_rate, eps, weight_decay: its hyper-parameters (FBGEMM's defaults).
        pooling_mode: FBGEMM's ``PoolingMode`` (or its name): SUM or MEAN.
        store, device, seed: as `CachedEmbeddingBagCollection` takes them.
        **fbgemm_kwargs: FBGEMM's other arguments are accepted when they ask for what this
            does anyway (``cache_algorithm``: LRU or LFU is the cache's policy;
            ``weights_precision``: FP32, FP16 or BF16) and refused otherwise.

    Raises:
        ValueError, TypeError: a bad spec, feature map, optimizer or option, naming it.
    """

    def __init__(
        self,
        embedding_specs: Sequence[Sequence[Any]],
        feature_table_map: Sequence[int] | None = None,
        cache_load_factor: float = 0.2,
        optimizer: Any = "EXACT_SGD",
        learning_rate: float = 0.01,
        eps: float = 1.0e-8,
        weight_decay: float = 0.0,
        pooling_mode: Any = "SUM",
        store: Store | str | None = None,
        device: torch.device | str | None = None,
        seed: int | None = None,
        **fbgemm_kwargs: Any,
    ) -> None:
        super().__init__()
        specs = [tuple(s) for s in embedding_specs]
        if not specs or any(len(s) < 2 for s in specs):
            raise ValueError(
                "embedding_specs must be a non-empty list of (num_embeddings, embedding_dim, "
                f"location, compute_device) tuples, got {embedding_specs!r}"
            )
        fmap = list(range(len(specs))) if feature_table_map is None else list(feature_table_map)
        bad = [t for t in fmap if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < len(specs)]  # fmt: skip
        if bad:
            raise ValueError(
                f"feature_table_map entry {bad[0]!r} is no table index in [0, {len(specs)})"
            )
        unused = [i for i in range(len(specs)) if i not in fmap]
        if unused:
            raise ValueError(f"feature_table_map: table {unused[0]} is looked up by no feature")
        pooling = _name(pooling_mode, "pooling_mode")
        if pooling not in ("SUM", "MEAN"):
            raise ValueError(
                f"pooling_mode {pooling}: CachedTBE pools SUM or MEAN (for unpooled lookups, "
                "use embcache.CachedEmbeddingCollection)"
            )
        rule = by_fbgemm(_name(optimizer, "optimizer"))
        if rule is None:
            known = [s.fbgemm_cpu for s in RULES.values() if s.fbgemm_cpu]
            raise ValueError(f"optimizer {optimizer!r}: CachedTBE applies {known}")
        cache = self._cache_config(specs, cache_load_factor, fbgemm_kwargs)
        self.feature_table_map = fmap
        self.features = [f"f{j}" for j in range(len(fmap))]
        self.dims = [int(specs[t][1]) for t in fmap]  # output columns of each feature
        tables = [
            TableConfig(
                name=f"t{i}",
                embedding_dim=int(s[1]),
                num_embeddings=int(s[0]),
                feature_names=[f for f, t in zip(self.features, fmap, strict=True) if t == i],
                pooling=pooling,
                data_type=cache.weight_dtype or "fp32",
            )
            for i, s in enumerate(specs)
        ]
        self.collection = CachedEmbeddingBagCollection(
            tables, is_weighted=True, cache=cache, store=store, device=device,
            update_in_backward=True, seed=seed,
        )  # fmt: skip
        hyper = {"weight_decay": weight_decay}
        if "eps" in rule.hyper:
            hyper["eps"] = eps
        optimizer_class = getattr(sparse_optimizers, rule.sparse_class)
        self.optimizer = optimizer_class([self.collection], lr=learning_rate, **hyper)
        # The collection's output keys (tables in order) -> FBGEMM's (features in order).
        keys = self.collection.output_keys
        if keys != self.features:
            at, start = {}, 0
            for k, d in zip(keys, self.collection.output_dims, strict=True):
                at[k], start = start, start + d
            self._columns: torch.Tensor | None = torch.cat(
                [torch.arange(at[f], at[f] + d) for f, d in zip(self.features, self.dims,
                                                                 strict=True)]
            ).to(self.collection.device)  # fmt: skip
        else:
            self._columns = None

    @staticmethod
    def _cache_config(
        specs: list[tuple[Any, ...]], cache_load_factor: float, kwargs: dict[str, Any]
    ) -> CacheConfig:
        options: dict[str, Any] = {}
        algorithm = kwargs.pop("cache_algorithm", None)
        if algorithm is not None:
            options["policy"] = _name(algorithm, "cache_algorithm").lower()
        precision = kwargs.pop("weights_precision", None)
        if precision is not None:
            options["weight_dtype"] = _name(precision, "weights_precision")
        kwargs.pop("compute_device", None)  # every spec says where; the device decides
        if kwargs:
            raise TypeError(
                f"CachedTBE: FBGEMM's {sorted(kwargs)[0]}= is not supported (accepted: "
                "cache_algorithm, weights_precision, compute_device)"
            )
        cached = {
            f"t{i}": cache_load_factor
            for i, s in enumerate(specs)
            if len(s) < 3 or _name(s[2], f"embedding_specs[{i}] location") in _CACHED_LOCATIONS
        }
        return CacheConfig(load_factor=cached or None, **options)

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        feature_requires_grad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled rows ``[B, sum of the features' dims]``, features side by side in order.

        Args:
            indices: int ``[nnz]``: each feature's ids, feature after feature.
            offsets: int ``[T * B + 1]``: where each bag starts, feature-major (FBGEMM's).
            per_sample_weights: float ``[nnz]`` or None.
            feature_requires_grad: accepted (FBGEMM's); every feature's rows train.
        """
        del feature_requires_grad
        T = len(self.features)
        if (offsets.numel() - 1) % T:
            raise ValueError(
                f"offsets has {offsets.numel()} entries; expected T * B + 1 with T = {T} features"
            )
        weights = per_sample_weights
        if weights is None:
            weights = torch.ones(indices.numel(), device=indices.device)
        batch = JaggedBatch.from_offsets(self.features, indices.long(), offsets.long(), weights)
        values = self.collection(batch).values()
        return values if self._columns is None else values.index_select(1, self._columns)

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Every table's weights ``[num_embeddings, dim]`` (copies, float32, after a flush),
        as FBGEMM's method lists them."""
        return [self.collection.table_rows(t.name)[:, : t.dim] for t in self.collection.tables]

    def load_split_embedding_weights(self, weights: Sequence[torch.Tensor]) -> None:
        """Overwrite every table's weights (``[num_embeddings, dim]`` each, in table order;
        FBGEMM's ``split_embedding_weights()`` for one), optimizer state kept."""
        tables = self.collection.tables
        if len(weights) != len(tables):
            raise ValueError(f"{len(weights)} weight tensors for {len(tables)} tables")
        state = {
            f"embedding_bags.{t.name}.weight": w.detach()
            for t, w in zip(tables, weights, strict=True)
        }
        self.collection.load_state_dict(state)

    def flush(self) -> None:
        """Write every dirty cached row back to the tier (FBGEMM's ``flush``)."""
        self.collection.flush()
