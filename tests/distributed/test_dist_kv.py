"""ShardedKVClient across 2 ranks (gloo on CPU): pull, push, update_async and add_async.

Both ranks run one script (one `spawn`); each call is a collective that every rank makes with its
own ids, some of them empty. The reference is one in-process `KVClient` given the same calls:
its default initialiser depends on (tensor, id) alone, so pulled and pushed rows must equal it
exactly. ``update_async`` hands one call's gradients, summed over the ranks, to the tensor's
backend optimizer (AdaGrad here, so applying each rank's share separately would differ); the
reference gets the ranks' gradients of a call in one call. Updates agree to float32 rounding
(torch.testing defaults): the sums run in another order.
"""

from __future__ import annotations

import pytest
import torch

from embcache.distributed.launch import spawn
from embcache.distributed.sharded import ShardedKVClient, kv_owner_of
from embcache.recstore.kv_client import KVClient, KVOptimizer

ROWS, DIM = 97, 5
ADAGRAD = KVOptimizer("AdaGrad", lr=0.1)


def _ids(rank: int, step: int) -> torch.Tensor:
    """Each rank's ids of a step: overlapping between ranks, with duplicates."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, ROWS, (7 + 3 * rank,), generator=gen)
    ids[1] = ids[0]
    return ids


def _deltas(rank: int, step: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + 100 * step + rank)
    return torch.randn(n, DIM, generator=gen)


def _kv_worker(rank: int) -> dict:
    kv = ShardedKVClient()
    out: dict = {}
    kv.init_data("emb", (ROWS, DIM), optimizer=ADAGRAD)
    kv.init_data("emb", (ROWS, DIM), optimizer=ADAGRAD)  # the same again is a no-op
    out["pull_initial"] = kv.pull("emb", torch.arange(ROWS) if rank == 0 else [])
    out["pull_2d"] = kv.pull("emb", torch.tensor([[3, 3], [96, 0]]) if rank == 1 else [])

    # push: disjoint ids per rank, then an id pushed by both (the highest rank wins)
    pushed = torch.tensor([5, 6, 7]) if rank == 0 else torch.tensor([10, 11])
    kv.push("emb", pushed, torch.full((pushed.numel(), DIM), float(rank + 1)))
    kv.push("emb", torch.tensor([20]), torch.full((1, DIM), 10.0 * (rank + 1)))
    out["after_push"] = kv.pull("emb", torch.tensor([5, 6, 7, 10, 11, 20]))

    # update_async twice on overlapping ids, a rank with none in the second round
    handles = []
    for step in range(2):
        ids = _ids(rank, step) if (step == 0 or rank == 0) else torch.empty(0, dtype=torch.int64)
        handles.append(kv.update_async("emb", ids, _deltas(rank, step, ids.numel())))
    for h in handles:
        kv.wait(h)
    kv.flush()
    out["after_update"] = kv.pull("emb", torch.arange(ROWS))
    ids = _ids(rank, 2)
    kv.wait(kv.add_async("emb", ids, _deltas(rank, 2, ids.numel())))
    kv.flush()
    out["after_add"] = kv.pull("emb", torch.arange(ROWS))

    # ids that all live on one owner
    all_ids = torch.arange(ROWS)
    on_zero = all_ids[kv_owner_of("emb", all_ids, 2) == 0]
    out["one_owner"] = kv.pull("emb", on_zero)

    # init_func runs on rank 0 only: the ranks' generators differ, rank 0's rows win
    kv.init_data("rand", (11, 3), init_func=lambda shape, dtype: torch.randn(shape) + rank)
    out["rand"] = kv.pull("rand", torch.arange(11))

    # prefetch / wait_and_get
    out["prefetched"] = kv.wait_and_get(kv.prefetch("emb", torch.tensor([20, 5])))

    # refusals: bad ids on one rank, mismatched calls; both ranks raise, then go on
    errors = {}
    try:
        kv.pull("emb", torch.tensor([ROWS + 5]) if rank == 1 else torch.tensor([1]))
    except Exception as e:
        errors["bad_id"] = f"{type(e).__name__}: {e}"
    try:
        if rank == 0:
            kv.pull("emb", [1])
        else:
            kv.push("emb", [1], torch.zeros(1, DIM))
    except Exception as e:
        errors["mismatch"] = f"{type(e).__name__}: {e}"
    try:
        kv.pull("emb" if rank == 0 else "rand", [1])
    except Exception as e:
        errors["names"] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    out["after_errors"] = kv.pull("emb", torch.arange(ROWS))
    out["comm"] = kv.comm_stats()
    kv.close()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return spawn(_kv_worker, 2, timeout=60)


@pytest.fixture(scope="module")
def reference() -> dict:
    kv = KVClient()
    kv.init_data("emb", (ROWS, DIM), optimizer=ADAGRAD)
    ref = {"initial": kv.pull("emb", torch.arange(ROWS))}
    for rank, pushed in ((0, [5, 6, 7]), (1, [10, 11])):
        kv.push("emb", pushed, torch.full((len(pushed), DIM), float(rank + 1)))
    kv.push("emb", [20], torch.full((1, DIM), 20.0))
    ref["after_push"] = kv.pull("emb", torch.tensor([5, 6, 7, 10, 11, 20]))
    for step in range(2):
        ranks = (0, 1) if step == 0 else (0,)
        ids = [_ids(rank, step) for rank in ranks]
        grads = [_deltas(rank, step, i.numel()) for rank, i in zip(ranks, ids, strict=True)]
        kv.update_async("emb", torch.cat(ids), torch.cat(grads))  # one call, both ranks' share
    kv.flush()
    ref["after_update"] = kv.pull("emb", torch.arange(ROWS))
    for rank in (0, 1):
        ids = _ids(rank, 2)
        kv.add_async("emb", ids, _deltas(rank, 2, ids.numel()))
    kv.flush()
    ref["after_add"] = kv.pull("emb", torch.arange(ROWS))
    kv.close()
    return ref


def test_pull_sees_the_default_rows(runs: list[dict], reference: dict) -> None:
    assert torch.equal(runs[0]["pull_initial"], reference["initial"])
    assert runs[1]["pull_initial"].shape == (0, DIM)
    assert torch.equal(runs[1]["pull_2d"], reference["initial"][torch.tensor([3, 3, 96, 0])])
    assert runs[0]["pull_2d"].shape == (0, DIM)


def test_push_reaches_every_rank_and_the_highest_rank_wins(runs, reference) -> None:
    for run in runs:
        assert torch.equal(run["after_push"], reference["after_push"])
        assert bool((run["after_push"][-1] == 20.0).all())


def test_update_async_steps_the_backend_optimizer_on_every_ranks_gradients(
    runs: list[dict], reference: dict
) -> None:
    for run in runs:
        torch.testing.assert_close(run["after_update"], reference["after_update"])
        assert not torch.equal(run["after_update"], reference["initial"])


def test_add_async_adds_every_rank_delta(runs: list[dict], reference: dict) -> None:
    for run in runs:
        torch.testing.assert_close(run["after_add"], reference["after_add"])


def test_ids_of_one_owner_and_prefetch(runs: list[dict], reference: dict) -> None:
    owner_zero = torch.arange(ROWS)[kv_owner_of("emb", torch.arange(ROWS), 2) == 0]
    assert 0 < owner_zero.numel() < ROWS
    for run in runs:
        torch.testing.assert_close(run["one_owner"], reference["after_add"][owner_zero])
        torch.testing.assert_close(run["prefetched"], reference["after_add"][torch.tensor([20, 5])])


def test_init_func_runs_on_rank_zero(runs: list[dict]) -> None:
    assert torch.equal(runs[0]["rand"], runs[1]["rand"])
    assert float(runs[0]["rand"].mean()) < 0.5  # rank 0's randn + 0, not rank 1's randn + 1


def test_refusals_raise_on_both_ranks_and_change_nothing(runs, reference) -> None:
    zero, one = runs[0]["errors"], runs[1]["errors"]
    assert one["bad_id"].startswith("ValueError") and "out of range" in one["bad_id"]
    assert "rank(s) [1] refused their input to ShardedKVClient.pull" in zero["bad_id"]
    for errors in (zero, one):
        assert "mismatched collective calls" in errors["mismatch"]
        assert "ShardedKVClient.pull('emb')" in errors["mismatch"]
        assert "ShardedKVClient.push('emb')" in errors["mismatch"]
        assert "pull('rand')" in errors["names"]
    for run in runs:
        torch.testing.assert_close(run["after_errors"], reference["after_add"])
    assert runs[0]["comm"]["bytes_to_peers"] > 0
