"""torchrec's usual recipe on embcache's collections, 2 gloo ranks on CPU:
``apply_optimizer_in_backward(cls, model.<collection>.parameters(), {"lr": LR})``, then
``DistributedModelParallel(model, sharders=[embcache's sharder])``, the dense part under
torchrec's ``KeyedOptimizerWrapper`` combined with ``model.fused_optimizer``
(``CombinedOptimizer``), trained for `STEPS` steps with a tenth of each shard cached.

torchrec reads the optimizer a table's weight carries into that table's fused params (over the
sharder's ``fused_params``), so the rows train with that class and lr and FBGEMM's defaults for
the rest (eps 1e-8). Each scenario runs twice from the same rows: on embcache's cache, and as
torchrec's own collection under the same recipe and plan on torchrec's FUSED kernel (FBGEMM's
CPU TBE): outputs, tables, optimizer state and the dense layer agree to `TOL`. Each is also
checked against a float64 reference written with plain torch (one
``nn.functional.embedding_bag`` per feature, ``torch.optim.Adagrad`` / torchrec's
``RowWiseAdagrad`` / ``SGD`` with eps 1e-8 on the tables, Adagrad on the dense layer) on each
step's global batch, the ranks' losses averaged as DMP averages them, to `TOL_FLOAT64`; the same
reference at another lr is far off (an optimizer left out, as the cache's sharders once left
it, trains FBGEMM's default: SGD at lr 0.01).

Scenarios: torchrec's planner (DMP plans it) over a `CachedEmbeddingBagCollection`; embcache's
planner with table-wise shards and a sharder whose own ``fused_params`` (SGD) the per-table
optimizer overrides, as in torchrec; torchrec's ``EmbeddingBagCollection`` with one table
cached by `CachingEmbeddingBagCollectionSharder`; a `CachedEmbeddingCollection` (sequence).

What cannot be applied is refused while DMP plans the model, before anything trains (here: the
planner's call to the sharder, in one process): a class with no fused rule, several optimizers,
an option the rule cannot apply.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import embcache
from embcache.distributed.launch import spawn
from tests.dmp import test_dmp_sequence as seq
from tests.dmp.test_dmp import FEATURES, ROWS, TABLES, _local_shards, _opt_shards, _whole
from tests.dmp.test_dmp import batch as bag_batch
from tests.dmp.test_dmp_four_ranks import _load_in_place

WORLD, STEPS = 2, 8
LR, DENSE_LR, WRONG_LR = 0.1, 0.05, 0.09
TOL = 1e-6  # embcache's cache against torchrec's FUSED kernel, both float32
TOL_FLOAT64 = 1e-5  # either against float64 (Adagrad's sums of squares reach tens)
OPTIMIZERS: dict[str, type] = {
    "adagrad": torch.optim.Adagrad,
    "rowwise": RowWiseAdagrad,
    "sgd": torch.optim.SGD,
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # "bags", "torchrec_bags" (t0 cached, t1 on FBGEMM) or "sequence"
    optimizer: str  # a key of OPTIMIZERS
    sharding: str | None  # embcache's planner, every table so; None: DMP's own planner
    decoy: bool = False  # the sharder's fused_params name SGD at lr 0.5

    @property
    def module(self) -> str:
        return "embedding_collection" if self.kind == "sequence" else "embedding_bag_collection"

    @property
    def prefix(self) -> str:
        return f"{self.module}.{'embeddings' if self.kind == 'sequence' else 'embedding_bags'}"

    @property
    def tables(self) -> list[Any]:
        return seq.TABLES if self.kind == "sequence" else TABLES

    @property
    def features(self) -> list[str]:
        return seq.FEATURES if self.kind == "sequence" else FEATURES

    def cached(self, table: str) -> bool:
        return self.kind != "torchrec_bags" or table == "t0"


SCENARIOS = [
    Scenario("bags_adagrad_dmp_planner", "bags", "adagrad", None),
    Scenario("bags_rowwise_table_wise_over_sharder_sgd", "bags", "rowwise", "table_wise", True),
    Scenario("torchrec_bags_sgd_t0_cached", "torchrec_bags", "sgd", "row_wise"),
    Scenario("sequence_adagrad_dmp_planner", "sequence", "adagrad", None),
]


def batch(sc: Scenario, step: int, rank: int) -> dict:
    rows = seq.ROWS if sc.kind == "sequence" else ROWS
    return bag_batch(step, rank, sc.features, rows)


def kjt_of(sc: Scenario, parts: dict) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=sc.features,
        values=torch.cat([parts[f][1] for f in sc.features]),
        lengths=torch.cat([parts[f][0] for f in sc.features]),
    )


def initial_tables(sc: Scenario) -> dict[str, torch.Tensor]:
    """The rows every run starts from, by state_dict key."""
    gen = torch.Generator().manual_seed(11)
    return {
        f"{sc.prefix}.{t.name}.weight": torch.rand(t.num_embeddings, t.embedding_dim, generator=gen)
        - 0.5
        for t in sc.tables
    }


class Model(nn.Module):
    """A collection (under the attribute torchrec's models give it) and a dense layer over its
    output; forward gives both."""

    def __init__(self, sc: Scenario, cached: bool) -> None:
        super().__init__()
        sparse: nn.Module
        cache = embcache.CacheConfig(load_factor=0.1)  # each shard's, unless constraints say
        if sc.kind == "sequence":
            sparse = (
                embcache.CachedEmbeddingCollection(seq.TABLES, cache=cache)
                if cached
                else EmbeddingCollection(tables=seq.TABLES)
            )
        elif sc.kind == "bags" and cached:
            sparse = embcache.CachedEmbeddingBagCollection(TABLES, cache=cache)
        else:
            sparse = EmbeddingBagCollection(TABLES)
        setattr(self, sc.module, sparse)
        self.sc = sc
        torch.manual_seed(1)  # the same dense layer whatever drew the tables' rows
        self.dense = nn.Linear(8 if sc.kind == "sequence" else 20, 2)

    def forward(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = getattr(self, self.sc.module)(kjt)
        if self.sc.kind == "sequence":
            values = torch.cat([out[f].values() for f in self.sc.features])
        else:
            values = out.values()
        return values, self.dense(values)


def loss_of(values: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return (
        (values * values).sum() + values[:, ::3].sum() + (dense * dense).sum() + dense[:, 0].sum()
    )


def _sharders_and_plan(sc: Scenario, model: nn.Module, cached: bool, like: Any) -> tuple:
    """The sharders and plan of a run (None: DMP plans); torchrec's FUSED runs take the
    cached run's plan ``like`` with every table on the FUSED kernel."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan

    from embcache.torchrec import (
        CachedEmbeddingBagCollectionSharder,
        CachedEmbeddingCollectionSharder,
        CachedEmbeddingShardingPlanner,
        CachedParameterConstraints,
        CachingEmbeddingBagCollectionSharder,
    )

    decoy = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5} if sc.decoy else None
    if not cached:
        torchrec_sharder: Any = (
            EmbeddingCollectionSharder(decoy)
            if sc.kind == "sequence"
            else EmbeddingBagCollectionSharder(decoy)
        )
        plan = ShardingPlan(
            {
                name: EmbeddingModuleShardingPlan(
                    {t: dataclasses.replace(p, compute_kernel="fused") for t, p in mp.items()}
                )
                for name, mp in like.plan.items()
            }
        )
        return [torchrec_sharder], plan
    constraints: dict[str, Any] = {}
    if sc.sharding is not None:
        for t in sc.tables:
            constraints[t.name] = (
                CachedParameterConstraints(sharding_types=[sc.sharding], cache_load_factor=0.1)
                if sc.cached(t.name)
                else ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
            )
    if sc.kind == "sequence":
        sharder: Any = CachedEmbeddingCollectionSharder(decoy, constraints=constraints)
    elif sc.kind == "bags":
        sharder = CachedEmbeddingBagCollectionSharder(decoy, constraints=constraints)
    else:
        sharder = CachingEmbeddingBagCollectionSharder(decoy, constraints=constraints)
    if sc.sharding is None:
        return [sharder], None
    planner = CachedEmbeddingShardingPlanner(
        Topology(world_size=WORLD, compute_device="cpu"), constraints
    )
    return [sharder], planner.collective_plan(model, [sharder], torch.distributed.group.WORLD)


