"""Row-wise sharded training (gloo on CPU, 2 and 3 ranks spawned here) against one process.

Each scenario trains a `ShardedEmbeddingBagCollection` for a few steps, every rank on its own
part of each global batch, and a single-process `CachedEmbeddingBagCollection` (same tables,
same seed, whole tables cached) on the concatenated global batch with the loss summed over the
ranks' losses, so both see the same gradients. Outputs, tables (gathered by ``state_dict``) and
optimizer state must agree to RTOL = 1e-5, ATOL = 1e-6: the sharded run sums a row's gradient per
rank and then over ranks, one process sums it in one pass, and float32 addition is not
associative; nothing else differs. Forward outputs of the first step are bit-identical.

Layout: three tables over two dims (t0 and t1 share a cache, t2 has its own) with SUM, MEAN and
MAX pooling, t0 looked up by two features. Scenarios cover uneven batches, ranks with empty
batches (and a step where every rank is empty), ids that all land on one owner, a cache much
smaller than the rows a batch touches (evictions and scratch rows), per-sample weights, SGD and
AdaGrad, RowWiseAdaGrad (applied inside backward), Adam, and gradients accumulated over two
passes per step; then refused input, mismatched calls and an owner that cannot serve. The ranks
run in one `spawn` per world size (module-scoped fixtures); three more spawns check that a rank
which raises, exits or hangs makes the job fail fast with its error.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import embcache
from embcache.distributed.launch import SpawnError, spawn
from embcache.distributed.sharded import ShardedEmbeddingBagCollection, owner_of
from embcache.kernels.cache_index import set_index

RTOL, ATOL = 1e-5, 1e-6
FUSION_K = 30
TABLES = [
    EmbeddingBagConfig(
        name="t0",
        embedding_dim=6,
        num_embeddings=300,
        feature_names=["f0", "f1"],
        pooling=PoolingType.SUM,
    ),
    EmbeddingBagConfig(
        name="t1",
        embedding_dim=6,
        num_embeddings=250,
        feature_names=["f2"],
        pooling=PoolingType.MEAN,
    ),
    # torchrec's PoolingType has no MAX; the collections take it in a dict config.
    {"name": "t2", "embedding_dim": 5, "num_embeddings": 200, "feature_names": ["f3"],
     "pooling": "max"},
]  # fmt: skip
FEATURES = ["f0", "f1", "f2", "f3"]
FEATURE_TABLE = {"f0": (0, 300), "f1": (0, 300), "f2": (1, 250), "f3": (2, 200)}


@dataclass(frozen=True)
class Scenario:
    name: str
    optimizer: str  # "sgd" or "adagrad"
    batch_sizes: tuple[tuple[int, ...], ...]  # [step][rank]
    cache: embcache.CacheConfig | None = None
    one_owner: bool = False  # every id is owned by rank 0
    weighted: bool = False
    passes_per_step: int = 1  # forward/backward passes summed into one step (accumulate_grads)
    update_in_backward: bool = False


SCENARIOS_2 = [
    Scenario("sgd_even", "sgd", ((4, 4),) * 3),
    Scenario(
        "adagrad_uneven_small_cache",
        "adagrad",
        ((5, 2), (1, 6), (3, 3)),
        cache=embcache.CacheConfig(capacity=12, ways=4),
    ),
    Scenario(
        "adagrad_empty_ranks",
        "adagrad",
        ((4, 0), (0, 5), (0, 0), (3, 2)),
        cache=embcache.CacheConfig(load_factor=0.5, policy="lfu"),
    ),
    Scenario("sgd_one_owner", "sgd", ((3, 4), (2, 2), (5, 1)), one_owner=True),
    Scenario("adagrad_accumulate", "adagrad", ((3, 2), (0, 4), (2, 2), (1, 1)), passes_per_step=2),
    Scenario("rowwise_update_in_backward", "rowwise", ((2, 3), (4, 1)), update_in_backward=True),
]
SCENARIOS_3 = [
    Scenario("sgd_weighted_3", "sgd", ((2, 0, 5), (3, 3, 1), (0, 4, 2)), weighted=True),
    Scenario("adam_3", "adam", ((2, 2, 2), (0, 3, 1), (4, 0, 0))),
    Scenario(
        "adagrad_small_cache_3",
        "adagrad",
        ((3, 2, 4), (1, 0, 6), (2, 2, 2)),
        cache=embcache.CacheConfig(capacity=8, ways=2),
    ),
]


# ----------------------------------------------------------------------------------------------
# the data: each rank's part of a global batch


def _owned_by_zero(table: int, rows: int, world_size: int) -> torch.Tensor:
    ids = torch.arange(rows)
    return ids[owner_of(ids | (table << FUSION_K), world_size) == 0]


def rank_parts(sc: Scenario, step: int, rank: int, world_size: int) -> dict:
    """Per feature: lengths [B] and values (and weights) of one rank's part of a step's batch.

    Every part with B > 0 has an empty bag, duplicate ids and the table's last row (when the
    scenario lets that row live on any rank)."""
    B = sc.batch_sizes[step][rank]
    seed = zlib.crc32(f"{sc.name}/{step}/{rank}".encode())
    gen = torch.Generator().manual_seed(seed)
    parts = {}
    for i, f in enumerate(FEATURES):
        table, rows = FEATURE_TABLE[f]
        lengths = torch.randint(0, 5, (B,), generator=gen)
        if B:
            lengths[0] = 0 if i == 0 else max(int(lengths[0]), 3)
        n = int(lengths.sum())
        if sc.one_owner:
            pool = _owned_by_zero(table, rows, world_size)
            values = pool[torch.randint(0, pool.numel(), (n,), generator=gen)]
        else:
            values = torch.randint(0, rows, (n,), generator=gen)
            if n >= 3:
                values[2] = rows - 1
        if n >= 2:
            values[1] = values[0]
        weights = torch.rand(n, generator=gen) + 0.5
        parts[f] = (lengths, values, weights)
    return parts


def to_kjt(parts_by_rank: list[dict], weighted: bool) -> KeyedJaggedTensor:
    """The KJT of the concatenation of ranks' parts (samples of rank 0 first)."""
    lengths, values, weights = [], [], []
    for f in FEATURES:
        for parts in parts_by_rank:
            ln, v, w = parts[f]
            lengths.append(ln)
            values.append(v)
            weights.append(w)
    return KeyedJaggedTensor(
        keys=FEATURES,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weighted else None,
    )


