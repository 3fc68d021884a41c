"""torchrec's ``TrainPipelineSparseDist`` over DMP with embcache's sharder (2 gloo ranks, CPU)
trains exactly as the plain loop (``zero_grad``, forward, backward, ``step``, the scheduler's
step, as the pipeline orders them): the same batches and steps give the same outputs, tables and
fused optimizer state. The pipeline runs the input dist of batch i+1 (the ids' all-to-all)
before the forward of batch i, through the sharded collection's ``input_dist`` /
``compute_and_output_dist`` split (torchrec's ``PipelinedForward`` replaces its forward).

torchrec's ``PrefetchTrainPipelineSparseDist`` does not run on a CPU: its prefetch stage
(``prefetch_embeddings``) returns at once without a data-dist stream (CUDA/MTIA only), so its
``PrefetchPipelinedForward`` finds no prefetched input and asserts
(`test_prefetch_pipeline_needs_cuda` pins that down, to learn when torchrec changes it). On
CUDA it would run, but torchrec's lookups prefetch only FBGEMM's caching kernels, so
embcache's cache would still load its rows in the forward.
"""

from __future__ import annotations

import pytest
import torch

from embcache.distributed.launch import spawn
from tests.dmp.training import (
    batches,
    build_dmp,
    schedule_of,
    snapshot,
    train_plainly,
)

STEPS = 8
SHARDING = {"t0": "row_wise", "t1": "table_wise"}  # both kinds in one plan


def _pipeline_worker(rank: int, world_size: int) -> dict:
    from torchrec.distributed.train_pipeline import (
        PrefetchTrainPipelineSparseDist,
        TrainPipelineSparseDist,
    )
    from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

    from embcache.torchrec import ShardedCachedEmbeddingBagCollection

    out = {}
    data = batches(rank, range(STEPS))
    plain = build_dmp(world_size, SHARDING)
    out["initial"] = snapshot(plain)["tables"]
    out["plain_outputs"] = train_plainly(plain, data, schedule_of(plain), zero_grad=True)
    out["plain"] = snapshot(plain)

    piped = build_dmp(world_size, SHARDING)
    out["piped_initial"] = snapshot(piped)["tables"]
    schedule = schedule_of(piped)
    pipeline = TrainPipelineSparseDist(piped, piped.fused_optimizer, torch.device("cpu"))
    it = iter(data)
    outputs = []
    for _ in range(STEPS):
        outputs.append(pipeline.progress(it).clone())
        schedule.step()
    try:
        pipeline.progress(it)
        out["stopped"] = False
    except StopIteration:
        out["stopped"] = True
    (sharded,) = [m for m in piped.modules() if isinstance(m, ShardedCachedEmbeddingBagCollection)]
    out["pipelined"] = isinstance(sharded.forward, PipelinedForward)
    out["piped_outputs"] = outputs
    out["piped"] = snapshot(piped)

    prefetching = build_dmp(world_size, SHARDING)
    prefetch = PrefetchTrainPipelineSparseDist(
        prefetching, prefetching.fused_optimizer, torch.device("cpu")
    )
    try:
        prefetch.progress(iter(data))
        out["prefetch"] = "ran"
    except AssertionError as e:
        out["prefetch"] = str(e)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_pipeline_worker, 2, args=(2,), timeout=120)


def _max_diff(a: dict, b: dict) -> float:
    """Largest difference between two `_local_shards` dicts (same keys, same shards)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        for (oa, ta), (ob, tb) in zip(a[k], b[k], strict=True):
            assert oa == ob, k
            worst = max(worst, float((ta - tb).abs().max()) if ta.numel() else 0.0)
    return worst


def test_train_pipeline_sparse_dist_trains_like_the_plain_loop(two_ranks: list[dict]) -> None:
    worst = 0.0
    for run in two_ranks:
        assert run["pipelined"], "the pipeline did not take over the sharded collection"
        assert run["stopped"], "the pipeline ran past the data"
        assert _max_diff(run["initial"], run["piped_initial"]) == 0.0
        assert len(run["piped_outputs"]) == STEPS
        for got, want in zip(run["piped_outputs"], run["plain_outputs"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            worst = max(worst, float((got - want).abs().max()))
        worst = max(worst, _max_diff(run["piped"]["tables"], run["plain"]["tables"]))
        for key, state in run["plain"]["opt_state"].items():
            worst = max(worst, _max_diff(run["piped"]["opt_state"][key], state))
        assert _max_diff(run["plain"]["tables"], run["initial"]) > 0, "nothing trained"
    assert worst <= 1e-6, worst
    print(f"max |pipeline - plain loop| = {worst:.3g}")


def test_prefetch_pipeline_needs_cuda(two_ranks: list[dict]) -> None:
    """torchrec's prefetch pipeline does not run on a CPU (see the module docstring): when
    this fails, torchrec runs it there, and it belongs beside the test above."""
    for run in two_ranks:
        assert "Invalid PrefetchPipelinedForward usage" in run["prefetch"], run["prefetch"]
