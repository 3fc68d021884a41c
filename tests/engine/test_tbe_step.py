"""The TBE step (FBGEMM's TBE over the cache's slots) against the twins' path.

The twins are the specification (`EMBCACHE_BACKEND=torch`); ``auto`` on a CPU takes the TBE
step where it applies. Both must train the same rows and state to float32 rounding, with every
cache size, with prefetch, and fall back to the twins wherever the TBE does not apply.
"""

from __future__ import annotations

import pytest
import torch

import embcache
from embcache.engine.tbe_step import PendingUpdate, TbeStep

pytest.importorskip("fbgemm_gpu")

KEYS = ["f0", "f1", "f2"]
RULES = {
    "sgd": lambda m: embcache.SparseSGD([m], lr=0.2),
    "adagrad": lambda m: embcache.SparseAdaGrad([m], lr=0.1),
    "rowwise_adagrad": lambda m: embcache.SparseRowWiseAdaGrad([m], lr=0.1),
}


def _tables(dim: int = 8, pooling: str = "sum") -> list[embcache.TableConfig]:
    return [
        embcache.TableConfig(name="t0", embedding_dim=dim, num_embeddings=300,
                             feature_names=["f0", "f1"], pooling=pooling),
        embcache.TableConfig(name="t1", embedding_dim=dim, num_embeddings=200,
                             feature_names=["f2"], pooling=pooling),
    ]  # fmt: skip


def _batches(n: int, weighted: bool = False, seed: int = 0) -> list[embcache.JaggedBatch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 6, (3 * 16,), generator=gen)
        lengths[0] = 0  # an empty bag
        limits = torch.tensor([300, 300, 200]).repeat_interleave(16).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen).pow(2) * limits).long()
        weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
        out.append(embcache.JaggedBatch.from_lengths(KEYS, values, lengths, weights))
    return out


def _train(backend: str, monkeypatch, rule: str, cache: embcache.CacheConfig, *, dim: int = 8,
           pooling: str = "sum", weighted: bool = False, steps: int = 5):  # fmt: skip
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=_tables(dim, pooling), is_weighted=weighted, cache=cache, seed=0
    )
    opt = RULES[rule](ebc)
    on_tbe = [e.tbe_step is not None for e in ebc.engines.engines]
    gen = torch.Generator().manual_seed(1)
    used = 0
    for batch in _batches(steps, weighted):
        out = ebc(batch).values()
        coeff = torch.randn(out.shape, generator=gen)
        ((out * coeff).sum() + 0.5 * out.square().sum()).backward()
        used += len(ebc.engines._pending)
        opt.step()
    rows = {t.name: ebc.table_rows(t.name) for t in ebc.tables}
    return rows, on_tbe, used


def _assert_rows_close(a: dict, b: dict) -> None:
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


CACHES = {
    "whole": embcache.CacheConfig(),
    "10pct": embcache.CacheConfig(load_factor=0.1, ways=4),
    "lfu-tiny": embcache.CacheConfig(capacity=8, ways=2, policy="lfu"),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("rule", list(RULES))
def test_tbe_step_trains_as_the_twins(monkeypatch, rule: str, pooling: str, cache: str) -> None:
    tbe, on, used = _train("auto", monkeypatch, rule, CACHES[cache], pooling=pooling)
    twins, off, _ = _train("torch", monkeypatch, rule, CACHES[cache], pooling=pooling)
    assert on == [True] and off == [False]
    assert used == 5  # every step went through the TBE
    _assert_rows_close(tbe, twins)


def test_weighted_sum_takes_the_tbe_and_weighted_mean_does_not(monkeypatch) -> None:
    cache = CACHES["10pct"]
    tbe, _, used = _train("auto", monkeypatch, "rowwise_adagrad", cache, weighted=True)
    twins, _, _ = _train("torch", monkeypatch, "rowwise_adagrad", cache, weighted=True)
    assert used == 5
    _assert_rows_close(tbe, twins)
    tbe, _, used = _train("auto", monkeypatch, "sgd", cache, pooling="mean", weighted=True)
    twins, _, _ = _train("torch", monkeypatch, "sgd", cache, pooling="mean", weighted=True)
    assert used == 0  # FBGEMM's weighted MEAN is not the twins': the twins run it
    _assert_rows_close(tbe, twins)


@pytest.mark.parametrize(
    "case",
    ["adam", "weight_decay", "lr_decay", "dim_not_multiple_of_4", "mixed_pooling", "accumulate"],
)
def test_the_tbe_step_declines_what_it_cannot_do(monkeypatch, case: str) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    tables = _tables(dim=6 if case == "dim_not_multiple_of_4" else 8)
    if case == "mixed_pooling":
        tables[1].pooling = "mean"
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=tables, seed=0, accumulate_grads=case == "accumulate"
    )
    make = {
        "adam": lambda m: embcache.SparseAdam([m], lr=0.01),
        "weight_decay": lambda m: embcache.SparseSGD([m], lr=0.1, weight_decay=0.01),
        "lr_decay": lambda m: embcache.SparseAdaGrad([m], lr=0.1, lr_decay=0.1),
    }.get(case, RULES["rowwise_adagrad"])
    make(ebc)
    assert all(e.tbe_step is None for e in ebc.engines.engines)


