"""Row-wise sharded sequence embeddings (gloo on CPU, 2 ranks in one spawn) against one process.

`ShardedEmbeddingCollection` trains for a few steps with SparseAdaGrad and a cache much smaller
than a batch's rows (evictions and scratch rows), every rank on its own part of each global
batch (one rank's part empty at a step), beside a single-process `CachedEmbeddingCollection`
(same tables, same seed, so the same initial rows) on the concatenated global batch with the
loss summed over the ranks' losses, so both see the same gradients. This mirrors
`test_sharded.py` (whose data and helpers it imports), with its tolerances: each rank's rows of
the first step equal the reference's bit for bit; later outputs, the tables (gathered by
``state_dict``) and the optimizer state agree to RTOL = 1e-5, ATOL = 1e-6 (the sharded run sums
a row's gradient per rank, then over ranks).

The same spawn checks that `TrainPipeline` with prefetch gives the numbers of a run without it,
bit for bit, with every forward using its prefetch; that a checkpoint (`embcache.save` per rank)
loads into a fresh collection and training goes on identically; and that an id out of range on
one rank raises there (a ValueError naming it) and a `CollectiveError` on the other, changing
nothing, after which training goes on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec import EmbeddingConfig, KeyedJaggedTensor

import embcache
from embcache.distributed import ShardedEmbeddingCollection
from embcache.distributed.launch import spawn
from embcache.train.pipeline import TrainPipeline
from tests.distributed.test_sharded import (
    FEATURES,
    Scenario,
    assert_close,
    loss_of,
    make_optimizer,
    optimizer_state,
    rank_parts,
    to_kjt,
)

# test_sharded.py's tables (its data's features and row counts), unpooled: two caches (dims 6
# and 5), t0 looked up by two features.
TABLES = [
    EmbeddingConfig(name="t0", embedding_dim=6, num_embeddings=300, feature_names=["f0", "f1"]),
    EmbeddingConfig(name="t1", embedding_dim=6, num_embeddings=250, feature_names=["f2"]),
    EmbeddingConfig(name="t2", embedding_dim=5, num_embeddings=200, feature_names=["f3"]),
]
WORLD = 2
TRAIN = Scenario(
    "seq_adagrad_small_cache",
    "adagrad",
    ((5, 2), (0, 6), (3, 3)),
    cache=embcache.CacheConfig(capacity=12, ways=4),
)
PIPELINE = Scenario("seq_pipeline", "adagrad", ((3, 4), (2, 0), (4, 3), (1, 2)))
ROOMY = embcache.CacheConfig(capacity=256, ways=4, policy="lru")


def sequence_loss(out: dict) -> torch.Tensor:
    return sum(loss_of(jt.values()) for jt in out.values())


def rank_kjt(sc: Scenario, step: int, rank: int) -> KeyedJaggedTensor:
    return to_kjt([rank_parts(sc, step, rank, WORLD)], False)


# ----------------------------------------------------------------------------------------------
# what the ranks run


def _train(rank: int) -> dict:
    """`TRAIN` on this rank's parts: outputs (values, lengths, indices) per step and key."""
    ec = ShardedEmbeddingCollection(TABLES, need_indices=True, cache=TRAIN.cache, seed=0)
    opt = make_optimizer(TRAIN, ec)
    outputs = []
    for step in range(len(TRAIN.batch_sizes)):
        out = ec(rank_kjt(TRAIN, step, rank))
        outputs.append({k: (jt.values().detach().clone(), jt.lengths(), jt.weights())
                        for k, jt in out.items()})  # fmt: skip
        sequence_loss(out).backward()
        opt.step()
    with torch.no_grad():
        evaluated = {k: jt.values().clone() for k, jt in ec(rank_kjt(TRAIN, 0, rank)).items()}
    locked = sum(c.locked_slots() for c in ec.caches())
    return {
        "outputs": outputs,
        "eval": evaluated,
        "tables": ec.state_dict(),
        "state": optimizer_state(opt),
        "stats": ec.cache_stats(all_ranks=True),
        "locked": locked,
    }


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = ShardedEmbeddingCollection(TABLES, cache=ROOMY, seed=0)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return sequence_loss(self.sparse(kjt))


