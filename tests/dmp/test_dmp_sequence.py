"""DMP over embcache's `CachedEmbeddingCollection` (sequence embeddings, one row per id) with
`CachedEmbeddingCollectionSharder`, 2 gloo ranks, table-wise and row-wise, a tenth of each shard
cached, against one process (the scheme of `tests/dmp/test_dmp.py`: the reference starts
from the rows the sharded model drew and averages the ranks' losses)."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor

import embcache
from embcache.distributed.launch import spawn
from tests.dmp.test_dmp import _local_shards, _whole, batch, kjt_of

RTOL, ATOL = 1e-5, 1e-5
STEPS, LR = 5, 0.1
FEATURES = ["h0", "h1", "h2"]
ROWS = {"h0": 200, "h1": 200, "h2": 120}
TABLES = [
    EmbeddingConfig(name="s0", embedding_dim=8, num_embeddings=200, feature_names=["h0", "h1"]),
    EmbeddingConfig(name="s1", embedding_dim=8, num_embeddings=120, feature_names=["h2"]),
]
SHARDINGS = ["table_wise", "row_wise"]


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cached = embcache.CachedEmbeddingCollection(TABLES)

    def forward(self, kjt: KeyedJaggedTensor) -> dict:
        return {k: jt.values() for k, jt in self.cached(kjt).items()}


def loss_of(rows: dict) -> torch.Tensor:
    return sum((v * v).sum() + v[:, ::3].sum() for v in rows.values())


def _worker(rank: int, world_size: int, planner_name: str = "embcache") -> dict:
    """Each sharding on this rank; ``planner_name``: "embcache" (CachedEmbeddingShardingPlanner
    with CachedParameterConstraints) or "torchrec" (torchrec's planner, its cache_params)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams, ShardingEnv

    from embcache.torchrec import (
        CachedEmbeddingCollectionSharder,
        CachedEmbeddingShardingPlanner,
        CachedParameterConstraints,
        ShardedCachedEmbeddingCollection,
    )

    pg = torch.distributed.group.WORLD
    fused = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR, "eps": 1e-8}
    results = {}
    for sharding in SHARDINGS:
        topology = Topology(world_size=world_size, compute_device="cpu")
        if planner_name == "embcache":
            constraints = {
                t.name: CachedParameterConstraints(sharding_types=[sharding], cache_load_factor=0.1)
                for t in TABLES
            }
            planner = CachedEmbeddingShardingPlanner(topology, constraints)
        else:
            constraints = {
                t.name: ParameterConstraints(
                    sharding_types=[sharding], cache_params=CacheParams(load_factor=0.1)
                )
                for t in TABLES
            }
            planner = EmbeddingShardingPlanner(topology, constraints=constraints)
        sharder = CachedEmbeddingCollectionSharder(fused, constraints=constraints)
        model = Model()
        plan = planner.collective_plan(model, [sharder], pg)
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(pg),
            device=torch.device("cpu"),
            sharders=[sharder],
            plan=plan,
        )
        initial = _local_shards(dmp.state_dict())
        outputs = []
        for step in range(STEPS):
            rows = dmp(kjt_of([batch(step, rank, FEATURES, ROWS)], FEATURES))
            outputs.append({k: v.detach().clone() for k, v in rows.items()})
            loss_of(rows).backward()
        (sharded,) = [m for m in dmp.modules() if isinstance(m, ShardedCachedEmbeddingCollection)]
        results[sharding] = {
            "plan": {
                t: (p.sharding_type, p.compute_kernel)
                for t, p in plan.get_plan_for_module("cached").items()
            },
            "initial": initial,
            "final": _local_shards(dmp.state_dict()),
            "outputs": outputs,
            "evictions": sum(
                k.collection.cache_stats()["evictions"] for k in sharded.cached_kernels()
            ),
            "slots": {
                (shard.name, shard.local_rows): k.collection.engines.engine_of(n).cache.num_slots
                for k in sharded.cached_kernels()
                for shard, n in k.shards()
            },
        }
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_worker, 2, args=(2,), timeout=120)


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_sequence_dmp_trains_like_one_process(two_ranks: list[dict], sharding: str) -> None:
    check_against_one_process(two_ranks, sharding, "customized_kernel")


def check_against_one_process(two_ranks: list[dict], sharding: str, kernel: str) -> None:
    """Outputs and final tables of a sharding's run against one process; the plan named
    ``kernel`` and each shard cached a tenth of its rows."""
    runs = [r[sharding] for r in two_ranks]
    for t in TABLES:
        assert runs[0]["plan"][t.name] == (sharding, kernel)
    for run in runs:
        for (_, rows), slots in run["slots"].items():
            assert slots == -(-rows // 10), (rows, slots)
    ref = embcache.CachedEmbeddingCollection(
        TABLES, optimizer_type=torch.optim.Adagrad, optimizer_kwargs={"lr": LR, "eps": 1e-8}
    )
    shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in TABLES}
    ref.load_state_dict(
        {
            f"embeddings.{n}.weight": _whole(runs, f"cached.embeddings.{n}.weight", "initial", s)
            for n, s in shapes.items()
        }
    )
    worst = 0.0
    for step in range(STEPS):
        parts = [batch(step, r, FEATURES, ROWS) for r in range(len(runs))]
        rows = {k: jt.values() for k, jt in ref(kjt_of(parts, FEATURES)).items()}
        for key, values in rows.items():
            counts = [int(p[key][0].sum()) for p in parts]
            for rank, want in enumerate(values.split(counts)):
                got = runs[rank]["outputs"][step][key]
                torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL)
                if got.numel():
                    worst = max(worst, float((got - want.detach()).abs().max()))
        (loss_of(rows) / len(runs)).backward()
    for name, shape in shapes.items():
        got = _whole(runs, f"cached.embeddings.{name}.weight", "final", shape)
        want = ref.state_dict()[f"embeddings.{name}.weight"]
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        worst = max(worst, float((got - want).abs().max()))
        initial = _whole(runs, f"cached.embeddings.{name}.weight", "initial", shape)
        assert (got - initial).abs().max() > 1e-3, f"{name}: nothing trained"
    assert all(run["evictions"] > 0 for run in runs)
    print(f"sequence {sharding}: max |sharded - one process| = {worst:.3g}")