def make_collection(sc: Scenario, cls, **kwargs):
    return cls(
        TABLES,
        seed=0,  # the same rows in every process and in the one-process reference
        is_weighted=sc.weighted,
        update_in_backward=sc.update_in_backward,
        accumulate_grads=sc.passes_per_step > 1,
        **kwargs,
    )


def make_optimizer(sc: Scenario, ebc):
    if sc.optimizer == "sgd":
        return embcache.SparseSGD([ebc], lr=0.05)
    if sc.optimizer == "rowwise":
        return embcache.SparseRowWiseAdaGrad([ebc], lr=0.1)
    if sc.optimizer == "adam":
        return embcache.SparseAdam([ebc], lr=0.01)
    return embcache.SparseAdaGrad([ebc], lr=0.1, initial_accumulator_value=0.01)


def optimizer_state(opt) -> dict:
    """``{table: {name: tensor}}`` of the optimizer's one collection."""
    (state,) = opt.state_dict()["state"]
    return state


def loss_of(values: torch.Tensor) -> torch.Tensor:
    return (values * values).sum() + values[:, ::2].sum()


# ----------------------------------------------------------------------------------------------
# what the ranks run


def _train(sc: Scenario, rank: int, world_size: int) -> dict:
    ebc = make_collection(sc, ShardedEmbeddingBagCollection, cache=sc.cache)
    opt = make_optimizer(sc, ebc)
    outputs = []
    for step in range(len(sc.batch_sizes)):
        kjt = to_kjt([rank_parts(sc, step, rank, world_size)], sc.weighted)
        values = ebc(kjt).values()
        outputs.append(values.detach().clone())
        loss_of(values).backward()
        if (step + 1) % sc.passes_per_step == 0:
            opt.step()
    with torch.no_grad():
        kjt = to_kjt([rank_parts(sc, 0, rank, world_size)], sc.weighted)
        evaluated = ebc(kjt).values().clone()
    locked = sum(c.locked_slots() for c in ebc.caches())
    ebc.flush()
    return {
        "outputs": outputs,
        "eval": evaluated,
        "tables": ebc.state_dict(),
        "state": optimizer_state(opt),
        "local_stats": ebc.cache_stats(),
        "global_stats": ebc.cache_stats(all_ranks=True),
        "comm": ebc.comm_stats(),
        "locked": locked,
    }