def _snapshot(model: Model, opt) -> dict:
    return {"tables": model.sparse.state_dict(), "state": optimizer_state(opt)}


def _pipeline(rank: int, prefetch: bool, checkpoint: Path) -> dict:
    """`PIPELINE` through `TrainPipeline`; with prefetch, also a checkpoint round trip: the
    state saved, loaded into a fresh model, and one more step on both."""
    model = Model()
    opt = make_optimizer(PIPELINE, model.sparse)
    model.sparse.reset_comm_stats()
    batches = [rank_kjt(PIPELINE, step, rank) for step in range(len(PIPELINE.batch_sizes))]
    pipe = TrainPipeline(model, opt, None, features=lambda b: b, loss=lambda m, b: m(b),
                         prefetch=prefetch)  # fmt: skip
    losses = pipe.run(batches)
    out = {
        "losses": losses,
        "collectives": model.sparse.comm_stats()["collectives"],
        "fallbacks": pipe.fallbacks,
        "locked": sum(c.locked_slots() for c in model.sparse.caches()),
        **_snapshot(model, opt),
    }
    if prefetch:
        embcache.save(checkpoint / f"rank-{rank}", model, [opt])
        fresh = Model()
        fresh_opt = make_optimizer(PIPELINE, fresh.sparse)
        embcache.load(checkpoint / f"rank-{rank}", fresh, [fresh_opt])
        out["loaded"] = _snapshot(fresh, fresh_opt)
        for m, o in ((model, opt), (fresh, fresh_opt)):
            m(batches[0]).backward()
            o.step()
        out["resumed"] = (_snapshot(model, opt), _snapshot(fresh, fresh_opt))
    return out


def _refusal(rank: int) -> dict:
    """An id out of range on rank 1: every rank raises, nothing changes, training goes on."""
    ec = ShardedEmbeddingCollection(TABLES, seed=0)
    opt = make_optimizer(TRAIN, ec)
    before = ec.state_dict()
    good = rank_kjt(TRAIN, 0, rank)
    bad = good
    if rank == 1:
        values = good.values().clone()
        values[-1] = 10_000  # f3 looks up t2, 200 rows
        bad = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=good.lengths())
    error = None
    try:
        ec(bad)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    after = ec.state_dict()  # a collective: once per rank, never inside a short-circuit
    unchanged = all(torch.equal(v, after[k]) for k, v in before.items())
    locked = sum(c.locked_slots() for c in ec.caches())
    sequence_loss(ec(good)).backward()  # training still works afterwards
    opt.step()
    trained = ec.state_dict()
    changed = any(not torch.equal(v, trained[k]) for k, v in before.items())
    return {"error": error, "unchanged": unchanged and locked == 0, "trained": changed}


def _worker(rank: int, checkpoint: str) -> dict:
    return {
        "train": _train(rank),
        "pipeline": {p: _pipeline(rank, p, Path(checkpoint)) for p in (False, True)},
        "refusal": _refusal(rank),
    }


# ----------------------------------------------------------------------------------------------
# the single-process reference


def reference() -> dict:
    """`TRAIN` in one process on the concatenated global batches; outputs split per rank."""
    ec = embcache.CachedEmbeddingCollection(TABLES, need_indices=True, seed=0)
    opt = make_optimizer(TRAIN, ec)

    def per_rank(step: int, out: dict) -> list[dict]:
        parts = [rank_parts(TRAIN, step, r, WORLD) for r in range(WORLD)]
        split = {}
        for key, jt in out.items():
            sizes = [int(p[key][0].sum()) for p in parts]
            split[key] = list(zip(torch.split(jt.values().detach().clone(), sizes),
                                  torch.split(jt.weights(), sizes), strict=True))  # fmt: skip
        return [{key: split[key][r] for key in out} for r in range(WORLD)]

    def global_kjt(step: int) -> KeyedJaggedTensor:
        return to_kjt([rank_parts(TRAIN, step, r, WORLD) for r in range(WORLD)], False)

    outputs = []
    for step in range(len(TRAIN.batch_sizes)):
        out = ec(global_kjt(step))
        outputs.append(per_rank(step, out))
        sequence_loss(out).backward()  # = the sum of the ranks' losses
        opt.step()
    with torch.no_grad():
        evaluated = per_rank(0, ec(global_kjt(0)))
    return {
        "outputs": outputs,
        "eval": evaluated,
        "tables": ec.state_dict(),
        "state": optimizer_state(opt),
    }


