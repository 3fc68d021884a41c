"""TrainPipeline: prefetch changes time, not numbers (invariant I5), and ends cleanly."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import embcache
from embcache.cache.policy_registry import policy_names
from embcache.train.pipeline import PrefetchFallbackWarning, TrainPipeline

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=300, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=200, feature_names=["f2"]),
]
FEATURES = ["f0", "f1", "f2"]
BATCH = 6
TIMEOUT_S = 10.0  # bound on every wait, so a broken prefetch fails instead of hanging


class TinyModel(nn.Module):
    def __init__(self, cache: embcache.CacheConfig, store, update_in_backward=False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sparse = embcache.CachedEmbeddingBagCollection(
            tables=TABLES, cache=cache, store=store, update_in_backward=update_in_backward
        )
        self.head = nn.Linear(11, 1)

    def forward(self, batch) -> torch.Tensor:
        kjt, target = batch
        logits = self.head(self.sparse(kjt).values()).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, target)


def make_batches(n: int, seed: int = 0) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        lengths = torch.randint(0, 5, (len(FEATURES) * BATCH,), generator=gen)
        limits = torch.tensor([300, 300, 200]).repeat_interleave(BATCH).repeat_interleave(lengths)
        u = torch.rand(int(lengths.sum()), generator=gen)
        values = (limits.double() * u.pow(3)).long()  # skewed: rows repeat across batches
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths)
        batches.append((kjt, (torch.rand(BATCH, generator=gen) < 0.5).float()))
    return batches


def build(cache, update_in_backward=False, store=None):
    model = TinyModel(cache, store if store is not None else embcache.HostKV(), update_in_backward)
    sparse = embcache.SparseAdaGrad([model.sparse], lr=0.1)
    dense = torch.optim.SGD(model.head.parameters(), lr=0.05)
    return model, sparse, dense


def train_plain(model, sparse, dense, batches) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(batch)
        loss.backward()
        dense.step()
        dense.zero_grad()
        sparse.step()
        losses.append(loss.item())
    return losses


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def pipeline(model, sparse, dense, prefetch=True) -> TrainPipeline:
    return TrainPipeline(
        model, sparse, dense, features=lambda b: b[0], loss=lambda m, b: m(b), prefetch=prefetch
    )


CACHES = {
    "1pct": dict(load_factor=0.01, ways=2),
    "10pct": dict(load_factor=0.1, ways=4),
    "100pct": dict(load_factor=1.0),
}


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("size", list(CACHES), ids=list(CACHES))
def test_pipeline_is_bit_identical(size: str, policy: str) -> None:
    batches = make_batches(10)
    cache = embcache.CacheConfig(policy=policy, **CACHES[size])
    model, sparse, dense = build(cache)
    reference_losses = train_plain(model, sparse, dense, batches)
    reference = snapshot(model)

    runs = {
        "prefetch": dict(prefetch=True),
        "no_prefetch": dict(prefetch=False),
        "prefetch_update_in_backward": dict(prefetch=True, update_in_backward=True),
    }
    for name, opts in runs.items():
        model, sparse, dense = build(
            cache, update_in_backward=opts.get("update_in_backward", False)
        )
        losses = pipeline(model, sparse, dense, prefetch=opts["prefetch"]).run(batches)
        assert losses == reference_losses, f"{name}: losses differ"
        for key, value in snapshot(model).items():
            assert torch.equal(value, reference[key]), f"{name}: {key} differs"
        assert all(c.locked_slots() == 0 for c in model.sparse.caches())


def test_update_in_backward_matches_trace_and_step() -> None:
    batches = make_batches(6, seed=3)
    cache = embcache.CacheConfig(load_factor=0.1, ways=4)
    model, sparse, dense = build(cache)
    train_plain(model, sparse, dense, batches)
    fused, fsparse, fdense = build(cache, update_in_backward=True)
    train_plain(fused, fsparse, fdense, batches)
    assert not fused.sparse._trace
    for key, value in snapshot(fused).items():
        assert torch.equal(value, snapshot(model)[key]), key


class SlowHostKV(embcache.HostKV):
    """A host tier with per-call latency, as a remote tier has; records who read from it."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.readers: list[str] = []

    def get(self, table, ids):
        time.sleep(self.delay_s)
        self.readers.append(threading.current_thread().name)
        return super().get(table, ids)


def test_prefetch_reads_run_on_the_worker_thread() -> None:
    store = SlowHostKV(0.001)
    model, sparse, dense = build(embcache.CacheConfig(load_factor=0.1, ways=4), store=store)
    store.readers.clear()
    pipeline(model, sparse, dense).run(make_batches(5))
    assert store.readers, "training must read rows from the tier"
    assert all(name.startswith("embcache-prefetch") for name in store.readers), store.readers


