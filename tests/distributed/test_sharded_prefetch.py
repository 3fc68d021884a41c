"""Sharded prefetch (gloo on CPU, 2 ranks spawned here): prefetch changes time, not numbers.

Each rank trains a `ShardedEmbeddingBagCollection` twice on its own batches, with and without
prefetch, and compares losses, outputs, the gathered tables and the optimizer state bit for bit:

* `TrainPipeline` with a roomy cache (every forward uses its prefetch: the tier is read on the
  prefetch worker only, and each step makes exactly one more all_to_all than without: two on
  the prefetch group, one fewer in the forward) and with a cache so small that an owner cannot
  hold two batches (its prefetch fails with a `CacheCapacityError` and every rank's forward
  reads synchronously);
* the RecStore calls by hand, with every way the ranks' handles can disagree: one rank sets no
  handle, one holds a handle issued for other features, two prefetches issued before one forward,
  one rank's prefetch input refused (it raises there; the peer's prefetch fails and its forward
  reads synchronously);
* ``embcache train --nproc 2`` with ``--prefetch`` and ``--no-prefetch``: the checkpoints of
  both runs (rows, optimizer state, the DDP-trained MLPs) are equal.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import embcache
from embcache.checkpoint import latest_snapshot
from embcache.distributed.exchange import owner_of
from embcache.distributed.launch import spawn
from embcache.distributed.sharded import ShardedEmbeddingBagCollection
from embcache.train.pipeline import PrefetchFallbackWarning, TrainPipeline

FUSION_K = 30
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=6, num_embeddings=400, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=5, num_embeddings=300, feature_names=["f2"]),
]
FEATURES = {"f0": (0, 400), "f1": (0, 400), "f2": (1, 300)}
WIDTH = 6 + 6 + 5
STEPS = 6


def rank_batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Rank ``rank``'s batch of a step: a KJT (rank 1's third batch is empty) and loss weights."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    size = 0 if (rank, step) == (1, 2) else 3 + (step + rank) % 3
    lengths = torch.randint(0, 4, (len(FEATURES) * size,), generator=gen)
    limits = torch.tensor([rows for _, rows in FEATURES.values()])
    limits = limits.repeat_interleave(size).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=gen) * limits).long()
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=values, lengths=lengths)
    return kjt, torch.randn(size, WIDTH, generator=gen)


def owned_need(rank: int, world: int, steps: int) -> int:
    """The most unique rows one batch of ``steps`` asks of ``rank`` as owner, in one cache."""
    need = 0
    for step in range(steps):
        per_cache: dict[int, set[int]] = {6: set(), 5: set()}
        for r in range(world):
            kjt, _ = rank_batch(step, r)
            for f, (table, _) in FEATURES.items():
                fused = kjt[f].values() | (table << FUSION_K)
                mine = fused[owner_of(fused, world) == rank]
                per_cache[TABLES[table].embedding_dim].update(mine.tolist())
        need = max(need, *(len(ids) for ids in per_cache.values()))
    return need


class RecordingKV(embcache.HostKV):
    """A host tier that records which thread read rows from it."""

    def __init__(self) -> None:
        super().__init__()
        self.readers: list[str] = []

    def get(self, table, ids):
        self.readers.append(threading.current_thread().name)
        return super().get(table, ids)


class Model(nn.Module):
    def __init__(self, cache: embcache.CacheConfig, store: embcache.HostKV) -> None:
        super().__init__()
        # A seed: both runs (with and without prefetch) start from the same rows.
        self.sparse = ShardedEmbeddingBagCollection(TABLES, cache=cache, store=store, seed=0)

    def forward(self, batch) -> torch.Tensor:
        kjt, coeff = batch
        return (self.sparse(kjt).values() * coeff).sum()


def _build(cache: embcache.CacheConfig) -> tuple[Model, embcache.SparseAdaGrad, RecordingKV]:
    store = RecordingKV()
    model = Model(cache, store)
    opt = embcache.SparseAdaGrad([model.sparse], lr=0.1)
    model.sparse.reset_comm_stats()
    store.readers.clear()
    return model, opt, store


def _pipeline_run(cache: embcache.CacheConfig, prefetch: bool, rank: int) -> dict:
    model, opt, store = _build(cache)
    batches = [rank_batch(step, rank) for step in range(STEPS)]
    pipe = TrainPipeline(model, opt, None, features=lambda b: b[0], loss=lambda m, b: m(b),
                         prefetch=prefetch)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PrefetchFallbackWarning)
        losses = pipe.run(batches)
    collectives = model.sparse.comm_stats()["collectives"]
    readers = sorted(set(store.readers))  # before state_dict reads the whole tables
    locked = sum(c.locked_slots() for c in model.sparse.caches())
    return {
        "losses": losses,
        "tables": model.sparse.state_dict(),
        "state": opt.state_dict()["state"],
        "collectives": collectives,
        "readers": readers,
        "fallbacks": pipe.fallbacks,
        "warned": sum(issubclass(w.category, PrefetchFallbackWarning) for w in caught),
        "locked": locked,
    }


def _by_hand(rank: int) -> dict:
    """Every way the ranks' handles can disagree, against a collection trained without."""
    cache = embcache.CacheConfig(capacity=40, ways=4)
    ours, ours_opt, _ = _build(cache)
    plain, plain_opt, _ = _build(cache)
    m = ours.sparse
    outputs, errors = [], {}
    for step in range(6):
        kjt, coeff = rank_batch(step, rank)
        other, _ = rank_batch(step + 10, rank)
        if step == 1 and rank == 0:
            held = m.issue_fused_prefetch(kjt)
            m.set_fused_prefetch_handle(
                None
            )  # rank 0 uses no handle: both ranks read in the forward
        elif step == 2:
            m.issue_fused_prefetch(other if rank == 1 else kjt)  # rank 1's is for other features
        elif step == 3:
            m.issue_fused_prefetch(kjt)
            m.issue_fused_prefetch(kjt)  # the newer one is used, the older released
        elif step == 4:
            bad = KeyedJaggedTensor.from_lengths_sync(
                keys=list(FEATURES), values=torch.tensor([10_000]), lengths=torch.tensor([1, 0, 0])
            )
            try:
                m.issue_fused_prefetch(bad if rank == 1 else kjt)
            except ValueError as e:
                errors["refused"] = f"{type(e).__name__}: {e}"
            if rank == 0:
                errors["peer"] = repr(m.pending_prefetch.wait())
        else:
            m.issue_fused_prefetch(kjt)
        out = m(kjt).values()
        (out * coeff).sum().backward()
        ours_opt.step()
        ref = plain.sparse(kjt).values()
        (ref * coeff).sum().backward()
        plain_opt.step()
        outputs.append(torch.equal(out, ref))
        if step == 1 and rank == 0:
            del held  # dropped: released at the collection's next call
    locked = sum(c.locked_slots() for c in m.caches())
    return {
        "outputs": outputs,
        "tables": m.state_dict(),
        "reference": plain.sparse.state_dict(),
        "errors": errors,
        "locked": locked,
        "pending": m.pending_prefetch is None and not m.engines.prefetches.issued,
    }