def _refusals(rank: int, world_size: int) -> dict:
    """Bad input on one rank, mismatched calls, a pending trace: every rank raises, nothing
    changes, and training goes on afterwards."""
    sc = SCENARIOS_2[0]
    ebc = ShardedEmbeddingBagCollection(TABLES)
    opt = make_optimizer(sc, ebc)
    before = ebc.state_dict()
    good = to_kjt([rank_parts(sc, 0, rank, world_size)], False)
    errors = {}

    bad = good
    if rank == 1:
        values = good.values().clone()
        values[-1] = 10_000  # f3 looks up t2, 200 rows
        bad = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=good.lengths())
    try:
        ebc(bad)
    except Exception as e:
        errors["bad_id"] = f"{type(e).__name__}: {e}"

    try:
        if rank == 0:
            with torch.no_grad():
                ebc(good)
        else:
            ebc(good)
    except Exception as e:
        errors["mismatch"] = f"{type(e).__name__}: {e}"
    refused_unchanged = all(torch.equal(v, ebc.state_dict()[k]) for k, v in before.items())
    refused_locked = sum(c.locked_slots() for c in ebc.caches())

    loss_of(ebc(good).values()).backward()
    if rank == 1:
        opt.step()
    try:
        ebc(good)
    except Exception as e:
        errors["pending"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        opt.step()
    loss_of(ebc(good).values()).backward()  # training still works afterwards
    opt.step()

    # An owner whose cache cannot hold what it is asked (no scratch area): every rank raises,
    # no slot stays locked, and a batch that fits goes through afterwards.
    tiny = ShardedEmbeddingBagCollection(
        TABLES, cache=embcache.CacheConfig(capacity=4, ways=4, max_scratch_rows=0)
    )
    tiny_opt = make_optimizer(sc, tiny)
    before = tiny.state_dict()
    crowd = to_kjt([rank_parts(SCENARIOS_2[3], 0, rank, world_size)], False)  # all on rank 0
    try:
        tiny(crowd)
    except Exception as e:
        errors["capacity"] = f"{type(e).__name__}: {e}"
    locked = sum(c.locked_slots() for c in tiny.caches())
    unchanged = all(torch.equal(v, tiny.state_dict()[k]) for k, v in before.items())
    one_id = KeyedJaggedTensor(
        keys=FEATURES, values=torch.tensor([rank]), lengths=torch.tensor([1, 0, 0, 0])
    )
    loss_of(tiny(one_id).values()).backward()
    tiny_opt.step()
    return {
        "errors": errors,
        "refused_unchanged": refused_unchanged and refused_locked == 0,
        "locked_after_failure": locked,
        "unchanged": unchanged,
    }


def _worker(rank: int, scenarios: list[Scenario], with_refusals: bool) -> dict:
    world_size = torch.distributed.get_world_size()
    out = {sc.name: _train(sc, rank, world_size) for sc in scenarios}
    if with_refusals:
        out["refusals"] = _refusals(rank, world_size)
    return out


def _failing_worker(rank: int, how: str) -> None:
    sc = SCENARIOS_2[0]
    ebc = ShardedEmbeddingBagCollection(TABLES)
    opt = make_optimizer(sc, ebc)
    for step in range(3):
        if rank == 1 and step == 1:
            if how == "raise":
                raise ValueError("injected failure on rank 1")
            if how == "exit":
                import os

                os._exit(7)
            time.sleep(120)  # "hang": never reach the collective
        kjt = to_kjt([rank_parts(sc, step, rank, 2)], False)
        loss_of(ebc(kjt).values()).backward()
        opt.step()


# ----------------------------------------------------------------------------------------------
# the single-process reference


def reference(sc: Scenario, world_size: int) -> dict:
    ebc = make_collection(sc, embcache.CachedEmbeddingBagCollection)
    opt = make_optimizer(sc, ebc)
    outputs = []
    for step, sizes in enumerate(sc.batch_sizes):
        parts = [rank_parts(sc, step, r, world_size) for r in range(world_size)]
        values = ebc(to_kjt(parts, sc.weighted)).values()
        outputs.append(torch.split(values.detach().clone(), list(sizes)))
        loss_of(values).backward()  # = the sum of the ranks' losses
        if (step + 1) % sc.passes_per_step == 0:
            opt.step()
    with torch.no_grad():
        parts = [rank_parts(sc, 0, r, world_size) for r in range(world_size)]
        evaluated = torch.split(ebc(to_kjt(parts, sc.weighted)).values(), list(sc.batch_sizes[0]))
    return {
        "outputs": outputs,
        "eval": evaluated,
        "tables": ebc.state_dict(),
        "state": optimizer_state(opt),
    }


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    diff = (actual.double() - expected.double()).abs()
    bound = ATOL + RTOL * expected.double().abs()
    if bool((diff > bound).any()):
        worst = int(torch.argmax(diff - bound))
        raise AssertionError(
            f"{what}: {int((diff > bound).sum())} of {diff.numel()} elements differ; worst at "
            f"flat index {worst}: {actual.flatten()[worst]} vs {expected.flatten()[worst]}"
        )


# ----------------------------------------------------------------------------------------------
# fixtures and tests


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_worker, 2, args=(SCENARIOS_2, True), timeout=60)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    return spawn(_worker, 3, args=(SCENARIOS_3, False), timeout=60)


