"""torchrec's DistributedModelParallel over embcache's cached collection (2 gloo ranks on CPU)
against one process.

Each scenario plans a small model with torchrec's planner (`CachedEmbeddingShardingPlanner`,
constraints forcing table-wise or row-wise shards of embcache's kernel, a tenth of each shard
cached on the host tier), wraps it in DMP with `CachedEmbeddingBagCollectionSharder` and trains
a few steps, every rank on its own part of each global batch. The reference is one process: a
`CachedEmbeddingBagCollection` (every row cached) with the rows the sharded model started from
(read back from its ``state_dict()``: DMP's shards draw their own), the same fused optimizer,
trained on the concatenated global batch with the mean of the ranks' losses (torchrec divides
the embeddings' gradients by the world size, as DDP averages the dense ones). Outputs, final
tables and ``fused_optimizer`` state must agree to 1e-5.

The mixed model holds a torchrec ``EmbeddingBagCollection`` (sharded by torchrec's own sharder
on its FUSED kernel) beside the cached collection, and a dense layer under DDP; its reference
trains an unsharded copy of both with the same rows.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import embcache
from embcache.distributed.launch import spawn

RTOL, ATOL = 1e-5, 1e-5
STEPS = 6
B = 4  # samples per rank and step
LR = 0.1
FEATURES = ["f0", "f1", "f2"]
TABLES = [
    EmbeddingBagConfig(
        name="t0",
        embedding_dim=8,
        num_embeddings=200,
        feature_names=["f0", "f1"],
        pooling=PoolingType.SUM,
    ),
    EmbeddingBagConfig(
        name="t1",
        embedding_dim=4,
        num_embeddings=150,
        feature_names=["f2"],
        pooling=PoolingType.MEAN,
    ),
]
ROWS = {"f0": 200, "f1": 200, "f2": 150}
MIXED_TABLES = [  # torchrec's own collection in the mixed model
    EmbeddingBagConfig(
        name="u0", embedding_dim=4, num_embeddings=60, feature_names=["g0"], pooling=PoolingType.SUM
    ),
]


@dataclass(frozen=True)
class Scenario:
    name: str
    sharding_type: str  # torchrec's ShardingType value
    optimizer: str  # "adagrad", "rowwise" (row-wise AdaGrad) or "sgd"
    mixed: bool = False
    checkpoint: bool = False  # a DCP save and load into a new model
    # torchrec's EmbeddingBagCollection holds the tables; the constraints cache t0 only
    torchrec_ebc: bool = False
    # "embcache": CachedEmbeddingShardingPlanner with CachedParameterConstraints; "torchrec":
    # torchrec's own EmbeddingShardingPlanner with its ParameterConstraints (cache_params)
    planner: str = "embcache"

    def cached(self, table: str) -> bool:
        return not (self.torchrec_ebc and table != "t0")

    def kernel(self, table: str) -> str:
        """The kernel the plan names (torchrec's planner: the one the cache stands in for)."""
        if not self.cached(table) or self.planner == "torchrec":
            return "fused"
        return "customized_kernel"


SCENARIOS = [
    Scenario("table_wise_adagrad", "table_wise", "adagrad"),
    Scenario("row_wise_adagrad", "row_wise", "adagrad", checkpoint=True),
    Scenario("row_wise_rowwise_adagrad", "row_wise", "rowwise"),
    Scenario("row_wise_sgd_mixed", "row_wise", "sgd", mixed=True),
    Scenario("column_wise_sgd", "column_wise", "sgd"),
    Scenario("torchrec_ebc_t0_cached", "row_wise", "adagrad", torchrec_ebc=True),
]


def batch(step: int, rank: int, features: list[str], rows: dict[str, int]) -> dict:
    """Per feature: lengths [B] and values of one rank's part of a step (empty bags, duplicate
    ids and each table's last row included)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{step}/{rank}".encode()))
    parts = {}
    for i, f in enumerate(features):
        lengths = torch.randint(0, 5, (B,), generator=gen)
        lengths[0] = 0 if i == 0 else 3
        values = torch.randint(0, rows[f], (int(lengths.sum()),), generator=gen)
        if values.numel() >= 3:
            values[1], values[2] = values[0], rows[f] - 1
        parts[f] = (lengths, values)
    return parts


def kjt_of(parts_by_rank: list[dict], features: list[str]) -> KeyedJaggedTensor:
    lengths = [p[f][0] for f in features for p in parts_by_rank]
    values = [p[f][1] for f in features for p in parts_by_rank]
    return KeyedJaggedTensor(keys=features, values=torch.cat(values), lengths=torch.cat(lengths))


def fused_params(sc: Scenario) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if sc.optimizer == "sgd":
        return {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    if sc.optimizer == "rowwise":
        return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8}
    return {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR, "eps": 1e-8}


def optimizer_of(sc: Scenario) -> tuple[type, dict]:
    if sc.optimizer == "sgd":
        return torch.optim.SGD, {"lr": LR}
    if sc.optimizer == "rowwise":
        from torchrec.optim import RowWiseAdagrad

        return RowWiseAdagrad, {"lr": LR, "eps": 1e-8}
    return torch.optim.Adagrad, {"lr": LR, "eps": 1e-8}


class Model(nn.Module):
    """Cached collection (and, mixed, torchrec's collection and a dense layer)."""

    def __init__(self, mixed: bool, torchrec_ebc: bool = False) -> None:
        super().__init__()
        self.cached = (
            EmbeddingBagCollection(TABLES)
            if torchrec_ebc
            else embcache.CachedEmbeddingBagCollection(TABLES)
        )
        self.mixed = mixed
        if mixed:
            self.plain = EmbeddingBagCollection(MIXED_TABLES)
            self.dense = nn.Linear(4, 3)

    def forward(self, kjt: KeyedJaggedTensor, plain_kjt: KeyedJaggedTensor | None = None):
        values = self.cached(kjt).values()
        if not self.mixed:
            return values
        return values, self.dense(self.plain(plain_kjt).values())


def loss_of(out) -> torch.Tensor:
    values, extra = (out, None) if isinstance(out, torch.Tensor) else out
    loss = (values * values).sum() + values[:, ::3].sum()
    if extra is not None:
        loss = loss + (extra * extra).sum() + extra[:, 0].sum()
    return loss


def _local_shards(state: dict) -> dict:
    """``{key: [(offsets, tensor)]}`` of this rank's shards of each ShardedTensor, plain
    tensors as one shard at the origin."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for k, v in state.items():
        if isinstance(v, ShardedTensor):
            out[k] = [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in v.local_shards()]
        elif isinstance(v, torch.Tensor):
            out[k] = [([0] * v.dim(), v.detach().clone())]
    return out


def _opt_shards(state: dict) -> dict:
    """``{param key: {state key: [(offsets, tensor)]}}`` of a fused optimizer's state."""
    return {k: _local_shards(s) for k, s in state.items()}


def _worker(
    rank: int,
    world_size: int,
    scenarios: list[Scenario],
    checkpoint_dir: str,
    store: str | None = None,
) -> dict:
    """Each scenario on this rank; ``store``: the cached tables' tier (None: the host)."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams, ShardingEnv

    from embcache.torchrec import (
        CachedEmbeddingBagCollectionSharder,
        CachedEmbeddingShardingPlanner,
        CachedParameterConstraints,
        CachingEmbeddingBagCollectionSharder,
        ShardedCachedEmbeddingBagCollection,
    )

    pg = torch.distributed.group.WORLD
    results = {}
    for sc in scenarios:
        torch.manual_seed(0)
        constraints = {
            t.name: CachedParameterConstraints(
                sharding_types=[sc.sharding_type],
                cache_load_factor=0.1,
                store=store,
                min_partition=4,  # column-wise: t0's 8 columns in two shards
            )
            if sc.planner == "embcache"
            # the same caches in torchrec's terms: the plan's cache_params size them
            else ParameterConstraints(
                sharding_types=[sc.sharding_type],
                cache_params=CacheParams(load_factor=0.1),
                min_partition=4,
            )
            for t in TABLES
        }
        sharders = [CachedEmbeddingBagCollectionSharder(fused_params(sc), constraints=constraints)]
        if sc.torchrec_ebc:
            constraints["t1"] = ParameterConstraints(sharding_types=[sc.sharding_type])
            sharders = [
                CachingEmbeddingBagCollectionSharder(fused_params(sc), constraints=constraints)
            ]
        if sc.mixed:
            constraints["u0"] = ParameterConstraints(
                sharding_types=["table_wise"], compute_kernels=["fused"]
            )
            sharders.append(EmbeddingBagCollectionSharder(fused_params(sc)))
        topology = Topology(world_size=world_size, compute_device="cpu")
        planner = (
            CachedEmbeddingShardingPlanner(topology, constraints)
            if sc.planner == "embcache"
            else EmbeddingShardingPlanner(topology, constraints=constraints)
        )
        model = Model(sc.mixed, sc.torchrec_ebc)
        plan = planner.collective_plan(model, sharders, pg)
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(pg),
            device=torch.device("cpu"),
            sharders=sharders,
            plan=plan,
        )
        dense_opt = None
        if sc.mixed:
            dense = [p for n, p in dmp.named_parameters() if "dense" in n]
            dense_opt = torch.optim.SGD(dense, lr=LR)
        initial_state = dmp.state_dict()
        initial = _local_shards(initial_state)
        # model.fused_optimizer drives the kernels' learning rate, as torchrec's FUSED kernel's
        schedule = torch.optim.lr_scheduler.StepLR(dmp.fused_optimizer, step_size=3, gamma=0.5)
        outputs = []
        for step in range(STEPS):
            parts = batch(step, rank, FEATURES, ROWS)
            kjt = kjt_of([parts], FEATURES)
            plain = kjt_of([batch(step + 100, rank, ["g0"], {"g0": 60})], ["g0"])
            out = dmp(kjt, plain) if sc.mixed else dmp(kjt)
            outputs.append([o.detach().clone() for o in (out if sc.mixed else (out,))])
            loss_of(out).backward()
            dmp.fused_optimizer.step()
            schedule.step()
            if dense_opt is not None:
                dense_opt.step()
                dense_opt.zero_grad()
        state = dmp.fused_optimizer.state_dict()["state"]
        final = _local_shards(dmp.state_dict())
        (sharded,) = [
            m for m in dmp.modules() if isinstance(m, ShardedCachedEmbeddingBagCollection)
        ]
        evictions = sum(k.collection.cache_stats()["evictions"] for k in sharded.cached_kernels())
        slots = {
            (shard.name, shard.local_rows): k.collection.engines.engine_of(n).cache.num_slots
            for k in sharded.cached_kernels()
            for shard, n in k.shards()
        }
        restored = None
        if sc.checkpoint:  # DCP round trip into a new model (its shards drew other rows)
            import torch.distributed.checkpoint as dcp

            where = f"{checkpoint_dir}/{sc.name}"
            dcp.save(
                {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()},
                checkpoint_id=where,
            )
            eval_kjt = kjt_of([batch(99, rank, FEATURES, ROWS)], FEATURES)
            with torch.no_grad():
                expected = dmp(eval_kjt)
            other = DistributedModelParallel(
                Model(sc.mixed, sc.torchrec_ebc),
                env=ShardingEnv.from_process_group(pg),
                device=torch.device("cpu"),
                sharders=sharders,
                plan=plan,
            )
            fresh = _local_shards(other.state_dict())
            target = {"model": other.state_dict(), "optim": other.fused_optimizer.state_dict()}
            dcp.load(target, checkpoint_id=where)
            other.load_state_dict(target["model"])
            other.fused_optimizer.load_state_dict(target["optim"])
            with torch.no_grad():
                got = other(eval_kjt)
            restored = {
                "fresh": fresh,
                "tables": _local_shards(other.state_dict()),
                "opt_state": _opt_shards(other.fused_optimizer.state_dict()["state"]),
                "eval": (got, expected),
            }
        # load_state_dict takes the ShardedTensors state_dict() gave (the initial rows back)
        dmp.load_state_dict(initial_state)
        reloaded = _local_shards(dmp.state_dict())
        results[sc.name] = {
            "restored": restored,
            "plan": {
                t: (p.sharding_type, p.compute_kernel)
                for t, p in plan.get_plan_for_module("cached").items()
            },
            "shards": {
                t: len(p.sharding_spec.shards)
                for t, p in plan.get_plan_for_module("cached").items()
            },
            "initial": initial,
            "final": final,
            "reloaded": reloaded,
            "evictions": evictions,
            "tiers": sorted({type(k.collection.store).__name__ for k in sharded.cached_kernels()}),
            "slots": slots,
            "outputs": outputs,
            "opt_state": _opt_shards(state),
        }
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    where = str(tmp_path_factory.mktemp("dcp"))
    return spawn(_worker, 2, args=(2, SCENARIOS, where), timeout=120)


def _opt_runs(runs: list[dict], key: str) -> list[dict]:
    """Each rank's optimizer state shards of table weight ``key``, as `_whole` reads them."""
    return [{"opt": run["opt_state"].get(f"cached.embedding_bags.{key}", {})} for run in runs]


def _whole(runs: list[dict], key: str, which: str, shape: tuple[int, int]) -> torch.Tensor:
    """A table assembled from every rank's shards (NaN where no shard wrote)."""
    out = torch.full(shape, float("nan"))
    for run in runs:
        for offsets, tensor in run[which].get(key, []):
            if tensor.dim() == 1:  # a row-wise state: [rows]
                offsets, tensor = [offsets[0], 0], tensor.unsqueeze(1)
            r, c = offsets
            out[r : r + tensor.shape[0], c : c + tensor.shape[1]] = tensor
    return out


def lr_at(step: int) -> float:
    """The learning rate of step ``step``'s update under DMP: StepLR(3, 0.5) stepped after
    each ``fused_optimizer.step()``, which hands the kernels the rate for the next backward."""
    return LR * 0.5 ** ((step - 1) // 3) if step else LR


def _reference(sc: Scenario, runs: list[dict], steps: int = STEPS) -> dict:
    """One process on ``steps`` global batches, from the rows the sharded run started with."""
    world_size = len(runs)
    opt_type, opt_kwargs = optimizer_of(sc)
    ref = embcache.CachedEmbeddingBagCollection(
        TABLES, optimizer_type=opt_type, optimizer_kwargs=opt_kwargs
    )
    ref.load_state_dict(
        {
            f"embedding_bags.{t.name}.weight": _whole(
                [r[sc.name] for r in runs],
                f"cached.embedding_bags.{t.name}.weight",
                "initial",
                (t.num_embeddings, t.embedding_dim),
            )
            for t in TABLES
        }
    )
    plain = dense = None
    scheduled = [ref.fused_optimizer()]
    if sc.mixed:
        plain = EmbeddingBagCollection(MIXED_TABLES)
        key = "plain.embedding_bags.u0.weight"
        plain.load_state_dict(
            {
                "embedding_bags.u0.weight": _whole(
                    [r[sc.name] for r in runs], key, "initial", (60, 4)
                )
            }
        )
        dense = nn.Linear(4, 3)
        dense.load_state_dict(
            {
                "weight": runs[0][sc.name]["initial"]["dense.weight"][0][1],
                "bias": runs[0][sc.name]["initial"]["dense.bias"][0][1],
            }
        )
        plain_opt = torch.optim.SGD(plain.parameters(), lr=LR)
        dense_opt = torch.optim.SGD(dense.parameters(), lr=LR)
        scheduled.append(plain_opt)
    outputs = []
    for step in range(steps):
        parts = [batch(step, r, FEATURES, ROWS) for r in range(world_size)]
        values = ref(kjt_of(parts, FEATURES)).values()
        out: object = values
        if sc.mixed:
            g = [batch(step + 100, r, ["g0"], {"g0": 60}) for r in range(world_size)]
            out = (values, dense(plain(kjt_of(g, ["g0"])).values()))
        outputs.append(out)
        for opt in scheduled:
            opt.param_groups[0]["lr"] = lr_at(step)
        # The sharded run's loss per rank, averaged: rank r's samples are rows r*B:(r+1)*B.
        loss = (
            sum(
                loss_of(
                    tuple(o[r * B : (r + 1) * B] for o in out)
                    if sc.mixed
                    else values[r * B : (r + 1) * B]
                )
                for r in range(world_size)
            )
            / world_size
        )
        loss.backward()
        if sc.mixed:
            for opt in (plain_opt, dense_opt):
                opt.step()
                opt.zero_grad()
    ref.flush()
    return {
        "ref": ref,
        "opt": ref.fused_optimizer(),
        "outputs": outputs,
        "plain": plain,
        "dense": dense,
    }


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_dmp_trains_like_one_process(two_ranks: list[dict], sc: Scenario) -> None:
    check_against_one_process(two_ranks, sc)
    assert [r[sc.name]["tiers"] for r in two_ranks] == [["HostKV"]] * 2


def check_against_one_process(two_ranks: list[dict], sc: Scenario) -> None:
    """Outputs, tables, optimizer state, cache sizes, reloads (and DCP) of a scenario's run."""
    runs = [r[sc.name] for r in two_ranks]
    for t in TABLES:  # the plan put the tables on the kernel expected, sharded as asked
        assert runs[0]["plan"][t.name] == (sc.sharding_type, sc.kernel(t.name))
    if sc.sharding_type != "table_wise":  # t0 split over both ranks
        assert runs[0]["shards"]["t0"] == 2
    ref = _reference(sc, two_ranks)
    worst = 0.0
    for step in range(STEPS):
        expected = ref["outputs"][step]
        expected = expected if isinstance(expected, tuple) else (expected,)
        for rank, run in enumerate(runs):
            for got, want in zip(run["outputs"][step], expected, strict=True):
                want = want[rank * B : (rank + 1) * B].detach()
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
                worst = max(worst, float((got - want).abs().max()))
    for t in TABLES:
        key = f"cached.embedding_bags.{t.name}.weight"
        got = _whole(runs, key, "final", (t.num_embeddings, t.embedding_dim))
        want = ref["ref"].state_dict()[f"embedding_bags.{t.name}.weight"]
        assert not torch.isnan(got).any(), f"{t.name}: a shard is missing from state_dict()"
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        worst = max(worst, float((got - want).abs().max()))
        assert not torch.equal(got, _whole(runs, key, "initial", got.shape)), "nothing trained"
    if sc.mixed:
        got = _whole(runs, "plain.embedding_bags.u0.weight", "final", (60, 4))
        torch.testing.assert_close(
            got, ref["plain"].embedding_bags["u0"].weight.detach(), rtol=RTOL, atol=ATOL
        )
        torch.testing.assert_close(
            runs[0]["final"]["dense.weight"][0][1],
            ref["dense"].weight.detach(),
            rtol=RTOL,
            atol=ATOL,
        )
    for run in runs:  # each shard cached a tenth of its rows, so rows came and went
        assert run["evictions"] > 0
        for (_, rows), slots in run["slots"].items():
            assert slots == -(-rows // 10), (rows, slots)
    # the optimizer state, by torchrec's keys, each rank holding its shards' rows
    want_state = ref["opt"].state_dict()["state"]
    cached = [t for t in TABLES if sc.cached(t.name)]
    for t in cached if sc.optimizer != "sgd" else []:
        key = f"{t.name}.weight"
        # row-wise AdaGrad keeps one value per row: [rows], as FBGEMM's
        shape = (t.num_embeddings, t.embedding_dim if sc.optimizer == "adagrad" else 1)
        # a ShardedTensor per state, as torchrec's fused optimizers give theirs
        # by the names torchrec's FUSED kernel gives them (t0.momentum1)
        got = _whole(_opt_runs(runs, key), f"{t.name}.momentum1", "opt", shape)
        want = want_state[key][f"{key}.momentum_1"].reshape(shape)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        if sc.checkpoint:  # DCP brought the optimizer state into the new model
            restored = [
                {"opt": r["restored"]["opt_state"][f"cached.embedding_bags.{key}"]} for r in runs
            ]
            assert torch.equal(_whole(restored, f"{t.name}.momentum1", "opt", shape), got)
    # load_state_dict() of the initial state_dict() brought the rows back (a cached table's
    # state_dict() holds copies; torchrec's own kernels hand out views of their live weights)
    for t in cached:
        key = f"cached.embedding_bags.{t.name}.weight"
        shape = (t.num_embeddings, t.embedding_dim)
        assert torch.equal(
            _whole(runs, key, "reloaded", shape), _whole(runs, key, "initial", shape)
        )
    if sc.checkpoint:
        for t in TABLES:
            key = f"cached.embedding_bags.{t.name}.weight"
            shape = (t.num_embeddings, t.embedding_dim)
            restored = [{k: r["restored"][k] for k in ("fresh", "tables")} for r in runs]
            assert not torch.equal(
                _whole(restored, key, "fresh", shape), _whole(runs, key, "final", shape)
            )
            assert torch.equal(
                _whole(restored, key, "tables", shape), _whole(runs, key, "final", shape)
            )
        for run in runs:
            got, expected = run["restored"]["eval"]
            assert torch.equal(got, expected)
    print(f"{sc.name}: max |sharded - one process| = {worst:.3g}")
