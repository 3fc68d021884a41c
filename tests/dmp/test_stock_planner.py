"""torchrec's own ``EmbeddingShardingPlanner`` (default estimators, torchrec's
``ParameterConstraints``) over embcache's cached collections: it plans them table-wise and
row-wise on the kernel the cache stands in for (``fused`` on a CPU, ``fused_uvm_caching`` on
CUDA), a plan's ``cache_params.load_factor`` counts in its estimate and sizes the caches, and
DMP with such a plan trains like one process (2 gloo ranks, the scheme and checks of
`tests/dmp/test_dmp.py` and `test_dmp_sequence.py`). torchrec's own collection under
`CachingEmbeddingBagCollectionSharder` is planned on torchrec's kernels (the cache there needs
embcache's planner), and a sharder asked to cache a table such a plan left off refuses it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import CacheParams

import embcache
from embcache.distributed.launch import spawn
from embcache.torchrec import (
    CACHED_KERNEL,
    CachedEmbeddingBagCollectionSharder,
    CachedEmbeddingCollectionSharder,
    CachedParameterConstraints,
    CachingEmbeddingBagCollectionSharder,
)
from tests.dmp import test_dmp_sequence
from tests.dmp.test_dmp import Scenario, _worker, check_against_one_process
from tests.dmp.test_planner import TABLES
from tests.dmp.test_planner import Model as BagModel

SHARDINGS = ["table_wise", "row_wise"]
STAND_IN = {"cpu": "fused", "cuda": "fused_uvm_caching"}


class SequenceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingConfig(
                name=t.name,
                embedding_dim=t.embedding_dim,
                num_embeddings=t.num_embeddings,
                feature_names=t.feature_names,
            )
            for t in TABLES
        ]
        self.cached = embcache.CachedEmbeddingCollection(tables, device="meta")


MODELS = {
    "bags": (BagModel, CachedEmbeddingBagCollectionSharder),
    "sequence": (SequenceModel, CachedEmbeddingCollectionSharder),
}


def stock_plan(
    kind: str, device: str, constraints: dict | None
) -> tuple[dict, EmbeddingShardingPlanner]:
    model_cls, sharder_cls = MODELS[kind]
    planner = EmbeddingShardingPlanner(
        Topology(world_size=2, compute_device=device), constraints=constraints
    )
    plan = planner.plan(model_cls(), [sharder_cls()])
    return plan.get_plan_for_module("cached"), planner


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("sharding_type", SHARDINGS)
@pytest.mark.parametrize("kind", list(MODELS))
def test_stock_planner_plans_the_cached_collections(
    kind: str, sharding_type: str, device: str
) -> None:
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[sharding_type], cache_params=CacheParams(load_factor=0.1)
        )
        for t in TABLES
    }
    plan, _ = stock_plan(kind, device, constraints)
    assert set(plan) == {"t0", "t1"}
    for p in plan.values():
        assert (p.sharding_type, p.compute_kernel) == (sharding_type, STAND_IN[device])
        assert p.cache_params is not None and p.cache_params.load_factor == 0.1
    assert {r for p in plan.values() for r in p.ranks} == {0, 1}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_stock_planner_needs_no_constraints(kind: str, device: str) -> None:
    plan, _ = stock_plan(kind, device, None)
    assert {p.compute_kernel for p in plan.values()} == {STAND_IN[device]}


def test_stock_cuda_estimate_counts_the_load_factor() -> None:
    """On CUDA torchrec's estimate of ``fused_uvm_caching`` holds a device cache of the load
    factor (plus I/O buffers) and the whole shard in host memory, as embcache's cache over a
    host tier: doubling the load factor adds the extra cache rows to HBM only."""
    found = {}
    for lf in (0.05, 0.1):
        constraints = {
            t.name: ParameterConstraints(
                sharding_types=["row_wise"], cache_params=CacheParams(load_factor=lf)
            )
            for t in TABLES
        }
        _, planner = stock_plan("bags", "cuda", constraints)
        found[lf] = {o.name: o.shards for o in planner._best_plan}
    for name, shards in found[0.1].items():
        for small, large in zip(found[0.05][name], shards, strict=True):
            whole = large.size[0] * large.size[1] * 4  # float32 weights, SGD: no state
            assert large.storage.hbm < whole / 2
            assert large.storage.ddr == small.storage.ddr >= whole
            # the extra rows and FBGEMM's cache bookkeeping for them (a quarter more here)
            extra = large.storage.hbm - small.storage.hbm
            assert 0.05 * whole <= extra < 0.1 * whole, (name, extra)


def test_caching_sharder_under_the_stock_planner_plans_torchrec_kernels() -> None:
    """torchrec's own collection: no CUSTOMIZED_KERNEL is offered to torchrec's planner, so
    it plans every table on torchrec's kernels; the sharder, told to cache a table, refuses
    that plan and names the planner that caches it."""

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(TABLES, device=torch.device("meta"))

    planner = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu"))
    plan = planner.plan(Plain(), [CachingEmbeddingBagCollectionSharder()])
    params = plan.get_plan_for_module("ebc")
    assert CACHED_KERNEL not in {p.compute_kernel for p in params.values()}
    told = CachingEmbeddingBagCollectionSharder(
        constraints={"t0": CachedParameterConstraints(cache_load_factor=0.1)}
    )
    with pytest.raises(ValueError, match="CachedEmbeddingShardingPlanner"):
        told.shard(Plain().ebc, params, env=None)


# Two ranks, planned by torchrec's planner, the caches sized by the plan's cache_params
# (a tenth of each shard, which `check_against_one_process` counts in slots).
SCENARIOS = [
    Scenario("stock_table_wise_adagrad", "table_wise", "adagrad", planner="torchrec"),
    Scenario(
        "stock_row_wise_rowwise_adagrad",
        "row_wise",
        "rowwise",
        checkpoint=True,
        planner="torchrec",
    ),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    where = str(tmp_path_factory.mktemp("dcp"))
    return spawn(_worker, 2, args=(2, SCENARIOS, where), timeout=120)


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_dmp_with_a_stock_plan_trains_like_one_process(two_ranks: list[dict], sc: Scenario) -> None:
    check_against_one_process(two_ranks, sc)


@pytest.fixture(scope="module")
def two_sequence_ranks() -> list[dict]:
    return spawn(test_dmp_sequence._worker, 2, args=(2, "torchrec"), timeout=120)


@pytest.mark.parametrize("sharding", test_dmp_sequence.SHARDINGS)
def test_sequence_dmp_with_a_stock_plan_trains_like_one_process(
    two_sequence_ranks: list[dict], sharding: str
) -> None:
    test_dmp_sequence.check_against_one_process(two_sequence_ranks, sharding, "fused")
