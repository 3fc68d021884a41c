"""One rank of `tests/dmp/test_dmp_torchrun_dlrm.py`, run by torchrun (gloo on CPU):

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        tests/dmp/dlrm_worker.py OUT_DIR [STORE_URL]

torchrec's ``DLRM`` over an `embcache.CachedEmbeddingBagCollection` of two tables, sharded by
``DistributedModelParallel`` with `CachedEmbeddingBagCollectionSharder` (``t0`` row-wise,
``t1`` table-wise, a tenth of each shard cached on the host tier, or on ``STORE_URL``), the
dense part under DMP's DDP. The tables train with FBGEMM's exact AdaGrad (applied in
backward), the dense part with torch's Adagrad, combined as the README's recipe combines them;
20 steps of `batch` (this rank's part of each global batch). Writes ``OUT_DIR/rank{r}.pt``:
the initial and final tables, dense weights and optimizer states, each step's logits.

The module's constants and `batch` are what the test's one-process reference uses too.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

STEPS = 20
B = 8  # samples per rank and step
DIM = 8
DENSE_IN = 4
DENSE_LAYERS = [16, DIM]
OVER_LAYERS = [16, 1]
LR, EPS = 0.05, 1e-8  # the tables' AdaGrad
DENSE_LR = 0.05  # the dense part's Adagrad
FEATURES = ["f0", "f1"]
ROWS = {"f0": 200, "f1": 200}
TABLES = [
    EmbeddingBagConfig(
        name=f"t{i}",
        embedding_dim=DIM,
        num_embeddings=ROWS[f],
        feature_names=[f],
        pooling=PoolingType.SUM,
    )
    for i, f in enumerate(FEATURES)
]
SHARDING = {"t0": "row_wise", "t1": "table_wise"}
EBC = "sparse_arch.embedding_bag_collection"  # the collection's path in DLRM


def batch(step: int, rank: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """One rank's part of a step: dense features [B, DENSE_IN], per feature ``(lengths [B],
    values)`` (an empty bag, duplicate ids and each table's last row included), labels [B]."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"dlrm/{step}/{rank}".encode()))
    dense = torch.rand(B, DENSE_IN, generator=gen)
    parts = {}
    for i, f in enumerate(FEATURES):
        lengths = torch.randint(0, 4, (B,), generator=gen)
        lengths[0] = 0 if i == 0 else 3
        values = torch.randint(0, ROWS[f], (int(lengths.sum()),), generator=gen)
        if values.numel() >= 3:
            values[1], values[2] = values[0], ROWS[f] - 1
        parts[f] = (lengths, values)
    labels = torch.randint(0, 2, (B,), generator=gen).float()
    return dense, parts, labels


def kjt_of(parts_by_rank: list[dict]) -> KeyedJaggedTensor:
    """The ranks' parts as one batch (rank r's samples at r*B:(r+1)*B)."""
    lengths = [p[f][0] for f in FEATURES for p in parts_by_rank]
    values = [p[f][1] for f in FEATURES for p in parts_by_rank]
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(values), lengths=torch.cat(lengths))


def dlrm(ebc: torch.nn.Module) -> torch.nn.Module:
    from torchrec.models.dlrm import DLRM

    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=DENSE_LAYERS,
        over_arch_layer_sizes=OVER_LAYERS,
    )


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(logits.squeeze(1), labels)


def main(out_dir: str, store: str | None) -> None:
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import embcache
    from embcache.torchrec import (
        CachedEmbeddingBagCollectionSharder,
        CachedEmbeddingShardingPlanner,
        CachedParameterConstraints,
        ShardedCachedEmbeddingBagCollection,
    )
    from tests.dmp.test_dmp import _local_shards, _opt_shards

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    torch.manual_seed(0)
    model = dlrm(embcache.CachedEmbeddingBagCollection(TABLES))
    constraints = {
        t: CachedParameterConstraints(sharding_types=[s], cache_load_factor=0.1, store=store)
        for t, s in SHARDING.items()
    }
    sharder = CachedEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR, "eps": EPS},
        constraints=constraints,
    )
    planner = CachedEmbeddingShardingPlanner(
        Topology(world_size=world, compute_device="cpu"), constraints
    )
    plan = planner.collective_plan(model, [sharder], pg)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(pg),
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=plan,
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=DENSE_LR),
    )
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])
    initial = _local_shards(dmp.state_dict())
    outputs = []
    for step in range(STEPS):
        dense_x, parts, labels = batch(step, rank)
        logits = dmp(dense_x, kjt_of([parts]))
        outputs.append(logits.detach().clone())
        loss = loss_of(logits, labels)
        opt.zero_grad()
        loss.backward()  # the rows' AdaGrad runs here; DDP averages the dense gradients
        opt.step()
    (sharded,) = [m for m in dmp.modules() if isinstance(m, ShardedCachedEmbeddingBagCollection)]
    kernels = list(sharded.cached_kernels())
    module_plan = plan.get_plan_for_module(EBC)
    result = {
        "world": world,
        "plan": {t: (p.sharding_type, p.compute_kernel) for t, p in module_plan.items()},
        "shards": {t: len(p.sharding_spec.shards) for t, p in module_plan.items()},
        "dense_params": sorted(dense.params),
        "initial": initial,
        "outputs": outputs,
        "final": _local_shards(dmp.state_dict()),
        "opt_state": _opt_shards(dmp.fused_optimizer.state_dict()["state"]),
        "dense_state": {n: dense.state[p]["sum"].clone() for n, p in dense.params.items()},
        "evictions": sum(k.collection.cache_stats()["evictions"] for k in kernels),
        "slots": [
            (shard.name, shard.local_rows, k.collection.engines.engine_of(n).cache.num_slots)
            for k in kernels
            for shard, n in k.shards()
        ],
        "tiers": sorted({type(k.collection.store).__name__ for k in kernels}),
    }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