def _worker(rank: int) -> dict:
    roomy = embcache.CacheConfig(capacity=64, ways=4, policy="lru")
    need = max(owned_need(r, 2, STEPS) for r in range(2))
    tight = embcache.CacheConfig(capacity=1, ways=1, max_scratch_rows=need)
    return {
        "roomy": {p: _pipeline_run(roomy, p, rank) for p in (False, True)},
        "whole": {
            p: _pipeline_run(embcache.CacheConfig(load_factor=1.0), p, rank) for p in (False, True)
        },
        "tight": {p: _pipeline_run(tight, p, rank) for p in (False, True)},
        "by_hand": _by_hand(rank),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return spawn(_worker, 2, timeout=60)


def _assert_same_training(sync: dict, pre: dict, what: str) -> None:
    assert pre["losses"] == sync["losses"], f"{what}: losses differ"
    for key, value in sync["tables"].items():
        assert torch.equal(pre["tables"][key], value), f"{what}: {key} differs"
    for table, parts in sync["state"][0].items():
        for name, value in parts.items():
            assert torch.equal(pre["state"][0][table][name], value), f"{what}: {table}.{name}"
    assert pre["locked"] == 0 and sync["locked"] == 0, f"{what}: slots left locked"


@pytest.mark.parametrize("cache", ["roomy", "whole"])
def test_pipeline_with_prefetch_is_bit_identical(runs: list[dict], cache: str) -> None:
    for rank, run in enumerate(runs):
        sync, pre = run[cache][False], run[cache][True]
        _assert_same_training(sync, pre, f"rank {rank}, {cache} cache")
        assert pre["fallbacks"] == 0
        # Every forward used its prefetch: 2 all_to_alls on the prefetch group per step, the
        # forward's id exchange saved.
        assert pre["collectives"] == sync["collectives"] + STEPS, (pre, sync)
    # The tier is read by the owners' resolves, on the prefetch worker only.
    readers = {name for run in runs for name in run["roomy"][True]["readers"]}
    assert readers and all(n.startswith("embcache-prefetch") for n in readers), readers
    assert all(n == "MainThread" for run in runs for n in run["roomy"][False]["readers"])


def test_an_owner_that_cannot_hold_two_batches_makes_every_rank_read_synchronously(
    runs: list[dict],
) -> None:
    for rank, run in enumerate(runs):
        _assert_same_training(run["tight"][False], run["tight"][True], f"rank {rank}, tight")
        assert run["tight"][False]["fallbacks"] == 0
    assert sum(run["tight"][True]["fallbacks"] for run in runs) > 0, "no owner ran out of room"
    assert sum(run["tight"][True]["warned"] for run in runs) > 0


def test_handles_that_disagree_fall_back_on_every_rank(runs: list[dict]) -> None:
    for rank, run in enumerate(runs):
        res = run["by_hand"]
        assert res["outputs"] == [True] * 6, f"rank {rank}: outputs differ at some step"
        for key, value in res["reference"].items():
            assert torch.equal(res["tables"][key], value), f"rank {rank}: {key}"
        assert res["locked"] == 0 and res["pending"], f"rank {rank}: a handle leaked"
    one, zero = runs[1]["by_hand"]["errors"], runs[0]["by_hand"]["errors"]
    assert one["refused"].startswith("ValueError") and "10000" in one["refused"]
    assert "CollectiveError" in zero["peer"] and "rank(s) [1] refused" in zero["peer"]


def _checkpoint_tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for rank_dir in sorted(root.glob("rank-*")):
        snap = latest_snapshot(rank_dir)
        for f in sorted(snap.rglob("*.safetensors")):
            for key, value in load_file(f).items():
                out[f"{rank_dir.name}/{f.relative_to(snap)}:{key}"] = value
    return out


def test_train_on_two_ranks_with_prefetch_equals_without(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "embcache.cli", "train", "--scale", "0.0005", "--steps", "8",
            "--batch-size", "64", "--dim", "8", "--eval-batches", "0", "--no-progress",
            "--load-factor", "0.05", "--nproc", "2"]  # fmt: skip
    for name, flag in (("on", "--prefetch"), ("off", "--no-prefetch")):
        done = subprocess.run(
            [*base, flag, "--checkpoint", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert f"prefetch {name}" in done.stdout, done.stdout
    on, off = _checkpoint_tensors(tmp_path / "on"), _checkpoint_tensors(tmp_path / "off")
    assert on.keys() == off.keys() and on
    for key, value in off.items():
        assert torch.equal(on[key], value), key
