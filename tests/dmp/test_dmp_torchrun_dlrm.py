"""torchrec's DLRM over embcache's cached collection under ``torchrun`` (``python -m
torch.distributed.run --standalone``, gloo on CPU) on 2 and 4 ranks, sharded by DMP with
`CachedEmbeddingBagCollectionSharder` (``t0`` row-wise, ``t1`` table-wise, a tenth of each
shard cached on the host tier, and on Redis for 2 ranks), 20 steps (`tests/dmp/dlrm_worker.py`),
against one process: the same DLRM over an unsharded `CachedEmbeddingBagCollection` on the
concatenated global batches, from the rows and dense weights the sharded run started with,
trained on the mean of the ranks' losses (torchrec divides the rows' gradients by the world
size, DDP averages the dense ones). Each step's logits, the final tables, their AdaGrad state,
the dense weights and the dense Adagrad state agree to 1e-5.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagConfig

import embcache
from tests.dmp import dlrm_worker as w
from tests.dmp.test_dmp import _whole
from tests.kv.redis_servers import running_server

ROOT = Path(__file__).resolve().parents[2]
RTOL, ATOL = 1e-5, 1e-5
CASES = [(2, "HostKV"), (4, "HostKV"), (2, "RedisKV")]


def torchrun(world: int, out: Path, store: str | None) -> list[dict]:
    """The worker on ``world`` ranks under torchrun; each rank's results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world),
        str(ROOT / "tests/dmp/dlrm_worker.py"),
        str(out),
        *([store] if store else []),
    ]
    start = time.monotonic()
    run = subprocess.run(args, cwd=out, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    print(f"torchrun {world} ranks: {time.monotonic() - start:.1f} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rows_of(t: EmbeddingBagConfig) -> tuple[int, int]:
    return (t.num_embeddings, t.embedding_dim)


def reference(runs: list[dict]) -> dict:
    """One process, every row cached, from the sharded run's initial rows and dense weights."""
    world = len(runs)
    torch.manual_seed(0)  # the worker's seed: the same dense weights
    ebc = embcache.CachedEmbeddingBagCollection(
        w.TABLES, optimizer_type=torch.optim.Adagrad, optimizer_kwargs={"lr": w.LR, "eps": w.EPS}
    )
    model = w.dlrm(ebc)
    tables = {}
    for t in w.TABLES:
        rows = _whole(runs, f"{w.EBC}.embedding_bags.{t.name}.weight", "initial", rows_of(t))
        assert not torch.isnan(rows).any(), f"{t.name}: a shard is missing from state_dict()"
        tables[f"embedding_bags.{t.name}.weight"] = rows
    ebc.load_state_dict(tables)
    initial_dense = {k: v[0][1] for k, v in runs[0]["initial"].items() if not k.startswith(w.EBC)}
    for k, v in model.state_dict().items():
        if not k.startswith(w.EBC):
            assert torch.equal(v, initial_dense[k]), f"{k}: another dense init than the worker's"
    assert set(initial_dense) == {k for k in model.state_dict() if not k.startswith(w.EBC)}
    dense_params = {n: p for n, p in model.named_parameters() if not n.startswith(w.EBC)}
    assert sorted(dense_params) == runs[0]["dense_params"]
    dense_opt = torch.optim.Adagrad(list(dense_params.values()), lr=w.DENSE_LR)
    outputs = []
    for step in range(w.STEPS):
        parts = [w.batch(step, r) for r in range(world)]
        logits = model(torch.cat([p[0] for p in parts]), w.kjt_of([p[1] for p in parts]))
        outputs.append(logits.detach().clone())
        loss = (
            sum(w.loss_of(logits[r * w.B : (r + 1) * w.B], parts[r][2]) for r in range(world))
            / world
        )
        dense_opt.zero_grad()
        loss.backward()  # the rows' AdaGrad runs in backward
        dense_opt.step()
    ebc.flush()
    return {
        "outputs": outputs,
        "tables": ebc.state_dict(),
        "opt_state": ebc.fused_optimizer().state_dict()["state"],
        "dense": {k: v for k, v in model.state_dict().items() if not k.startswith(w.EBC)},
        "dense_state": {n: dense_opt.state[p]["sum"] for n, p in dense_params.items()},
    }


@pytest.mark.parametrize(("world", "tier"), CASES, ids=[f"{n}_ranks_{tier}" for n, tier in CASES])
def test_torchrun_dlrm_trains_like_one_process(world: int, tier: str, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        store = None
        if tier == "RedisKV":
            server = stack.enter_context(running_server(tmp_path / "redis"))
            store = f"{server.url}?namespace=dlrm"
        runs = torchrun(world, tmp_path, store)
    for run in runs:
        assert run["world"] == world
        assert run["plan"] == {t: (s, "customized_kernel") for t, s in w.SHARDING.items()}
        assert run["shards"] == {"t0": world, "t1": 1}
        assert run["tiers"] == [tier]
        assert run["evictions"] > 0  # each shard cached a tenth of its rows
        for _, rows, slots in run["slots"]:
            assert slots == -(-rows // 10), (rows, slots)
    ref = reference(runs)
    worst: dict[str, float] = {}

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
        worst[what] = max(worst.get(what, 0.0), float((got - want).abs().max()))

    for step in range(w.STEPS):
        for rank, run in enumerate(runs):
            want = ref["outputs"][step][rank * w.B : (rank + 1) * w.B]
            check("outputs", run["outputs"][step], want)
    for t in w.TABLES:
        key = f"{w.EBC}.embedding_bags.{t.name}.weight"
        got = _whole(runs, key, "final", rows_of(t))
        check("tables", got, ref["tables"][f"embedding_bags.{t.name}.weight"])
        assert not torch.equal(got, _whole(runs, key, "initial", rows_of(t))), "nothing trained"
        opt = [{"opt": run["opt_state"].get(key, {})} for run in runs]
        got = _whole(opt, f"{t.name}.momentum1", "opt", rows_of(t))
        want = ref["opt_state"][f"{t.name}.weight"][f"{t.name}.weight.momentum_1"]
        check("table_opt_state", got, want.reshape(rows_of(t)))
    for run in runs:  # DDP kept the ranks' dense parts equal
        for k, want in ref["dense"].items():
            check("dense", run["final"][k][0][1], want)
        for n, want in ref["dense_state"].items():
            check("dense_opt_state", run["dense_state"][n], want)
    print(f"{world} ranks, {tier}: max |torchrun - one process|:", worst)
