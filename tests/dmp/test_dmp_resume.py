"""A DCP checkpoint at step 10, new processes, resume to step 20: the same tables, fused
optimizer state and outputs as 20 uninterrupted steps (2 gloo ranks, CPU; ``t0`` row-wise and
``t1`` table-wise in one plan, a tenth of each shard cached on the host tier or on Redis, each
model in a namespace of its own).

The checkpoint is what torchrec users save: ``{"model": dmp.state_dict(), "optim":
dmp.fused_optimizer.state_dict()}`` through ``torch.distributed.checkpoint``. The LR
scheduler's state is saved per rank beside it, and the resuming job sets the optimizer's rates
from it, handed to the rows by ``zero_grad()``: torchrec's keyed optimizers leave
``param_groups`` out of their state dict by default, and with ``save_param_groups(True)`` DCP
keeps one rank's groups where the ranks' differ (here rank 0 holds ``t1``'s group, rank 1 does
not). The resuming job builds its model from another seed (its shards draw other rows), loads
the checkpoint in place (``dcp.load``, then ``load_state_dict`` of both) and trains on; its
caches start empty, the uninterrupted run's hold the rows of the last steps.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from embcache.distributed.launch import spawn
from tests.dmp.test_dmp_pipeline import _max_diff
from tests.dmp.training import batches, build_dmp, schedule_of, snapshot, tiers, train_plainly
from tests.kv.redis_servers import running_server

STEPS, SAVE_AT = 20, 10
SHARDING = {"t0": "row_wise", "t1": "table_wise"}


def _store(redis: str | None, name: str) -> str | None:
    """A model's tier: the host (None), or its own namespace on the Redis server."""
    return None if redis is None else f"{redis}?namespace={name}"


def _first_job(rank: int, world_size: int, where: str, redis: str | None) -> dict:
    """20 uninterrupted steps; then a second model from the same seed that stops at step 10
    and saves a checkpoint."""
    import torch.distributed.checkpoint as dcp

    whole = build_dmp(world_size, SHARDING, store=_store(redis, "whole"))
    initial = snapshot(whole)["tables"]
    outputs = train_plainly(whole, batches(rank, range(STEPS)), schedule_of(whole))

    saved = build_dmp(world_size, SHARDING, store=_store(redis, "saved"))
    assert _max_diff(snapshot(saved)["tables"], initial) == 0.0
    schedule = schedule_of(saved)
    train_plainly(saved, batches(rank, range(SAVE_AT)), schedule)
    dcp.save(
        {"model": saved.state_dict(), "optim": saved.fused_optimizer.state_dict()},
        checkpoint_id=where,
    )
    torch.save(schedule.state_dict(), f"{where}/schedule.{rank}.pt")
    return {"initial": initial, "outputs": outputs, "end": snapshot(whole), "tiers": tiers(whole)}


def _resumed_job(rank: int, world_size: int, where: str, redis: str | None) -> dict:
    """A new model (other rows, an empty namespace), the checkpoint loaded, steps 10 to 19."""
    import torch.distributed.checkpoint as dcp

    dmp = build_dmp(world_size, SHARDING, seed=1, store=_store(redis, "resumed"))
    fresh = snapshot(dmp)["tables"]
    target = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.load(target, checkpoint_id=where)
    dmp.load_state_dict(target["model"])
    dmp.fused_optimizer.load_state_dict(target["optim"])
    schedule = schedule_of(dmp)
    schedule.load_state_dict(torch.load(f"{where}/schedule.{rank}.pt"))
    for group, lr in zip(dmp.fused_optimizer.param_groups, schedule.get_last_lr(), strict=True):
        group["lr"] = lr
    dmp.fused_optimizer.zero_grad()  # hands the rate to the rows, as FBGEMM's optimizers'
    outputs = train_plainly(dmp, batches(rank, range(SAVE_AT, STEPS)), schedule)
    return {"fresh": fresh, "outputs": outputs, "end": snapshot(dmp), "tiers": tiers(dmp)}


@pytest.fixture(scope="module", params=["HostKV", "RedisKV"])
def jobs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[dict], list[dict], str]:
    where = tmp_path_factory.mktemp("resume")
    checkpoint = str(where / "step10")
    with contextlib.ExitStack() as stack:
        redis = None
        if request.param == "RedisKV":
            redis = stack.enter_context(running_server(where)).url
        first = spawn(_first_job, 2, args=(2, checkpoint, redis), timeout=120)
        # new processes
        resumed = spawn(_resumed_job, 2, args=(2, checkpoint, redis), timeout=120)
    return first, resumed, request.param


def test_dcp_resume_at_step_10_equals_20_uninterrupted_steps(jobs: tuple) -> None:
    first, resumed, tier = jobs
    worst = 0.0
    for whole, again in zip(first, resumed, strict=True):
        assert whole["tiers"] == again["tiers"] == [tier]
        assert _max_diff(again["fresh"], whole["initial"]) > 0, "the new model drew the same rows"
        for got, want in zip(again["outputs"], whole["outputs"][SAVE_AT:], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            worst = max(worst, float((got - want).abs().max()))
        worst = max(worst, _max_diff(again["end"]["tables"], whole["end"]["tables"]))
        assert whole["end"]["opt_state"].keys() == again["end"]["opt_state"].keys()
        for key, state in whole["end"]["opt_state"].items():
            worst = max(worst, _max_diff(again["end"]["opt_state"][key], state))
    assert worst <= 1e-6, worst
    print(f"{tier}: max |resumed - uninterrupted| = {worst:.3g}")