def _record_unique_shares(monkeypatch, engine) -> list:
    """What each call of ``engine.unique_share`` returns, from now on."""
    shares: list = []
    unique_share = engine.unique_share

    def recorded(batch):
        shares.append(unique_share(batch))
        return shares[-1]

    monkeypatch.setattr(engine, "unique_share", recorded)
    return shares


def _rows_of(ebc) -> dict[str, torch.Tensor]:
    ebc.flush()
    return {t.name: ebc.table_rows(t.name) for t in ebc.tables}


@pytest.mark.parametrize(("feature", "bad"), [("f0", -1), ("f1", 300), ("f2", 200), ("f0", 2**40)])
def test_a_bad_id_on_the_indexed_path_is_refused_and_changes_nothing(
    monkeypatch, feature: str, bad: int
) -> None:
    """A 10% cache on the TBE step checks and deduplicates a batch in one compiled pass
    (`CacheEngine.unique_share`): a bad id anywhere still raises `fuse`'s error naming it, with
    nothing changed, and the batches before and after train as the twins train them."""
    good = _batches(3, seed=5)
    broken = _batches(1, seed=6)[0]
    values = broken.values().clone()
    values[broken.offset_per_key()[KEYS.index(feature)] + 1] = bad
    broken = embcache.JaggedBatch.from_lengths(KEYS, values, broken.lengths())
    runs = {}
    for backend in ("auto", "torch"):
        monkeypatch.setenv("EMBCACHE_BACKEND", backend)
        ebc = embcache.CachedEmbeddingBagCollection(tables=_tables(), cache=CACHES["10pct"], seed=0)
        opt = RULES["rowwise_adagrad"](ebc)
        shares = _record_unique_shares(monkeypatch, ebc.engines.engines[0])
        gen = torch.Generator().manual_seed(2)

        def step(batch, gen=gen, ebc=ebc, opt=opt) -> None:
            out = ebc(batch).values()
            (out * torch.randn(out.shape, generator=gen)).sum().backward()
            opt.step()

        step(good[0])
        before, stats = _rows_of(ebc), ebc.cache_stats()
        with pytest.raises(ValueError) as info:
            ebc(broken)
        assert ebc.cache_stats() == stats
        assert ebc.caches()[0].locked_slots() == 0 and not ebc.engines.has_gradients
        after = _rows_of(ebc)
        for name in before:
            assert torch.equal(after[name], before[name]), name
        for batch in good[1:]:
            step(batch)
        runs[backend] = (str(info.value), shares, ebc.cache_stats(), _rows_of(ebc))
    (message, shares, stats, rows), (twin_message, twin_shares, twin_stats, twin_rows) = (
        runs.values()
    )
    assert [s is not None for s in shares] == [True, False, True, True]  # the bad one: fuse's
    assert not any(twin_shares)  # the twins' path fuses, then sorts
    table = "t0" if feature in ("f0", "f1") else "t1"
    assert message == twin_message
    assert repr(feature) in message and repr(table) in message and str(bad) in message
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)


def test_the_twins_backend_turns_it_off(monkeypatch) -> None:
    _, on, used = _train("torch", monkeypatch, "sgd", CACHES["whole"])
    assert on == [False] and used == 0


