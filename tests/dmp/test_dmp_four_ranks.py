"""DMP with embcache's sharder on 4 gloo ranks (CPU), ``t0`` row-wise and ``t1`` table-wise in
one plan, a tenth of each shard cached on the host tier, 20 steps with exact AdaGrad under
`tests.dmp.test_dmp`'s LR schedule, against

* one process (`tests.dmp.test_dmp._reference`: a `CachedEmbeddingBagCollection` on the
  concatenated global batches), and
* torchrec's own DMP: its ``EmbeddingBagCollection`` sharded by its sharder with the same plan
  on its FUSED kernel (FBGEMM's CPU table-batched kernel) and the same ``fused_params``,

all from the same initial rows (whole tables loaded into both DMPs), to 1e-5 in outputs,
tables and optimizer state; and the FUSED run's DCP checkpoint loads into embcache's DMP.
The one 4-rank spawn: keep it small.
"""

from __future__ import annotations

import pytest
import torch

from embcache.distributed.launch import spawn
from tests.dmp.test_dmp import TABLES, B, Scenario, _reference, _whole
from tests.dmp.test_dmp_pipeline import _max_diff
from tests.dmp.training import batches, build_dmp, schedule_of, snapshot, train_plainly

WORLD, STEPS = 4, 20
SHARDING = {"t0": "row_wise", "t1": "table_wise"}
SC = Scenario("four_ranks", "row_wise+table_wise", "adagrad")
RTOL, ATOL = 1e-5, 1e-5


def initial_tables() -> dict[str, torch.Tensor]:
    """The rows every run starts from, ``cached.embedding_bags.<t>.weight`` -> whole table."""
    gen = torch.Generator().manual_seed(7)
    return {
        f"cached.embedding_bags.{t.name}.weight": torch.rand(
            t.num_embeddings, t.embedding_dim, generator=gen
        )
        - 0.5
        for t in TABLES
    }


def _load_in_place(dmp: torch.nn.Module, whole: dict[str, torch.Tensor]) -> None:
    """Copy each local shard's rows of ``whole`` into torchrec's FUSED kernel (its
    ``state_dict()`` holds views of the live weights)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    state = dmp.state_dict()
    for key, rows in whole.items():
        value = state[key]
        assert isinstance(value, ShardedTensor), key
        for shard in value.local_shards():
            (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(rows[r : r + nr, c : c + nc])


def _worker(rank: int, world_size: int, where: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from embcache.torchrec import ShardedCachedEmbeddingBagCollection

    whole = initial_tables()
    data = batches(rank, range(STEPS))
    out = {}
    cached = None
    for kind in ("cached", "fused"):
        dmp = build_dmp(world_size, SHARDING, fused_like=cached)
        if kind == "cached":
            cached = dmp
            dmp.load_state_dict(whole)
            (sharded,) = [
                m for m in dmp.modules() if isinstance(m, ShardedCachedEmbeddingBagCollection)
            ]
        else:
            _load_in_place(dmp, whole)
        plan = dmp.plan.get_plan_for_module("cached")
        initial = snapshot(dmp)["tables"]
        outputs = train_plainly(dmp, data, schedule_of(dmp))
        end = snapshot(dmp)
        out[kind] = {
            "plan": {t: (p.sharding_type, p.compute_kernel) for t, p in plan.items()},
            "initial": initial,
            "outputs": [[o] for o in outputs],
            "final": end["tables"],
            "opt_state": end["opt_state"],
        }
    out["cached"]["evictions"] = sum(
        k.collection.cache_stats()["evictions"] for k in sharded.cached_kernels()
    )
    # torchrec's FUSED kernel's checkpoint, loaded into embcache's (same keys, same shards)
    dcp.save(
        {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=where
    )
    target = {"model": cached.state_dict(), "optim": cached.fused_optimizer.state_dict()}
    dcp.load(target, checkpoint_id=where)
    cached.load_state_dict(target["model"])
    cached.fused_optimizer.load_state_dict(target["optim"])
    out["from_fused"] = snapshot(cached)
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    where = str(tmp_path_factory.mktemp("fused_checkpoint"))
    return spawn(_worker, WORLD, args=(WORLD, where), timeout=120)


def test_four_ranks_train_like_one_process_and_torchrec_fused(four_ranks: list[dict]) -> None:
    kernel = {"cached": "customized_kernel", "fused": "fused"}
    by_kind = {k: [{SC.name: r[k]} for r in four_ranks] for k in kernel}
    ref = _reference(SC, by_kind["cached"], steps=STEPS)
    want_state = ref["opt"].state_dict()["state"]
    worst = dict.fromkeys(kernel, 0.0)
    for kind, runs in by_kind.items():
        runs = [r[SC.name] for r in runs]
        for t, s in SHARDING.items():
            assert runs[0]["plan"][t] == (s, kernel[kind])
        for t in TABLES:  # both DMPs started from the same rows
            key = f"cached.embedding_bags.{t.name}.weight"
            shape = (t.num_embeddings, t.embedding_dim)
            assert torch.equal(_whole(runs, key, "initial", shape), initial_tables()[key])
        for step in range(STEPS):
            for rank, run in enumerate(runs):
                (got,) = run["outputs"][step]
                want = ref["outputs"][step][rank * B : (rank + 1) * B].detach()
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
                worst[kind] = max(worst[kind], float((got - want).abs().max()))
        for t in TABLES:
            key = f"cached.embedding_bags.{t.name}.weight"
            shape = (t.num_embeddings, t.embedding_dim)
            got = _whole(runs, key, "final", shape)
            want = ref["ref"].state_dict()[f"embedding_bags.{t.name}.weight"]
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            worst[kind] = max(worst[kind], float((got - want).abs().max()))
            opt = [{"opt": r["opt_state"].get(key, {})} for r in runs]
            got = _whole(opt, f"{t.name}.momentum1", "opt", shape)  # FBGEMM's name, either kernel
            want = want_state[f"{t.name}.weight"][f"{t.name}.weight.momentum_1"].reshape(shape)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            worst[kind] = max(worst[kind], float((got - want).abs().max()))
    assert all(r["cached"]["evictions"] > 0 for r in four_ranks)
    print(
        f"max |4 ranks - one process|: embcache {worst['cached']:.3g}, "
        f"torchrec FUSED {worst['fused']:.3g}"
    )


def test_a_fused_kernel_checkpoint_loads_into_the_cache(four_ranks: list[dict]) -> None:
    """DCP of torchrec's DMP on its FUSED kernel, loaded into embcache's: the same tables and
    optimizer state, bit for bit (the names and shards are torchrec's)."""
    for run in four_ranks:
        loaded, fused = run["from_fused"], run["fused"]
        assert _max_diff(loaded["tables"], fused["final"]) == 0.0
        assert loaded["opt_state"].keys() == fused["opt_state"].keys()
        for key, state in fused["opt_state"].items():
            assert _max_diff(loaded["opt_state"][key], state) == 0.0