def _check_against_reference(runs: list[dict], sc: Scenario) -> None:
    world_size = len(runs)
    ref = reference(sc, world_size)
    for rank, run in enumerate(runs):
        res = run[sc.name]
        for step, out in enumerate(res["outputs"]):
            assert_close(out, ref["outputs"][step][rank], f"rank {rank} step {step} output")
        assert torch.equal(res["outputs"][0], ref["outputs"][0][rank]), "first step not exact"
        assert_close(res["eval"], ref["eval"][rank], f"rank {rank} no_grad output")
        for key, table in ref["tables"].items():
            assert_close(res["tables"][key], table, f"rank {rank} {key}")
        for table, parts in ref["state"].items():
            for name, state in parts.items():
                assert_close(res["state"][table][name], state, f"rank {rank} {table}.{name}")
        assert res["locked"] == 0, "slots still locked after the last step"
    for key in ref["tables"]:  # every rank gathered the same tables
        assert all(
            torch.equal(run[sc.name]["tables"][key], runs[0][sc.name]["tables"][key])
            for run in runs
        )


@pytest.mark.parametrize("sc", SCENARIOS_2, ids=lambda sc: sc.name)
def test_two_ranks_match_one_process(two_ranks: list[dict], sc: Scenario) -> None:
    _check_against_reference(two_ranks, sc)


@pytest.mark.parametrize("sc", SCENARIOS_3, ids=lambda sc: sc.name)
def test_three_ranks_match_one_process(three_ranks: list[dict], sc: Scenario) -> None:
    _check_against_reference(three_ranks, sc)


