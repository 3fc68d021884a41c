"""What the planner and the sharders know of a cached table: `CachedParameterConstraints`
(torchrec's ``ParameterConstraints`` plus the cache's options), the options one shard's cache
gets (`ShardCacheOptions`, resolved by `shard_cache_options`), and a storage estimator that
counts the cache, not the whole table, on the compute device (`CachedStorageEstimator`, which
`CachedEmbeddingShardingPlanner` uses by default).

Which kernel a plan names: torchrec's own planner knows no ``CUSTOMIZED_KERNEL`` (its perf
estimator refuses it), so to that planner a sharder of embcache's collections
(`CachedKernelSharder`) names the kernel the cache stands in for (`stand_in_kernel`: FBGEMM's
``fused`` on a CPU, ``fused_uvm_caching`` on CUDA, whose storage estimate counts a device cache
of ``cache_params.load_factor`` over the whole table in host memory), and the sharded module runs
the tables on the cache whatever the plan names (`on_cached_kernel`). `CachedEnumerator` (in
`CachedEmbeddingShardingPlanner`) plans with the sharders naming `CACHED_KERNEL`, so that its
estimators count the cache as embcache sizes it.

Where a shard's options come from, first match wins: the sharder's ``constraints`` for the
table (a `CachedParameterConstraints`); the plan's ``cache_params`` (``load_factor`` and
``algorithm``: the planner copies them from the constraints, so a plan made elsewhere carries
them too); the sharder's ``cache`` and ``store``; the unsharded collection's own ``CacheConfig``
(a `CachedEmbeddingBagCollection`); else every row of the shard is cached.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
    _calculate_storage_specific_sizes,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.distributed.types import (
    CacheAlgorithm,
    CacheParams,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
)

from embcache.cache.config import CacheConfig
from embcache.cache.policy_registry import policy_name

CACHED_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
# The policies torchrec's plans can name (`CacheParams.algorithm`); a plan of another
# registered policy carries no algorithm.
_ALGORITHMS = {"lru": CacheAlgorithm.LRU, "lfu": CacheAlgorithm.LFU}


def stand_in_kernel(compute_device_type: str) -> str:
    """The torchrec kernel embcache's cache stands in for on a compute device: FBGEMM's cached
    kernel (``fused_uvm_caching``: a device cache over the table in host memory) on CUDA, its
    fused one on a CPU (where the cache and its tier share the host's memory)."""
    kernel = (
        EmbeddingComputeKernel.FUSED_UVM_CACHING
        if compute_device_type == "cuda"
        else EmbeddingComputeKernel.FUSED
    )
    return kernel.value


def on_cached_kernel(params: Mapping[str, ParameterSharding]) -> EmbeddingModuleShardingPlan:
    """A copy of an embcache collection's plan with every table on `CACHED_KERNEL`, whatever
    kernel the planner named (torchrec's planner names `stand_in_kernel`)."""
    return EmbeddingModuleShardingPlan(
        {n: dataclasses.replace(p, compute_kernel=CACHED_KERNEL) for n, p in params.items()}
    )


class CachedKernelSharder:
    """A sharder of tables on embcache's cache, mixed into the sharders of
    `embcache.torchrec`: its ``compute_kernels`` name `CACHED_KERNEL` when
    ``names_cached_kernel`` (the twin `CachedEnumerator` plans with) and otherwise only kernels
    torchrec's own planner can cost."""

    names_cached_kernel: bool = False

    def __init__(
        self,
        fused_params: dict[str, Any] | None = None,
        constraints: Mapping[str, Any] | None = None,
        cache: CacheConfig | None = None,
        store: str | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> None:
        """The arguments every sharder of `embcache.torchrec` takes (see
        `CachedEmbeddingBagCollectionSharder`); ``fused_params`` and
        ``qcomm_codecs_registry`` go to torchrec's sharder."""
        super().__init__(  # type: ignore[call-arg]
            fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry
        )
        if cache is not None and not isinstance(cache, CacheConfig):
            raise TypeError(
                f"cache must be an embcache.CacheConfig or None, got {type(cache).__name__}"
            )
        self._constraints = dict(constraints or {})
        self._cache = cache
        self._store = store

    def cache_options(
        self, cache: CacheConfig | None, table: str, local_rows: int, fused: dict[str, Any] | None
    ) -> ShardCacheOptions:
        """The cache of one shard of ``table`` (`shard_cache_options`), ``cache`` standing for
        the tables without constraints of their own."""
        return shard_cache_options(table, local_rows, fused, self._constraints, cache, self._store)

    def naming_cached_kernel(self) -> Self:
        """A shallow copy whose ``compute_kernels`` name `CACHED_KERNEL`."""
        twin = copy.copy(self)
        twin.names_cached_kernel = True
        return twin


# Optimizer state columns per weight column (row-wise AdaGrad: one per row), by the fused
# optimizer's name as torchrec's fused_params give it (``EmbOptimType`` or its value).
_STATE_COLUMNS = {"exact_sgd": 0.0, "sgd": 0.0, "exact_adagrad": 1.0, "adagrad": 1.0, "adam": 2.0}


@dataclass
class CachedParameterConstraints(ParameterConstraints):
    """torchrec's ``ParameterConstraints`` for a table trained through embcache's cache.

    Give it to `CachedEmbeddingShardingPlanner` (whose storage estimate counts the cache) and
    to the sharder (``CachedEmbeddingBagCollectionSharder(constraints=...)``): the planner
    places the table with embcache's kernel (``compute_kernels`` defaults to torchrec's
    ``CUSTOMIZED_KERNEL``) and the sharder builds each shard's cache from these fields.
    torchrec's own ``EmbeddingShardingPlanner`` plans no ``CUSTOMIZED_KERNEL``: with it, give
    the planner torchrec's ``ParameterConstraints`` (``cache_params=CacheParams(load_factor=
    ...)`` sizes the caches) and these to the sharder only.

    Attributes:
        cache_load_factor: fraction of each shard's rows its cache holds (0 < f <= 1).
        cache_rows: rows each shard's cache holds (>= 1); exclusive with ``cache_load_factor``.
            Neither: the whole shard is cached.
        cache_policy: the eviction policy's name (``"lru"``, ``"lfu"``, or another registered
            in `embcache.cache.policy_registry`).
        cache_ways: associativity of the cache (slots per set, >= 1).
        store: the tier behind each shard's cache: None for a host tier in the rank's memory
            (`embcache.kv.HostKV`), or a URL (``"redis://host:port/db"``).
    """

    cache_load_factor: float | None = None
    cache_rows: int | None = None
    cache_policy: str = "lru"
    cache_ways: int = 32
    store: str | None = None

    def __post_init__(self) -> None:
        lf, rows = self.cache_load_factor, self.cache_rows
        if lf is not None and rows is not None:
            raise ValueError(
                "CachedParameterConstraints: give cache_load_factor or cache_rows, not both "
                f"(got {lf!r} and {rows!r})"
            )
        if lf is not None and (
            isinstance(lf, bool) or not isinstance(lf, int | float) or not 0 < lf <= 1
        ):
            raise ValueError(
                f"CachedParameterConstraints.cache_load_factor must be a number in (0, 1], "
                f"got {lf!r}"
            )
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(
                f"CachedParameterConstraints.cache_rows must be an int >= 1, got {rows!r}"
            )
        self.cache_policy = policy_name(
            self.cache_policy, "CachedParameterConstraints.cache_policy"
        )
        ways = self.cache_ways
        if isinstance(ways, bool) or not isinstance(ways, int) or ways < 1:
            raise ValueError(
                f"CachedParameterConstraints.cache_ways must be an int >= 1, got {ways!r}"
            )
        if self.store is not None and not isinstance(self.store, str):
            raise ValueError(
                "CachedParameterConstraints.store must be None (a host tier) or a URL string, "
                f"got {type(self.store).__name__}"
            )
        # torchrec ships no types: mypy cannot type the inherited fields
        kernels: Any = self.compute_kernels  # type: ignore[has-type]
        if kernels is None:
            self.compute_kernels = [CACHED_KERNEL]
        elif kernels != [CACHED_KERNEL]:
            raise ValueError(
                "CachedParameterConstraints.compute_kernels must be None or "
                f"[{CACHED_KERNEL!r}] (embcache's cache), got {kernels!r}"
            )
        cache_params: Any = self.cache_params  # type: ignore[has-type]
        if cache_params is None:
            self.cache_params = CacheParams(
                algorithm=_ALGORITHMS.get(self.cache_policy), load_factor=lf
            )

    def __hash__(self) -> int:
        return hash(
            (
                super().__hash__(),
                self.cache_load_factor,
                self.cache_rows,
                self.cache_policy,
                self.cache_ways,
                self.store,
            )
        )


@dataclass(frozen=True)
class ShardCacheOptions:
    """The cache and tier of one shard (``rows`` is None: every row of the shard)."""

    rows: int | None
    policy: str = "lru"
    ways: int = 32
    store: str | None = None


def shard_cache_options(
    table: str,
    local_rows: int,
    fused_params: Mapping[str, Any] | None,
    constraints: Mapping[str, ParameterConstraints] | None,
    default_cache: CacheConfig | None,
    default_store: str | None,
) -> ShardCacheOptions:
    """The cache of one shard of ``table`` (``local_rows`` rows), from the sources the module
    docstring lists, in that order."""
    c = (constraints or {}).get(table)
    if isinstance(c, CachedParameterConstraints):
        rows = c.cache_rows
        if c.cache_load_factor is not None:
            rows = _rows_of(c.cache_load_factor, local_rows)
        return ShardCacheOptions(rows, c.cache_policy, c.cache_ways, c.store)
    fused = fused_params or {}
    store = default_store
    if "cache_load_factor" in fused:
        algorithm = fused.get("cache_algorithm", CacheAlgorithm.LRU)
        policy = "lfu" if algorithm == CacheAlgorithm.LFU else "lru"
        ways = default_cache.ways if default_cache is not None else 32
        return ShardCacheOptions(
            _rows_of(float(fused["cache_load_factor"]), local_rows), policy, ways, store
        )
    if default_cache is None:
        return ShardCacheOptions(None, store=store)
    rows = _config_rows(default_cache, table, local_rows)
    policy = str(default_cache.policy)
    return ShardCacheOptions(rows, policy, default_cache.ways, store)


def _rows_of(load_factor: float, local_rows: int) -> int:
    return max(1, math.ceil(load_factor * local_rows))


def _config_rows(cache: CacheConfig, table: str, local_rows: int) -> int | None:
    """A `CacheConfig`'s rows for one shard: a capacity per rank as given, a load factor of
    the shard's rows (a per-table dict read at ``table``)."""
    lf, cap = cache.load_factor, cache.capacity
    if isinstance(lf, Mapping):
        lf = lf.get(table)
    if isinstance(cap, Mapping):
        cap = cap.get(table)
    if lf is not None:
        return _rows_of(float(lf), local_rows)
    return int(cap) if cap is not None else None


# -- the planner ------------------------------------------------------------------------------


class CachedPerfEstimator(EmbeddingPerfEstimator):
    """torchrec's perf estimator, which knows no ``CUSTOMIZED_KERNEL``: a table on embcache's
    kernel is costed as torchrec costs the kernel it stands for, FBGEMM's cached kernel
    (``fused_uvm_caching``, at the table's load factor) on CUDA and its fused one on a CPU."""

    def estimate(
        self, sharding_options: list[ShardingOption], sharder_data_map: Any = None
    ) -> None:
        ours = [o for o in sharding_options if o.compute_kernel == CACHED_KERNEL]
        stand_in = stand_in_kernel(self._topology.compute_device)
        for o in ours:
            o.compute_kernel = stand_in
        try:
            super().estimate(sharding_options, sharder_data_map)
        finally:
            for o in ours:
                o.compute_kernel = CACHED_KERNEL


class CachedStorageEstimator(EmbeddingStorageEstimator):
    """torchrec's storage estimator, except for tables on embcache's kernel: each shard counts
    its cache (rows times weights and optimizer state, at 4 bytes a value) on the compute
    device (HBM on CUDA, DDR on a CPU) and, with a host tier, the shard's whole rows in DDR
    (a Redis tier lives elsewhere and counts nothing); the input and output buffers are
    torchrec's estimate.

    The cache's rows come from the table's `CachedParameterConstraints` (or the plan's
    ``cache_params.load_factor``); none: the whole shard is cached.
    """

    def estimate(
        self, sharding_options: list[ShardingOption], sharder_data_map: Any = None
    ) -> None:
        super().estimate(sharding_options, sharder_data_map)
        for option in sharding_options:
            if option.compute_kernel != CACHED_KERNEL:
                continue
            constraint = (self._constraints or {}).get(option.name)
            fused = dict(_fused_params_of(sharder_data_map, option))
            if option.cache_load_factor is not None:
                fused["cache_load_factor"] = option.cache_load_factor
            state = _STATE_COLUMNS.get(str(fused.get("optimizer", "exact_sgd")).lower())
            tensor = option.tensor
            counted = _calculate_storage_specific_sizes(
                storage=tensor.element_size() * tensor.numel(),
                shape=tensor.shape,
                shard_sizes=[s.size for s in option.shards],
                sharding_type=option.sharding_type,
                optimizer_class=getattr(tensor, "_optimizer_classes", [None])[0],
            )
            device = self._topology.compute_device
            for shard, table_bytes in zip(option.shards, counted, strict=True):
                rows, cols = shard.size
                # row-wise AdaGrad (any optimizer not listed) keeps one value per row
                width = cols + (1.0 if state is None else state * cols)
                opts = shard_cache_options(
                    option.name,
                    rows,
                    fused,
                    {option.name: constraint} if constraint else None,
                    None,
                    None,
                )
                cached = rows if opts.rows is None else min(opts.rows, rows)
                cache_bytes = math.ceil(4 * width * cached)
                tier_bytes = math.ceil(4 * width * rows) if opts.store is None else 0
                # torchrec's estimate less the table it counted: the input/output buffers
                old = shard.storage or Storage(hbm=0, ddr=0)
                io = max(0, (old.ddr if device == "cpu" else old.hbm) - table_bytes)
                if device == "cpu":
                    shard.storage = Storage(hbm=0, ddr=io + cache_bytes + tier_bytes)
                else:
                    shard.storage = Storage(hbm=io + cache_bytes, ddr=tier_bytes)


def _fused_params_of(sharder_map: Any, option: ShardingOption) -> Mapping[str, Any]:
    data = sharder_map.get(option.module_type_key) if sharder_map else None
    return getattr(data, "fused_params", None) or {}


class CachedEnumerator(EmbeddingEnumerator):
    """torchrec's enumerator, with embcache's sharders naming `CACHED_KERNEL`
    (`CachedKernelSharder.naming_cached_kernel`), that keeps a table off embcache's kernel
    unless its constraints are `CachedParameterConstraints` (or the kernel is the table's only
    option): a sharder that offers both torchrec's kernels and the cache
    (`CachingEmbeddingBagCollectionSharder`) caches exactly the tables the constraints name."""

    def enumerate(self, module: Any, sharders: Any) -> list[ShardingOption]:
        sharders = [
            s.naming_cached_kernel() if isinstance(s, CachedKernelSharder) else s for s in sharders
        ]
        options = super().enumerate(module, sharders)
        constraints = self._constraints or {}
        others = {o.fqn for o in options if o.compute_kernel != CACHED_KERNEL}
        return [
            o
            for o in options
            if o.compute_kernel != CACHED_KERNEL
            or isinstance(constraints.get(o.name), CachedParameterConstraints)
            or o.fqn not in others
        ]


class CachedEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """torchrec's ``EmbeddingShardingPlanner`` planning embcache's kernel by name
    (`CachedEnumerator`) with embcache's estimators: the perf of a cached table as torchrec
    costs FBGEMM's cached kernel (`CachedPerfEstimator`; torchrec's own perf estimator refuses
    ``CUSTOMIZED_KERNEL``) and its storage as its cache (`CachedStorageEstimator`). Every
    argument is torchrec's; given an ``enumerator``, make it a `CachedEnumerator` with these
    estimators (torchrec's own enumerator plans the stand-in kernels, which they cost as
    torchrec does)."""

    def __init__(
        self,
        topology: Topology | None = None,
        constraints: dict[str, ParameterConstraints] | None = None,
        **kwargs: Any,
    ) -> None:
        if topology is not None and "enumerator" not in kwargs:
            kwargs["enumerator"] = CachedEnumerator(
                topology=topology,
                batch_size=kwargs.get("batch_size") or BATCH_SIZE,
                constraints=constraints,
                estimator=[
                    CachedPerfEstimator(topology=topology, constraints=constraints),
                    CachedStorageEstimator(topology=topology, constraints=constraints),
                ],
            )
        super().__init__(topology=topology, constraints=constraints, **kwargs)