# ----------------------------------------------------------------------------------------------
# tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(_worker, WORLD, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout=120)


def test_two_ranks_match_one_process(runs: list[dict]) -> None:
    ref = reference()
    assert list(ref["tables"]) == [f"embeddings.{t.name}.weight" for t in TABLES]
    for rank, run in enumerate(runs):
        res = run["train"]
        for step, out in enumerate(res["outputs"]):
            expected = ref["outputs"][step][rank]
            assert list(out) == FEATURES
            for key, (values, lengths, indices) in out.items():
                parts = rank_parts(TRAIN, step, rank, WORLD)[key]
                assert torch.equal(lengths, parts[0]) and torch.equal(indices, parts[1])
                assert torch.equal(indices, expected[key][1])
                where = f"rank {rank} step {step} {key}"
                assert_close(values, expected[key][0], where)
                if step == 0:
                    assert torch.equal(values, expected[key][0]), f"{where}: first step not exact"
        for key, values in res["eval"].items():
            assert_close(values, ref["eval"][rank][key][0], f"rank {rank} no_grad {key}")
        for key, table in ref["tables"].items():
            assert_close(res["tables"][key], table, f"rank {rank} {key}")
        for table, parts in ref["state"].items():
            for name, state in parts.items():
                assert_close(res["state"][table][name], state, f"rank {rank} {table}.{name}")
        assert res["locked"] == 0, "slots still locked after the last step"
    assert runs[0]["train"]["stats"]["evictions"] > 0, "the cache never evicted"
    for key in ref["tables"]:  # every rank gathered the same tables
        assert torch.equal(runs[0]["train"]["tables"][key], runs[1]["train"]["tables"][key])


def _assert_same(a: dict, b: dict, what: str) -> None:
    for key, value in a["tables"].items():
        assert torch.equal(b["tables"][key], value), f"{what}: {key}"
    for table, parts in a["state"].items():
        for name, value in parts.items():
            assert torch.equal(b["state"][table][name], value), f"{what}: {table}.{name}"


def test_pipeline_with_prefetch_is_bit_identical(runs: list[dict]) -> None:
    steps = len(PIPELINE.batch_sizes)
    for rank, run in enumerate(runs):
        sync, pre = run["pipeline"][False], run["pipeline"][True]
        assert pre["losses"] == sync["losses"], f"rank {rank}: losses differ"
        _assert_same(sync, pre, f"rank {rank}")
        assert pre["locked"] == 0 and sync["locked"] == 0
        assert pre["fallbacks"] == 0
        # Every forward used its prefetch: 2 all_to_alls on the prefetch group per step, the
        # forward's id exchange saved.
        assert pre["collectives"] == sync["collectives"] + steps, (pre, sync)


def test_checkpoint_loads_and_training_goes_on(runs: list[dict]) -> None:
    for rank, run in enumerate(runs):
        pre = run["pipeline"][True]
        _assert_same(pre, pre["loaded"], f"rank {rank} loaded")
        trained, loaded = pre["resumed"]
        _assert_same(trained, loaded, f"rank {rank} resumed")


def test_a_bad_id_raises_on_its_rank_and_fails_the_other(runs: list[dict]) -> None:
    zero, one = (run["refusal"] for run in runs)
    assert one["error"].startswith("ValueError"), one["error"]
    assert "feature 'f3'" in one["error"] and "10000" in one["error"]
    assert zero["error"].startswith("CollectiveError"), zero["error"]
    assert "rank(s) [1] refused their input" in zero["error"]
    for run in (zero, one):
        assert run["unchanged"] and run["trained"]