def test_one_owner_serves_every_lookup(two_ranks: list[dict]) -> None:
    zero, one = (run["sgd_one_owner"]["local_stats"] for run in two_ranks)
    assert zero["hits"] + zero["misses"] > 0
    assert one["hits"] + one["misses"] == 0
    totals = two_ranks[1]["sgd_one_owner"]["global_stats"]
    assert totals["hits"] + totals["misses"] == zero["hits"] + zero["misses"]
    # Rank 1 sends its ids and gradients to rank 0, rank 0 sends rank 1 its rows.
    comm = [run["sgd_one_owner"]["comm"] for run in two_ranks]
    assert comm[0]["bytes_to_peers"] > 0 and comm[1]["bytes_to_peers"] > 0


def test_small_cache_evicts_and_still_matches(two_ranks: list[dict]) -> None:
    totals = two_ranks[0]["adagrad_uneven_small_cache"]["global_stats"]
    assert totals["evictions"] > 0


def test_refused_input_raises_on_every_rank_and_changes_nothing(two_ranks: list[dict]) -> None:
    zero, one = (run["refusals"] for run in two_ranks)
    assert one["errors"]["bad_id"].startswith("ValueError")
    assert "feature 'f3'" in one["errors"]["bad_id"] and "10000" in one["errors"]["bad_id"]
    assert "rank(s) [1] refused their input" in zero["errors"]["bad_id"]
    for run in (zero, one):
        assert "mismatched collective calls" in run["errors"]["mismatch"]
        assert (
            "(no_grad)" in run["errors"]["mismatch"] and "(training)" in run["errors"]["mismatch"]
        )
    assert "previous backward's gradients are still in _trace" in zero["errors"]["pending"]
    assert "rank(s) [0] refused their input" in one["errors"]["pending"]
    assert zero["refused_unchanged"] and one["refused_unchanged"]


def test_an_owner_that_cannot_serve_fails_every_rank(two_ranks: list[dict]) -> None:
    zero, one = (run["refusals"] for run in two_ranks)
    assert zero["errors"]["capacity"].startswith("CacheCapacityError")
    assert "owner rank(s) [0] failed to serve" in one["errors"]["capacity"]
    for run in (zero, one):
        assert run["locked_after_failure"] == 0
        assert run["unchanged"]


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_rank_fails_the_job_fast(how: str) -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(_failing_worker, 2, args=(how,), timeout=20)
    elapsed = time.monotonic() - start
    err = info.value
    text = str(err)
    assert err.rank == 1, text
    if how == "raise":
        assert "ValueError on rank 1: injected failure on rank 1" in text
    else:
        assert "rank 1 of the spawned job failed:\nexited with code 7" in text
    assert "then rank 0 failed too: CollectiveError" in text, text
    # Rank 0 notices at once (the peer's connection closes), not after the 20 s timeout.
    assert err.elapsed_s < 15, f"the job took {err.elapsed_s:.1f} s to fail after rank 1 did"
    assert elapsed < 180  # start-up included, on a loaded 2-core machine


def test_a_hanging_rank_times_out_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(_failing_worker, 2, args=("hang",), timeout=5, grace=2)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert info.value.rank == 0, text
    assert "CollectiveError on rank 0" in text and "timeout" in text
    assert "then rank 1 failed too: still running 2 s after another rank failed; terminated" in text
    # The messages above show the timeout and the grace ended it; this bounds the rest
    # (start-up and a step, then 5 s of timeout and 2 s of grace) even on a loaded 2-core
    # machine, where start-up alone took 25 s (a job that waited forever never returns).
    assert elapsed < 180, f"took {elapsed:.1f} s"


def test_owner_hash_is_balanced_and_independent_of_the_cache_set() -> None:
    fused = torch.arange(100_000) | (3 << FUSION_K)
    owners = owner_of(fused, 2)
    assert torch.equal(owners, owner_of(fused.flip(0), 2).flip(0))
    counts = torch.bincount(owners, minlength=2)
    assert abs(int(counts[0]) - int(counts[1])) < 1_000
    # Unsalted, the owner would be the parity of the set index: each rank would use half its
    # sets. Salted, the ids of one owner cover both parities evenly.
    sets = set_index(fused[owners == 0], 64)
    parity = torch.bincount(sets % 2, minlength=2)
    assert abs(int(parity[0]) - int(parity[1])) < 1_000