def test_reading_the_trace_gives_the_twins_rows(monkeypatch) -> None:
    """``_trace`` after a TBE backward holds the per-id rows the twins would record, and the
    step then applies them (the ordinary path): same numbers as the twins."""
    results = []
    for backend in ("auto", "torch"):
        monkeypatch.setenv("EMBCACHE_BACKEND", backend)
        ebc = embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0)
        opt = embcache.SparseRowWiseAdaGrad([ebc], lr=0.1)
        out = ebc(_batches(1)[0]).values()
        out.square().sum().backward()
        if backend == "auto":
            assert isinstance(ebc.engines._pending[0], PendingUpdate)
        trace = [(name, ids.clone(), grads.clone()) for name, ids, grads in ebc._trace]
        assert not ebc.engines._pending
        opt.step()
        results.append((trace, {t.name: ebc.table_rows(t.name) for t in ebc.tables}))
    (tbe_trace, tbe_rows), (twin_trace, twin_rows) = results
    assert [n for n, _, _ in tbe_trace] == [n for n, _, _ in twin_trace]
    for (_, ids_a, g_a), (_, ids_b, g_b) in zip(tbe_trace, twin_trace, strict=True):
        assert torch.equal(ids_a, ids_b)
        torch.testing.assert_close(g_a, g_b)
    _assert_rows_close(tbe_rows, twin_rows)


def test_a_nan_gradient_is_refused_before_any_update(monkeypatch) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    ebc = embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0)
    opt = embcache.SparseSGD([ebc], lr=0.1)
    before = {t.name: ebc.table_rows(t.name) for t in ebc.tables}
    out = ebc(_batches(1)[0]).values()
    (out * torch.full_like(out, float("nan"))).sum().backward()
    assert ebc.engines._pending
    with pytest.raises(ValueError, match="NaN or Inf"):
        opt.step()
    for name, rows in before.items():
        assert torch.equal(ebc.table_rows(name), rows), name


def test_a_changed_learning_rate_takes_the_twins_path(monkeypatch) -> None:
    """The TBE's graph keeps the learning rate of its forward; a step with another one goes
    through the per-id rows instead (the same numbers as the twins at the new rate)."""
    results = []
    for backend in ("auto", "torch"):
        monkeypatch.setenv("EMBCACHE_BACKEND", backend)
        ebc = embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0)
        opt = embcache.SparseSGD([ebc], lr=0.1)
        ebc(_batches(1)[0]).values().square().sum().backward()
        opt.update = type(opt.update)(opt.update.rule, lr=0.3)
        opt.step()
        results.append({t.name: ebc.table_rows(t.name) for t in ebc.tables})
    _assert_rows_close(*results)


def test_pipeline_with_the_tbe_step_is_bit_identical(monkeypatch) -> None:
    """Prefetch changes time, not numbers (I5), also when a prefetch grows the scratch area
    between a batch's forward and its step (the TBE's graph is built again over the moved
    storage)."""
    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    runs = []
    for prefetch in (False, True):
        ebc = embcache.CachedEmbeddingBagCollection(
            tables=_tables(), cache=embcache.CacheConfig(capacity=8, ways=2), seed=0
        )
        model = torch.nn.ModuleDict({"sparse": ebc})
        opt = embcache.SparseRowWiseAdaGrad([ebc], lr=0.1)
        pipe = embcache.TrainPipeline(
            model, opt, None, features=lambda b: b,
            loss=lambda m, b: m["sparse"](b).values().square().sum(), prefetch=prefetch,
        )  # fmt: skip
        losses = pipe.run(_batches(6))
        assert all(e.tbe_step is not None for e in ebc.engines.engines)
        runs.append((losses, {t.name: ebc.table_rows(t.name) for t in ebc.tables}))
    assert runs[0][0] == runs[1][0]
    for name, rows in runs[0][1].items():
        assert torch.equal(runs[1][1][name], rows), name


