"""What the longer DMP tests share (`test_dmp_pipeline.py`, `test_dmp_resume.py`,
`test_dmp_four_ranks.py`): a DMP over the cached collection of `tests/dmp/test_dmp.py`'s tables
with a sharding type per table, its batches as torchrec's ``Batch`` (what torchrec's train
pipelines move), and the plain loop those tests compare against.

The scheduler is `test_dmp.py`'s (StepLR(3, 0.5) on ``model.fused_optimizer``, stepped after
each ``step()``), so `tests.dmp.test_dmp._reference` is the one-process reference of any run
here."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch

import embcache
from tests.dmp.test_dmp import (
    FEATURES,
    ROWS,
    TABLES,
    Scenario,
    _local_shards,
    _opt_shards,
    batch,
    fused_params,
    kjt_of,
)


class PipelinedModel(nn.Module):
    """The cached collection as torchrec's pipelines call a model: ``batch -> (loss,
    output)``, the sparse module's input a ``getattr`` of the batch (so the pipeline runs its
    input dist ahead). The loss is `tests.dmp.test_dmp.loss_of`'s, written out (the
    pipeline traces this forward with torch.fx)."""

    def __init__(self, torchrec_ebc: bool = False) -> None:
        super().__init__()
        self.cached = (
            embcache.CachedEmbeddingBagCollection(TABLES) if not torchrec_ebc else _torchrec_ebc()
        )

    def forward(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.cached(b.sparse_features).values()
        loss = (values * values).sum() + values[:, ::3].sum()
        return loss, values.detach()


def _torchrec_ebc() -> nn.Module:
    from torchrec import EmbeddingBagCollection

    return EmbeddingBagCollection(TABLES)


def batches(rank: int, steps: Iterable[int]) -> list[Batch]:
    """This rank's part of each step's global batch (`tests.dmp.test_dmp.batch`)."""
    out = []
    for step in steps:
        kjt = kjt_of([batch(step, rank, FEATURES, ROWS)], FEATURES)
        stride = kjt.stride()
        out.append(Batch(torch.zeros(stride, 1), kjt, torch.zeros(stride)))
    return out


def build_dmp(
    world_size: int,
    sharding: Mapping[str, str],
    optimizer: str = "adagrad",
    seed: int = 0,
    store: str | None = None,
    fused_like: Any = None,
) -> Any:
    """`PipelinedModel` under DMP, table ``t`` sharded ``sharding[t]`` on embcache's kernel
    (a tenth of each shard cached on ``store``, None: the host tier) or, given ``fused_like``
    (such a DMP), torchrec's ``EmbeddingBagCollection`` sharded by torchrec's sharder on its
    FUSED kernel with the same fused optimizer and the same shards as that DMP's (torchrec's
    sharder offers no row-wise shards on a CPU to its planner, but trains them). Shards draw
    their rows from ``torch.manual_seed(seed)``."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        ShardingEnv,
        ShardingPlan,
    )

    from embcache.torchrec import (
        CachedEmbeddingBagCollectionSharder,
        CachedEmbeddingShardingPlanner,
        CachedParameterConstraints,
    )

    torch.manual_seed(seed)
    pg = torch.distributed.group.WORLD
    params = fused_params(Scenario("", "", optimizer))
    if fused_like is not None:
        model = PipelinedModel(torchrec_ebc=True)
        sharders: list[Any] = [EmbeddingBagCollectionSharder(params)]
        plan = ShardingPlan(
            {
                name: EmbeddingModuleShardingPlan(
                    {
                        t: dataclasses.replace(p, compute_kernel="fused")
                        for t, p in module_plan.items()
                    }
                )
                for name, module_plan in fused_like.plan.plan.items()
            }
        )
    else:
        model = PipelinedModel()
        constraints = {
            t: CachedParameterConstraints(sharding_types=[s], cache_load_factor=0.1, store=store)
            for t, s in sharding.items()
        }
        sharders = [CachedEmbeddingBagCollectionSharder(params, constraints=constraints)]
        topology = Topology(world_size=world_size, compute_device="cpu")
        planner = CachedEmbeddingShardingPlanner(topology, constraints)
        plan = planner.collective_plan(model, sharders, pg)
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(pg),
        device=torch.device("cpu"),
        sharders=sharders,
        plan=plan,
    )


def schedule_of(dmp: Any) -> torch.optim.lr_scheduler.StepLR:
    """`tests.dmp.test_dmp`'s schedule (`lr_at`) on the DMP's fused optimizer."""
    return torch.optim.lr_scheduler.StepLR(dmp.fused_optimizer, step_size=3, gamma=0.5)


def train_plainly(
    dmp: Any, data: list[Batch], schedule: Any = None, zero_grad: bool = False
) -> list[torch.Tensor]:
    """The loop torchrec users write without a pipeline; each step's output. ``zero_grad``:
    call it first, as torchrec's pipelines do (it hands the scheduled rate to the rows one
    backward earlier than ``step()`` would: `tests.dmp.test_dmp.lr_at` is the rate without)."""
    outputs = []
    for b in data:
        if zero_grad:
            dmp.fused_optimizer.zero_grad()
        loss, values = dmp(b)
        outputs.append(values.clone())
        loss.backward()
        dmp.fused_optimizer.step()
        if schedule is not None:
            schedule.step()
    return outputs


def snapshot(dmp: Any) -> dict[str, Any]:
    """This rank's shards of the tables and of the fused optimizer's state (`_local_shards`
    form, ``cached.embedding_bags.<t>.weight`` keys as `tests.dmp.test_dmp` reads them)."""
    return {
        "tables": _local_shards(dmp.state_dict()),
        "opt_state": _opt_shards(dmp.fused_optimizer.state_dict()["state"]),
    }


def tiers(dmp: Any) -> list[str]:
    """The tier classes this rank's cached shards run on (``HostKV``, ``RedisKV``)."""
    from embcache.torchrec import ShardedCachedEmbeddingBagCollection

    return sorted(
        {
            type(k.collection.store).__name__
            for m in dmp.modules()
            if isinstance(m, ShardedCachedEmbeddingBagCollection)
            for k in m.cached_kernels()
        }
    )