def _train(rank: int, sc: Scenario, cached: bool, like: Any = None) -> tuple[dict, Any]:
    """One run of the recipe on this rank; its record and its DMP."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from embcache.torchrec import CACHED_KERNEL

    torch.manual_seed(0)
    model = Model(sc, cached)
    apply_optimizer_in_backward(
        OPTIMIZERS[sc.optimizer], getattr(model, sc.module).parameters(), {"lr": LR}
    )
    sharders, plan = _sharders_and_plan(sc, model, cached, like)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(torch.distributed.group.WORLD),
        device=torch.device("cpu"),
        sharders=sharders,
        plan=plan,
    )
    whole = initial_tables(sc)
    on_cache = {k: v for k, v in whole.items() if cached and sc.cached(k.split(".")[-2])}
    if on_cache:
        dmp.load_state_dict(on_cache, strict=False)
    _load_in_place(dmp, {k: v for k, v in whole.items() if k not in on_cache})
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=DENSE_LR),
    )
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])
    record: dict[str, Any] = {
        "plan": {
            t: (p.sharding_type, p.compute_kernel)
            for t, p in dmp.plan.get_plan_for_module(sc.module).items()
        },
        "lrs": sorted({round(g["lr"], 6) for g in dmp.fused_optimizer.param_groups}),
        "dense_keys": sorted(dense.params),
        "initial_dense": {
            k: v.detach().clone() for k, v in dmp.state_dict().items() if "dense" in k
        },
        "outputs": [],
    }
    for step in range(STEPS):
        values, out = dmp(kjt_of(sc, batch(sc, step, rank)))
        record["outputs"].append((values.detach().clone(), out.detach().clone()))
        opt.zero_grad()
        loss_of(values, out).backward()
        opt.step()
    record["final"] = _local_shards(dmp.state_dict())
    record["opt_state"] = _opt_shards(dmp.fused_optimizer.state_dict()["state"])
    if cached:
        from embcache.torchrec import ShardedCachedEmbeddingBagCollection
        from embcache.torchrec import ShardedCachedEmbeddingCollection as Seq

        kernels = [
            k
            for m in dmp.modules()
            if isinstance(m, ShardedCachedEmbeddingBagCollection | Seq)
            for k in m.cached_kernels()
        ]
        record["kernel_lrs"] = sorted(
            {k.collection.fused_optimizer().param_groups[0]["lr"] for k in kernels}
        )
        record["optimizers"] = sorted({k.collection.optimizer_type().__name__ for k in kernels})
        record["evictions"] = sum(k.collection.cache_stats()["evictions"] for k in kernels)
        record["slots"] = [
            (shard.local_rows, k.collection.engines.engine_of(n).cache.num_slots)
            for k in kernels
            for shard, n in k.shards()
        ]
        record["cached_kernel"] = CACHED_KERNEL
    return record, dmp


def _worker(rank: int, scenarios: list[Scenario]) -> dict:
    out = {}
    for sc in scenarios:
        cached, dmp = _train(rank, sc, cached=True)
        fused, _ = _train(rank, sc, cached=False, like=dmp.plan)
        out[sc.name] = {"cached": cached, "fused": fused}
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_worker, WORLD, args=(SCENARIOS,), timeout=180)


# -- the float64 reference --------------------------------------------------------------------


def reference(sc: Scenario, initial_dense: dict[str, torch.Tensor], lr: float) -> dict:
    """Plain torch in float64 on each step's global batch: per-rank outputs, final tables,
    optimizer state (``[rows, dim]`` or row-wise ``[rows, 1]`` sums) and dense layer."""
    weights = {k.split(".")[-2]: v.double().requires_grad_() for k, v in initial_tables(sc).items()}
    dense = nn.Linear(*reversed(initial_dense["dense.weight"].shape)).double()
    dense.load_state_dict({k.removeprefix("dense."): v.double() for k, v in initial_dense.items()})
    cls = OPTIMIZERS[sc.optimizer]
    # FBGEMM's eps, which torchrec's fused kernels take when the kwargs give none
    extra = {} if cls is torch.optim.SGD else {"eps": 1e-8}
    opt = cls(list(weights.values()), lr=lr, **extra)
    dense_opt = torch.optim.Adagrad(dense.parameters(), lr=DENSE_LR)
    table_of = {f: t for t in sc.tables for f in t.feature_names}
    outputs = []
    for step in range(STEPS):
        per_rank, loss = [], torch.zeros((), dtype=torch.float64)
        for rank in range(WORLD):
            parts = batch(sc, step, rank)
            columns = []
            for f in sc.features:
                lengths, ids = parts[f]
                t = table_of[f]
                if sc.kind == "sequence":
                    columns.append(weights[t.name][ids])
                    continue
                offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
                mode = "mean" if t.pooling.name == "MEAN" else "sum"
                columns.append(
                    nn.functional.embedding_bag(ids, weights[t.name], offsets, mode=mode)
                )
            values = torch.cat(columns, dim=0 if sc.kind == "sequence" else 1)
            out = dense(values)
            per_rank.append((values.detach(), out.detach()))
            loss = loss + loss_of(values, out) / WORLD  # DMP averages the ranks' gradients
        outputs.append(per_rank)
        loss.backward()
        for o in (opt, dense_opt):
            o.step()
            o.zero_grad()
    return {
        "outputs": outputs,
        "tables": {n: w.detach() for n, w in weights.items()},
        "state": {n: opt.state[w].get("sum") for n, w in weights.items()},
        "dense": {f"dense.{k}": v.detach() for k, v in dense.state_dict().items()},
    }


def assembled(runs: list[dict], sc: Scenario) -> dict:
    """A run (every rank's record) in `reference`'s form."""
    width = {"adagrad": None, "rowwise": 1, "sgd": 0}[sc.optimizer]
    state: dict[str, torch.Tensor | None] = {}
    tables = {}
    for t in sc.tables:
        key = f"{sc.prefix}.{t.name}.weight"
        tables[t.name] = _whole(runs, key, "final", (t.num_embeddings, t.embedding_dim))
        state[t.name] = None
        if width != 0:  # Adagrad's sums, FBGEMM's momentum1 (per weight, or per row)
            states = [{"opt": r["opt_state"].get(key, {})} for r in runs]
            shape = (t.num_embeddings, width or t.embedding_dim)
            state[t.name] = _whole(states, f"{t.name}.momentum1", "opt", shape)
    return {
        "outputs": [[r["outputs"][step] for r in runs] for step in range(STEPS)],
        "tables": tables,
        "state": state,
        "dense": [{k: r["final"][k][0][1] for k in r["initial_dense"]} for r in runs],
    }


def max_difference(got: dict, want: dict) -> float:
    """The largest ``|got - want| / (1 + |want|)`` over outputs, tables, optimizer state and
    the dense layer (every rank's): `TOL` bounds it as ``assert_close(atol=rtol=TOL)``."""
    worst = 0.0

    def diff(a: torch.Tensor, b: torch.Tensor) -> None:
        nonlocal worst
        assert a.shape == b.shape, (a.shape, b.shape)
        assert not (torch.isnan(a).any() or torch.isnan(b).any()), "a shard is missing"
        if a.numel():
            b = b.double()
            worst = max(worst, float(((a.double() - b).abs() / (1 + b.abs())).max()))

    for mine, theirs in zip(got["outputs"], want["outputs"], strict=True):
        for a, b in zip(mine, theirs, strict=True):
            for x, y in zip(a, b, strict=True):
                diff(x, y)
    for kind in ("tables", "state"):
        for name, a in got[kind].items():
            assert (a is None) == (want[kind][name] is None), (kind, name)
            if a is not None:
                diff(a, want[kind][name])
    dense = want["dense"] if isinstance(want["dense"], list) else [want["dense"]] * WORLD
    for a, b in zip(got["dense"], dense, strict=True):
        for key, value in a.items():
            diff(value, b[key])
    return worst


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_recipe_trains_as_torchrec_and_as_torch(two_ranks: list[dict], sc: Scenario) -> None:
    runs = {kind: [r[sc.name][kind] for r in two_ranks] for kind in ("cached", "fused")}
    cached = runs["cached"][0]
    # The tables ran on the cache (DMP's planner names the kernel it stands in for, embcache's
    # its own) with the optimizer and lr apply_optimizer_in_backward gave, a tenth of each
    # shard cached.
    for t in sc.tables:
        on_cache = sc.sharding is not None and sc.cached(t.name)
        kernel = cached["cached_kernel"] if on_cache else "fused"
        sharding = sc.sharding if on_cache else "table_wise"
        if sc.sharding is None:
            sharding = cached["plan"][t.name][0]  # DMP's planner's choice
        assert cached["plan"][t.name] == (sharding, kernel)
    for run in runs["cached"]:
        assert run["optimizers"] == [OPTIMIZERS[sc.optimizer].__name__]
        assert run["kernel_lrs"] == [LR]
        assert run["lrs"] == [LR]
        assert run["dense_keys"] == ["dense.bias", "dense.weight"]  # not the tables
        assert run["evictions"] > 0
        for rows, slots in run["slots"]:
            assert slots == -(-rows // 10), (rows, slots)
    assert runs["fused"][0]["lrs"] == [LR]
    initial_dense = cached["initial_dense"]
    for run in runs["cached"] + runs["fused"]:
        assert run["initial_dense"].keys() == initial_dense.keys()
        assert all(torch.equal(run["initial_dense"][k], v) for k, v in initial_dense.items())
    got = {kind: assembled(r, sc) for kind, r in runs.items()}
    ref = reference(sc, initial_dense, LR)
    worst = {
        "embcache - FUSED": max_difference(got["cached"], got["fused"]),
        "embcache - float64": max_difference(got["cached"], ref),
        "FUSED - float64": max_difference(got["fused"], ref),
        # the comparison tells the lr apart: the same reference at another lr fails it
        "embcache - float64 at another lr": max_difference(
            got["cached"], reference(sc, initial_dense, WRONG_LR)
        ),
    }
    print(f"{sc.name}: " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()))
    assert worst["embcache - FUSED"] <= TOL, worst
    assert worst["embcache - float64"] <= TOL_FLOAT64, worst
    assert worst["FUSED - float64"] <= TOL_FLOAT64, worst
    assert worst["embcache - float64 at another lr"] > 100 * TOL_FLOAT64, worst


# -- what cannot be applied, refused while DMP plans ---------------------------------------


def _plan_one_process(module: nn.Module, sharder: Any) -> Any:
    """What DMP does first with a model holding ``module``: torchrec's planner asks the sharder
    for its shardable parameters (one process: no process group needed to plan)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    planner = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu"))
    return planner.plan(module, [sharder])


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "match"),
    [
        (
            torch.optim.RMSprop,
            {"lr": 0.1},
            ValueError,
            r"RMSprop has no fused rule.*applies torch\.optim\.SGD, torch\.optim\.Adagrad, "
            r"torchrec\.optim\.RowWiseAdagrad, torch\.optim\.Adam",
        ),
        (torch.optim.AdamW, {"lr": 0.1}, ValueError, r"AdamW has no fused rule"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, ValueError, r"momentum"),
        (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}, ValueError, r"amsgrad"),
    ],
    ids=["RMSprop", "AdamW", "SGD_momentum", "Adam_amsgrad"],
)
@pytest.mark.parametrize("kind", ["bags", "sequence"])
def test_what_the_cache_cannot_apply_is_refused_before_training(
    cls: type, kwargs: dict, error: type, match: str, kind: str
) -> None:
    from embcache.torchrec import (
        CachedEmbeddingBagCollectionSharder,
        CachedEmbeddingCollectionSharder,
    )

    if kind == "bags":
        module: Any = embcache.CachedEmbeddingBagCollection(TABLES)
        sharder: Any = CachedEmbeddingBagCollectionSharder()
    else:
        module = embcache.CachedEmbeddingCollection(seq.TABLES)
        sharder = CachedEmbeddingCollectionSharder()
    apply_optimizer_in_backward(cls, module.parameters(), kwargs)
    with pytest.raises(error, match=match) as raised:
        _plan_one_process(module, sharder)
    message = str(raised.value)
    assert "\n" not in message and "apply_optimizer_in_backward" in message, message


def test_torch_options_reach_the_rule_never_dropped() -> None:
    """A torch option FBGEMM has no name for (what apply_optimizer_in_backward's kwargs hold)
    goes to the cache's rule, which applies it (Adagrad's initial accumulator and lr decay,
    Adam's betas) or refuses it; the sharder's other fused params stay out."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from embcache.torchrec.kernel import fused_optimizer_of

    cls, kwargs = fused_optimizer_of(
        {
            "optimizer": EmbOptimType.EXACT_ADAGRAD,
            "learning_rate": 0.1,
            "initial_accumulator_value": 0.1,
            "lr_decay": 0.01,
            "cache_load_factor": 0.1,
        }
    )
    assert cls is torch.optim.Adagrad
    assert kwargs == {"learning_rate": 0.1, "initial_accumulator_value": 0.1, "lr_decay": 0.01}
    cls, kwargs = fused_optimizer_of({"optimizer": "adam", "lr": 0.1, "betas": (0.8, 0.9)})
    assert cls is torch.optim.Adam and kwargs == {"lr": 0.1, "betas": (0.8, 0.9)}
    _, kwargs = fused_optimizer_of({"optimizer": "exact_sgd", "lr": 0.1, "momentum": 0.9})
    assert kwargs == {"lr": 0.1, "momentum": 0.9}  # which the rule refuses (test above)


def test_two_optimizers_on_the_collection_are_refused() -> None:
    from embcache.torchrec import CachedEmbeddingBagCollectionSharder

    module = embcache.CachedEmbeddingBagCollection(TABLES)
    apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match=r"2 optimizers \['SGD', 'Adagrad'\]; a table takes one"):
        _plan_one_process(module, CachedEmbeddingBagCollectionSharder())


def test_each_table_carries_the_optimizer_as_torchrec_reads_it() -> None:
    """The stand-in weights torchrec's planner and sharded collection read carry the
    collection's in-backward optimizer, as torchrec's own table weights would (each its own
    kwargs: torchrec rewrites them in place)."""
    from embcache.torchrec import CachedEmbeddingBagCollectionSharder

    module = embcache.CachedEmbeddingBagCollection(TABLES)
    apply_optimizer_in_backward(RowWiseAdagrad, module.parameters(), {"lr": 0.2})
    params = CachedEmbeddingBagCollectionSharder().shardable_parameters(module)
    assert sorted(params) == ["t0", "t1"]
    kwargs = [p._optimizer_kwargs for p in params.values()]
    assert all(p._optimizer_classes == [RowWiseAdagrad] for p in params.values())
    assert kwargs == [[{"lr": 0.2}]] * 2 and kwargs[0][0] is not kwargs[1][0]
    plain = CachedEmbeddingBagCollectionSharder().shardable_parameters(
        embcache.CachedEmbeddingBagCollection(TABLES)
    )
    assert not any(hasattr(p, "_optimizer_classes") for p in plain.values())