class GatedWriteKV(embcache.HostKV):
    """A host tier whose writes wait for ``gate``; records the thread of each write."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.writers: list[str] = []

    def put(self, table, ids, rows):
        assert self.gate.wait(TIMEOUT_S), "a write waited for the gate too long"
        self.writers.append(threading.current_thread().name)
        super().put(table, ids, rows)


def test_a_prefetch_is_ready_before_its_victims_are_written() -> None:
    """The worker's resolve leaves the dirty victims' write-back for its next call: the
    handle is ready while the tier's writes are held, the worker makes them afterwards (before
    any later prefetch), and the numbers are those of the plain loop."""
    batches = make_batches(8, seed=6)
    # One set that holds two batches' rows: no scratch rows, whose write the resolve makes.
    cache = embcache.CacheConfig(capacity=64, ways=64)
    model, sparse, dense = build(cache)
    train_plain(model, sparse, dense, batches)
    reference = snapshot(model)

    store = GatedWriteKV()
    model, sparse, dense = build(cache, store=store)
    train_plain(model, sparse, dense, batches[:4])  # the cache is full of trained rows
    assert all(c.scratch_rows == 0 for c in model.sparse.caches())
    writes = len(store.writers)
    store.gate.clear()
    handle = model.sparse.issue_fused_prefetch(batches[4][0])
    assert handle.state.future.result(timeout=TIMEOUT_S).error is None
    assert len(store.writers) == writes, "the resolve wrote its victims before it was ready"
    assert any(c._deferred for c in model.sparse.caches())
    store.gate.set()
    train_plain(model, sparse, dense, batches[4:5])  # its forward takes the handle
    model.sparse.engines.prefetches.worker.submit(lambda: None).result(timeout=TIMEOUT_S)
    assert len(store.writers) > writes
    assert all(name.startswith("embcache-prefetch") for name in store.writers[writes:])
    assert not any(c._deferred for c in model.sparse.caches())
    pipeline(model, sparse, dense).run(batches[5:])
    for key, value in snapshot(model).items():
        assert torch.equal(value, reference[key]), key
    assert_clean(model)


def test_a_forward_on_the_features_a_prefetch_was_issued_for_checks_them_once(
    monkeypatch,
) -> None:
    """The prefetch checked its features: a forward given that same object takes the checked
    batch from the handle; one given an equal copy checks it (and still uses the prefetch)."""
    batches = make_batches(3, seed=7)
    cache = embcache.CacheConfig(load_factor=0.1, ways=4)
    model, _sparse, _dense = build(cache)
    with torch.no_grad():
        reference = [model.sparse(b[0]).values() for b in batches[:2]]
    checked = []
    original = type(model.sparse).checked_input

    def counting(self, features, *args):
        checked.append(features)
        return original(self, features, *args)

    monkeypatch.setattr(type(model.sparse), "checked_input", counting)
    kjt = batches[0][0]
    model.sparse.issue_fused_prefetch(kjt)
    assert checked == [kjt]
    with torch.no_grad():
        out = model.sparse(kjt).values()
    assert checked == [kjt], "the forward checked the prefetched features again"
    assert torch.equal(out, reference[0])
    again = batches[1][0]
    model.sparse.issue_fused_prefetch(again)
    copy = KeyedJaggedTensor.from_lengths_sync(
        keys=again.keys(), values=again.values().clone(), lengths=again.lengths().clone()
    )
    with torch.no_grad():
        out = model.sparse(copy).values()
    assert checked == [kjt, again, copy]
    assert torch.equal(out, reference[1])
    assert model.sparse.pending_prefetch is None  # the copy's forward took the handle
    assert_clean(model)


def test_prefetch_that_does_not_fit_falls_back_with_a_warning() -> None:
    batches = make_batches(6, seed=1)
    # The scratch area holds any one batch's rows of a table, not two batches' rows.
    per_table = [
        max(int(torch.unique(b[0][f].values()).numel()) for b in batches) for f in ("f0", "f2")
    ]
    per_table[0] = max(
        int(torch.unique(torch.cat([b[0]["f0"].values(), b[0]["f1"].values()])).numel())
        for b in batches
    )
    cache = embcache.CacheConfig(capacity=1, ways=1, max_scratch_rows=max(per_table))
    model, sparse, dense = build(cache)
    reference_losses = train_plain(model, sparse, dense, batches)
    reference = snapshot(model)

    model, sparse, dense = build(cache)

    def loss_after_prefetch(m, b):
        # Let the next batch's prefetch finish first, so it always meets this batch's locks.
        for handle in pipe._pending or ():
            handle.wait()
        return m(b)

    pipe = TrainPipeline(model, sparse, dense, features=lambda b: b[0], loss=loss_after_prefetch)
    with pytest.warns(PrefetchFallbackWarning, match="too small for two batches"):
        losses = pipe.run(batches)
    assert pipe.fallbacks > 0
    assert losses == reference_losses
    for key, value in snapshot(model).items():
        assert torch.equal(value, reference[key]), key


def assert_clean(model) -> None:
    workers = [t for t in threading.enumerate() if t.name.startswith("embcache-prefetch")]
    for t in workers:  # a worker exits once its queue is empty; give it the moment it needs
        t.join(timeout=TIMEOUT_S)
    alive = [t.name for t in workers if t.is_alive()]
    assert not alive, f"prefetch threads left running: {alive}"
    assert all(c.locked_slots() == 0 for c in model.sparse.caches()), "slots left locked"
    assert not model.sparse._trace
    assert model.sparse.pending_prefetch is None


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_interrupted_run_ends_cleanly_and_keeps_updates(error: type[BaseException]) -> None:
    batches = make_batches(6, seed=2)
    cache = embcache.CacheConfig(load_factor=0.1, ways=4)
    model, sparse, dense = build(cache)
    train_plain(model, sparse, dense, batches[:3])
    reference = snapshot(model)

    model, sparse, dense = build(cache)
    calls = {"n": 0}

    def loss(m, b):
        calls["n"] += 1
        out = m(b)
        if calls["n"] == 4:  # fails after the forward of the 4th batch, before its backward
            raise error("stop")
        return out

    pipe = TrainPipeline(model, sparse, dense, features=lambda b: b[0], loss=loss)
    with pytest.raises(error):
        pipe.run(batches)
    assert_clean(model)
    model.sparse.flush()
    for key, value in snapshot(model).items():
        assert torch.equal(value, reference[key]), f"{key}: the 3 finished steps must be kept"


def test_run_stops_at_max_steps_and_on_step_sees_each_loss() -> None:
    model, sparse, dense = build(embcache.CacheConfig(load_factor=0.1, ways=4))
    seen = []
    losses = pipeline(model, sparse, dense).run(
        make_batches(8), max_steps=3, on_step=lambda i, loss: seen.append((i, float(loss)))
    )
    assert len(losses) == 3
    assert seen == list(enumerate(losses, start=1))
    assert_clean(model)


def test_empty_iterator_and_model_without_collection() -> None:
    model, sparse, dense = build(embcache.CacheConfig(load_factor=0.1))
    assert pipeline(model, sparse, dense).run([]) == []
    with pytest.raises(ValueError, match="no CachedEmbeddingBagCollection"):
        TrainPipeline(nn.Linear(2, 2), sparse, None, features=lambda b: b, loss=lambda m, b: b)


class FailingHostKV(embcache.HostKV):
    """A tier whose reads start failing after a number of calls, as a lost connection."""

    def __init__(self, good_calls: int) -> None:
        super().__init__()
        self.good_calls = good_calls

    def get(self, table, ids):
        self.good_calls -= 1
        if self.good_calls < 0:
            raise ConnectionError("tier unavailable")
        return super().get(table, ids)


def test_a_failing_prefetch_ends_the_run_cleanly() -> None:
    """The tier fails inside the worker's prefetch: the error reaches the caller, the worker
    is joined and nothing stays locked."""
    store = FailingHostKV(good_calls=0)
    model, sparse, dense = build(embcache.CacheConfig(load_factor=0.1, ways=4), store=store)
    store.good_calls = 12  # construction is done; a few batches succeed, then reads fail
    with pytest.raises(ConnectionError, match="tier unavailable"):
        pipeline(model, sparse, dense).run(make_batches(12))
    assert_clean(model)


def test_handles_released_during_a_step_make_the_next_batch_run_synchronously() -> None:
    """A ``reset_trace()`` (or ``zero_grad()``) inside the step releases the next batch's
    prefetch, issued before this forward: that batch then resolves in its forward, same bits."""
    batches = make_batches(6, seed=4)
    cache = embcache.CacheConfig(load_factor=0.1, ways=4)
    model, sparse, dense = build(cache)
    reference_losses = train_plain(model, sparse, dense, batches)
    reference = snapshot(model)

    model, sparse, dense = build(cache)
    released = []

    def loss(m, b):
        pending = list(pipe._pending or ())
        m.sparse.reset_trace()  # nothing to drop but the pending prefetch
        released.extend(h.used for h in pending)
        return m(b)

    pipe = TrainPipeline(model, sparse, dense, features=lambda b: b[0], loss=loss)
    assert pipe.run(batches) == reference_losses
    assert released and all(released)
    for key, value in snapshot(model).items():
        assert torch.equal(value, reference[key]), key
    assert_clean(model)
