"""torchrec's planner over embcache's cached collection (one process, no ranks): the plan puts
the tables on embcache's kernel, its storage estimate counts each shard's cache on the compute
device rather than the whole table, and bad constraint values are refused by field."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption

import embcache
from embcache.torchrec import (
    CACHED_KERNEL,
    CachedEmbeddingBagCollectionSharder,
    CachedEmbeddingShardingPlanner,
    CachedEnumerator,
    CachedParameterConstraints,
    CachedPerfEstimator,
    CachingEmbeddingBagCollectionSharder,
)

ROWS, DIM = 40_000, 16
TABLES = [
    EmbeddingBagConfig(
        name="t0",
        embedding_dim=DIM,
        num_embeddings=ROWS,
        feature_names=["f0"],
        pooling=PoolingType.SUM,
    ),
    EmbeddingBagConfig(
        name="t1",
        embedding_dim=DIM,
        num_embeddings=ROWS // 2,
        feature_names=["f1"],
        pooling=PoolingType.MEAN,
    ),
]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # meta: shapes only, no row drawn (the planner reads shapes)
        self.cached = embcache.CachedEmbeddingBagCollection(TABLES, device="meta")


def plan_of(
    sharding_type: str, device: str, planner_cls: type = CachedEmbeddingShardingPlanner, **cache
) -> tuple[dict, list[ShardingOption]]:
    constraints = {
        t.name: CachedParameterConstraints(sharding_types=[sharding_type], **cache) for t in TABLES
    }
    planner = planner_cls(Topology(world_size=2, compute_device=device), constraints=constraints)
    sharder = CachedEmbeddingBagCollectionSharder(constraints=constraints)
    plan = planner.plan(Model(), [sharder])
    return plan.get_plan_for_module("cached"), planner._best_plan


def device_bytes(options: list[ShardingOption], device: str) -> dict[str, list[int]]:
    """Per table, the estimate of each shard on the compute device (DDR on a CPU)."""
    pick = (lambda s: s.ddr) if device == "cpu" else (lambda s: s.hbm)
    return {o.name: [pick(s.storage) for s in o.shards] for o in options}


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise"])
def test_plan_uses_the_cached_kernel(sharding_type: str) -> None:
    plan, _ = plan_of(sharding_type, "cpu", cache_load_factor=0.1)
    assert set(plan) == {"t0", "t1"}
    for p in plan.values():
        assert (p.sharding_type, p.compute_kernel) == (sharding_type, CACHED_KERNEL)
    ranks = sorted(r for p in plan.values() for r in p.ranks)
    assert set(ranks) == {0, 1}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_storage_estimate_follows_the_cache(sharding_type: str, device: str) -> None:
    """Doubling the load factor adds exactly each shard's extra cache rows (weights and
    Adagrad-free SGD state: 4 bytes a column) to the compute device's estimate; on CUDA the
    host tier is counted in DDR, whole, and does not move."""
    small = plan_of(sharding_type, device, cache_load_factor=0.05)[1]
    large = plan_of(sharding_type, device, cache_load_factor=0.1)[1]
    rows_per_shard = {o.name: [s.size[0] for s in o.shards] for o in small}
    got_small, got_large = device_bytes(small, device), device_bytes(large, device)
    for name, rows in rows_per_shard.items():
        for i, r in enumerate(rows):
            extra = (-(-r // 10) - -(-r // 20)) * DIM * 4
            assert got_large[name][i] - got_small[name][i] == extra, (name, i)
    if device == "cuda":  # the device holds the cache (and I/O buffers), not the shard
        for o in large:
            for s in o.shards:
                whole = s.size[0] * s.size[1] * 4
                assert s.storage.hbm < whole / 2
                assert s.storage.ddr == whole  # the host tier


class TorchrecStoragePlanner(EmbeddingShardingPlanner):
    """torchrec's planner with torchrec's storage estimator (and embcache's enumerator, which
    plans `CACHED_KERNEL`, and perf estimator: torchrec's own refuses a kernel it does not
    know)."""

    def __init__(self, topology: Topology, constraints: dict) -> None:
        enumerator = CachedEnumerator(
            topology=topology,
            batch_size=BATCH_SIZE,
            constraints=constraints,
            estimator=[
                CachedPerfEstimator(topology=topology, constraints=constraints),
                EmbeddingStorageEstimator(topology=topology, constraints=constraints),
            ],
        )
        super().__init__(topology=topology, constraints=constraints, enumerator=enumerator)


def test_torchrec_storage_estimator_counts_the_whole_table() -> None:
    """torchrec's storage estimator counts a CUSTOMIZED_KERNEL table whole on the device: what
    `CachedStorageEstimator` corrects."""
    ours = device_bytes(plan_of("row_wise", "cuda", cache_load_factor=0.1)[1], "cuda")
    theirs = device_bytes(
        plan_of("row_wise", "cuda", TorchrecStoragePlanner, cache_load_factor=0.1)[1], "cuda"
    )
    for name in ours:
        for mine, torchrec in zip(ours[name], theirs[name], strict=True):
            assert mine < torchrec / 2


def test_a_redis_tier_is_not_counted_on_the_host() -> None:
    (option, *_) = plan_of(
        "table_wise", "cuda", cache_load_factor=0.1, store="redis://127.0.0.1:1/0"
    )[1]
    assert all(s.storage.ddr == 0 for s in option.shards)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cache_load_factor": 0.0}, "cache_load_factor"),
        ({"cache_load_factor": 1.5}, "cache_load_factor"),
        ({"cache_load_factor": "0.1"}, "cache_load_factor"),
        ({"cache_rows": 0}, "cache_rows"),
        ({"cache_rows": 2.5}, "cache_rows"),
        ({"cache_rows": 10, "cache_load_factor": 0.1}, "cache_load_factor or cache_rows"),
        ({"cache_policy": "fifo"}, "cache_policy"),
        ({"cache_ways": 0}, "cache_ways"),
        ({"store": 6379}, "store"),
        ({"compute_kernels": ["fused"]}, "compute_kernels"),
    ],
    ids=[
        "lf_zero",
        "lf_above_one",
        "lf_str",
        "rows_zero",
        "rows_float",
        "both",
        "policy",
        "ways",
        "store",
        "kernel",
    ],
)
def test_bad_constraints_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CachedParameterConstraints(**kwargs)


def test_constraints_default_to_the_cached_kernel() -> None:
    c = CachedParameterConstraints(cache_load_factor=0.25, cache_policy="LFU")
    assert c.compute_kernels == [CACHED_KERNEL]
    assert c.cache_policy == "lfu"
    assert c.cache_params is not None and c.cache_params.load_factor == 0.25


def test_sharder_shapes() -> None:
    sharder = CachedEmbeddingBagCollectionSharder()
    assert sharder.module_type is embcache.CachedEmbeddingBagCollection
    # torchrec's planner sees the kernel the cache stands in for, embcache's sees its own
    assert sharder.compute_kernels("row_wise", "cpu") == ["fused"]
    assert sharder.compute_kernels("row_wise", "cuda") == ["fused_uvm_caching"]
    assert sharder.naming_cached_kernel().compute_kernels("row_wise", "cpu") == [CACHED_KERNEL]
    assert "row_wise" in sharder.sharding_types("cpu")
    params = sharder.shardable_parameters(Model().cached)
    assert {k: tuple(v.shape) for k, v in params.items()} == {
        "t0": (ROWS, DIM),
        "t1": (ROWS // 2, DIM),
    }
    with pytest.raises(TypeError, match="cache"):
        CachedEmbeddingBagCollectionSharder(cache={"load_factor": 0.1})


def test_unshardable_tables_are_named() -> None:
    maxed = embcache.CachedEmbeddingBagCollection(
        [{"name": "m", "embedding_dim": 4, "num_embeddings": 10, "pooling": "max"}],
        device="meta",
    )
    with pytest.raises(ValueError, match="'m' pools by"):
        CachedEmbeddingBagCollectionSharder().shardable_parameters(maxed)


def test_fused_params_name_an_unknown_optimizer() -> None:
    from embcache.torchrec.kernel import fused_optimizer_of

    with pytest.raises(ValueError, match=r"fused_params\['optimizer'\]"):
        fused_optimizer_of({"optimizer": "lamb"})
    cls, kwargs = fused_optimizer_of(
        {"optimizer": "exact_adagrad", "learning_rate": 0.3, "eps": 1e-6, "cache_load_factor": 0.2}
    )
    assert cls is torch.optim.Adagrad and kwargs == {"learning_rate": 0.3, "eps": 1e-6}


def test_caching_sharder_caches_only_the_tables_named() -> None:
    """torchrec's own collection under `CachingEmbeddingBagCollectionSharder`: the table with
    `CachedParameterConstraints` goes to embcache's kernel, the others stay on torchrec's."""
    from torchrec import EmbeddingBagCollection

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(TABLES, device=torch.device("meta"))

    constraints = {
        "t0": CachedParameterConstraints(sharding_types=["row_wise"], cache_load_factor=0.1),
        "t1": ParameterConstraints(sharding_types=["row_wise"]),
    }
    sharder = CachingEmbeddingBagCollectionSharder(constraints=constraints)
    assert CACHED_KERNEL not in sharder.compute_kernels("row_wise", "cpu")
    assert CACHED_KERNEL in sharder.naming_cached_kernel().compute_kernels("row_wise", "cpu")
    planner = CachedEmbeddingShardingPlanner(
        Topology(world_size=2, compute_device="cpu"), constraints=constraints
    )
    plan = planner.plan(Plain(), [sharder]).get_plan_for_module("ebc")
    assert plan["t0"].compute_kernel == CACHED_KERNEL
    assert plan["t1"].compute_kernel != CACHED_KERNEL
    assert {p.sharding_type for p in plan.values()} == {"row_wise"}