def test_tbe_update_runs_while_another_thread_holds_the_cache_lock(monkeypatch) -> None:
    """The TBE's update of a batch holds the storage lock, not the cache's lock, so that a
    prefetch resolving the next batch (under the cache's lock) runs beside it: with the cache's
    lock held elsewhere, the batch's rows change, and only the release (dirty marks and
    unlocks, under the cache's lock) waits."""
    import threading

    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=_tables(), cache=embcache.CacheConfig(load_factor=0.5), seed=0
    )
    opt = embcache.SparseRowWiseAdaGrad([ebc], lr=0.1)
    cache = ebc.engines.engines[0].cache
    assert ebc.engines.engines[0].tbe_step is not None
    # The forward and backward on a thread that ends before the step: a collection trains from
    # one thread at a time, and the stepper takes the ended thread's step over.
    trainer = threading.Thread(
        target=lambda: ebc(_batches(1)[0]).values().square().sum().backward()
    )
    trainer.start()
    trainer.join(30)
    before = cache.weights.clone()
    locked_batch = cache.locks.clone()
    held, done = threading.Event(), threading.Event()

    def hold_cache_lock() -> None:
        with cache.lock:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold_cache_lock)
    holder.start()
    held.wait(30)
    stepper = threading.Thread(target=opt.step)
    stepper.start()
    try:
        changed = False
        for _ in range(600):  # up to 30 s for the update to land
            if not torch.equal(cache.weights, before):
                changed = True
                break
            stepper.join(0.05)
        assert changed, "the TBE update waited for the cache's lock"
        assert stepper.is_alive(), "the release did not wait for the cache's lock"
        assert torch.equal(cache.locks, locked_batch)  # still locked: no release yet
    finally:
        done.set()
        holder.join(30)
        stepper.join(30)
    assert not stepper.is_alive()
    assert int(cache.locks.sum()) == 0


def test_scratch_growth_waits_for_an_update_in_progress(monkeypatch) -> None:
    """A resolve that grows the scratch area replaces the slot storage: while an update holds
    the storage lock it waits (the update would land in the storage being copied and be lost),
    then replaces it, rows kept."""
    import threading

    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=_tables(), cache=embcache.CacheConfig(capacity=8, ways=2), seed=0
    )
    cache = ebc.engines.engines[0].cache
    old = cache.weights
    rows = torch.arange(60)  # far more than the 8 slots: the batch needs scratch rows
    result: list[torch.Tensor] = []
    with cache.storage_lock:
        resolver = threading.Thread(target=lambda: result.append(cache.resolve(rows)))
        resolver.start()
        resolver.join(0.5)
        assert resolver.is_alive() and cache.weights is old
    resolver.join(30)
    assert not resolver.is_alive() and result
    assert cache.weights is not old and cache.weights.shape[0] > old.shape[0]
    stored = ebc.store.read("t0", rows)[:, : cache.dim]  # the rows as the tier has them
    assert torch.equal(cache.weights[result[0]], stored)


def test_for_engine_needs_fbgemm(monkeypatch) -> None:
    """Without fbgemm_gpu (as on the GPU image) the path is simply absent."""
    import embcache.engine.tbe_step as tbe_step

    monkeypatch.setattr(tbe_step, "_FBGEMM", [None])
    ebc = embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0)
    opt = embcache.SparseSGD([ebc], lr=0.1)
    assert TbeStep.for_engine(ebc.engines.engines[0], opt) is None


def test_bags_of_one_length_train_as_the_twins(monkeypatch) -> None:
    """Fixed-size bags (every bag three ids) through a set-associative cache: the TBE gets the
    transposed bags; the same rows as the twins."""
    results = []
    for backend in ("auto", "torch"):
        monkeypatch.setenv("EMBCACHE_BACKEND", backend)
        ebc = embcache.CachedEmbeddingBagCollection(
            tables=_tables(), is_weighted=True, cache=CACHES["10pct"], seed=0
        )
        opt = embcache.SparseRowWiseAdaGrad([ebc], lr=0.1)
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            lengths = torch.full((3 * 16,), 3, dtype=torch.int64)
            limits = torch.tensor([300, 300, 200]).repeat_interleave(16 * 3)
            values = (torch.rand(limits.numel(), generator=gen).pow(2) * limits).long()
            weights = torch.rand(values.numel(), generator=gen) + 0.5
            batch = embcache.JaggedBatch.from_lengths(KEYS, values, lengths, weights)
            out = ebc(batch).values()
            if backend == "auto":
                assert ebc.engines.engines[0].tbe_step is not None
            out.square().sum().backward()
            opt.step()
        results.append({t.name: ebc.table_rows(t.name) for t in ebc.tables})
    _assert_rows_close(*results)
