"""The direct share (`CacheEngine.direct_share`): a cache that maps every row to its own slot,
on the TBE step, pools a training batch by table and raw id without dedup or resolve.

The twins (`EMBCACHE_BACKEND=torch`) are the specification: every test runs the same batches
through both and compares rows and optimizer state (to float32 rounding), cache statistics and
what the tier holds after a flush (exactly), and checks that the direct share was really taken.
"""

from __future__ import annotations

import pytest
import torch

import embcache

pytest.importorskip("fbgemm_gpu")

KEYS = ["f0", "f1", "f2"]
ROWS = {"f0": 300, "f1": 300, "f2": 200, "f3": 1000}
RULES = {
    "sgd": lambda m: embcache.SparseSGD([m], lr=0.2),
    "adagrad": lambda m: embcache.SparseAdaGrad([m], lr=0.1),
    "rowwise_adagrad": lambda m: embcache.SparseRowWiseAdaGrad([m], lr=0.1),
}
BACKENDS = ("auto", "torch")
B = 16


def _tables(pooling: str = "sum", wide: bool = False) -> list[embcache.TableConfig]:
    """t0 (two features: a shared table) and t1 of dim 8; with ``wide``, t2 of dim 16 between
    them (so the dim-8 cache holds the tables of index 0 and 2)."""
    t0, t1, t2 = [
        embcache.TableConfig(name="t0", embedding_dim=8, num_embeddings=300,
                             feature_names=["f0", "f1"], pooling=pooling),
        embcache.TableConfig(name="t1", embedding_dim=8, num_embeddings=200,
                             feature_names=["f2"], pooling=pooling),
        embcache.TableConfig(name="t2", embedding_dim=16, num_embeddings=1000,
                             feature_names=["f3"], pooling=pooling),
    ]  # fmt: skip
    return [t0, t2, t1] if wide else [t0, t1]


def _lengths(shape: str, features: int, gen: torch.Generator) -> torch.Tensor:
    """Bag lengths ``[F * B]`` of a batch shape: "random" (features of different sizes),
    "equal" (every feature as many values), "long" (thousands of values per feature, one
    feature empty), "empty" (no value at all)."""
    if shape == "equal":
        lengths = torch.randint(0, 6, (B,), generator=gen)
        lengths[0], lengths[1] = 0, 3
        return lengths.repeat(features)
    if shape == "long":
        lengths = torch.randint(400, 500, (features, B), generator=gen)
        lengths[1] = 0
        return lengths.view(-1)
    if shape == "empty":
        return torch.zeros(features * B, dtype=torch.int64)
    return torch.randint(0, 6, (features * B,), generator=gen)


def _batches(
    n: int, keys: list[str] = KEYS, weighted: bool = False, seed: int = 0, shape: str = "random"
) -> list[embcache.JaggedBatch]:
    """Fresh random batches over ``keys`` (in that order): skewed ids (repeats within and across
    bags), an empty bag, and a bag of one id three times (unless ``shape`` is "empty"). A key
    not in `ROWS` gets ids a collection would refuse (it must not look at them)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = _lengths(shape, len(keys), gen)
        if shape in ("random", "long"):
            lengths[0], lengths[1] = 0, 3
        limits = torch.tensor([ROWS.get(k, 10**9) for k in keys])
        limits = limits.repeat_interleave(B).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen).pow(2) * limits).long()
        values[:3] = values[:1]  # bag (keys[0], sample 1): one id three times
        weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
        out.append(embcache.JaggedBatch.from_lengths(keys, values, lengths, weights))
    return out


def _build(backend: str, monkeypatch, rule: str = "rowwise_adagrad", pooling: str = "sum",
           cache: embcache.CacheConfig | None = None, wide: bool = False, **kwargs):  # fmt: skip
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=_tables(pooling, wide), cache=cache or embcache.CacheConfig(), seed=0, **kwargs
    )
    return ebc, RULES[rule](ebc)


def _loss(out: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    coeff = torch.randn(out.shape, generator=gen)
    return (out * coeff).sum() + 0.5 * out.square().sum()


def _directs(ebc) -> list[bool]:
    """Which caches' shares of the batch in flight were served directly."""
    return [p.direct is not None for p in ebc.engines.inflight[-1].prepared]


def _train(ebc, opt, batches, seed: int = 1) -> list[list[bool]]:
    """A step per batch; returns, per step, which shares were served directly, checking on the
    way that a direct share locks nothing."""
    gen = torch.Generator().manual_seed(seed)
    seen = []
    for batch in batches:
        out = ebc(batch).values()
        seen.append(_directs(ebc))
        caches = zip(ebc.caches(), seen[-1], strict=True)
        assert all(c.locked_slots() == 0 for c, direct in caches if direct)
        _loss(out, gen).backward()
        opt.step()
        assert all(c.locked_slots() == 0 for c in ebc.caches())
    return seen


def _rows(ebc) -> dict[str, torch.Tensor]:
    """Every row of every table, weights and optimizer state (after a flush)."""
    return {t.name: ebc.table_rows(t.name) for t in ebc.tables}


def _assert_rows_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def _touched(batches: list[embcache.JaggedBatch]) -> dict[str, set[int]]:
    """The ids of each table that the batches look up."""
    table_of = {"f0": "t0", "f1": "t0", "f2": "t1", "f3": "t2"}
    out: dict[str, set[int]] = {}
    for batch in batches:
        ends = batch.offset_per_key()
        for i, key in enumerate(batch.keys()):
            if key in table_of:
                ids = batch.values()[ends[i] : ends[i + 1]].tolist()
                out.setdefault(table_of[key], set()).update(ids)
    return out


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("rule", list(RULES))
def test_a_whole_table_cache_is_served_directly(monkeypatch, rule: str, pooling: str) -> None:
    batches = _batches(4)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, rule, pooling)
        assert ebc.caches()[0].direct
        seen = _train(ebc, opt, batches)
        stats = ebc.cache_stats()
        runs[backend] = (seen, stats, _rows(ebc), ebc.cache_stats())
    (seen, stats, rows, after), (twin_seen, twin_stats, twin_rows, twin_after) = runs.values()
    assert seen == [[True]] * 4 and twin_seen == [[False]] * 4
    assert stats == twin_stats and after == twin_after
    # Hits are each batch's distinct rows; a whole-table cache misses and evicts nothing.
    distinct = sum(sum(map(len, _touched([b]).values())) for b in batches)
    assert stats["hits"] == distinct and stats["misses"] == stats["evictions"] == 0
    _assert_rows_close(rows, twin_rows)


@pytest.mark.parametrize("shape", ["equal", "long", "empty"])
def test_batch_shapes(monkeypatch, shape: str) -> None:
    """Features of equal sizes, of thousands of values (one empty) and a batch with no value
    at all take their own ways to the slots: all served directly, all as the twins."""
    batches = _batches(2, seed=31, shape=shape)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, "rowwise_adagrad")
        seen = _train(ebc, opt, batches)
        runs[backend] = (seen, ebc.cache_stats(), _rows(ebc))
    (seen, stats, rows), (_, twin_stats, twin_rows) = runs.values()
    assert seen == [[True]] * 2
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)


@pytest.mark.parametrize("rule", list(RULES))
def test_flush_writes_exactly_the_rows_trained(monkeypatch, rule: str) -> None:
    """Dirty marking from the batch's map of slots covers the rows it touched, no more, no
    fewer: after a flush the tier holds exactly them (rows never trained are not created)."""
    batches = _batches(3, seed=7)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, rule)
        tier = []
        for step in range(len(batches)):
            assert _train(ebc, opt, batches[step : step + 1], seed=step) == [[backend == "auto"]]
            ebc.flush()
            assert not bool(ebc.caches()[0].dirty.any())
            stored = {}
            for t in ebc.tables:
                chunks = list(ebc.store.export_rows(t.name))
                ids = torch.cat([c[0] for c in chunks])
                stored[t.name] = (ids.tolist(), torch.cat([c[1] for c in chunks]))
                assert ebc.store.row_count(t.name) == ids.numel()
            tier.append((stored, ebc.cache_stats()["writebacks"]))
        runs[backend] = tier
    for step, ((stored, writebacks), (twin_stored, twin_writebacks)) in enumerate(
        zip(runs["auto"], runs["torch"], strict=True)
    ):
        expected = _touched(batches[: step + 1])
        assert writebacks == twin_writebacks
        for name, (ids, rows) in stored.items():
            twin_ids, twin_rows = twin_stored[name]
            assert ids == twin_ids == sorted(expected[name]), (step, name)
            torch.testing.assert_close(rows, twin_rows, rtol=1e-5, atol=1e-6)


BAD_IDS = [("f0", -1), ("f1", 300), ("f2", 200), ("f2", -5), ("f0", 10**6)]


@pytest.mark.parametrize(
    ("shape", "feature", "bad"),
    [("random", f, b) for f, b in BAD_IDS]
    + [("equal", "f1", -1), ("equal", "f2", 200)]
    + [("long", "f0", 300), ("long", "f2", -1)],  # (its f1 is empty)
)
def test_a_bad_id_is_refused_and_changes_nothing(
    monkeypatch, shape: str, feature: str, bad: int
) -> None:
    good = _batches(3, seed=3)
    broken = _batches(1, seed=4, shape=shape)[0]
    pos = broken.offset_per_key()[KEYS.index(feature)] + 1  # inside a feature's values
    values = broken.values().clone()
    values[pos] = bad
    broken = embcache.JaggedBatch.from_lengths(KEYS, values, broken.lengths())
    table = "t0" if feature in ("f0", "f1") else "t1"
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch)
        messages = []
        with pytest.raises(ValueError) as first:  # before the cache was ever filled
            ebc(broken)
        messages.append(str(first.value))
        assert ebc.cache_stats()["hits"] == 0 and not ebc.engines.inflight
        _train(ebc, opt, good[:1])
        before = _rows(ebc)
        stats = ebc.cache_stats()
        with pytest.raises(ValueError) as again:
            ebc(broken)
        messages.append(str(again.value))
        assert ebc.cache_stats() == stats
        assert ebc.caches()[0].locked_slots() == 0 and not ebc.engines.has_gradients
        assert not ebc.engines.inflight
        after = _rows(ebc)
        for name in before:
            assert torch.equal(after[name], before[name]), name
        seen = _train(ebc, opt, good[1:])
        runs[backend] = (messages, seen, ebc.cache_stats(), _rows(ebc))
    (messages, seen, stats, rows), (twin_messages, _, twin_stats, twin_rows) = runs.values()
    assert seen == [[True], [True]]  # the good steps after it are served directly
    assert messages == twin_messages
    for message in messages:
        assert feature in message and table in message and str(bad) in message
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)


def test_reading_the_trace_gives_the_twins_rows(monkeypatch) -> None:
    """``_trace`` after a direct backward holds the twins' per-id rows (ids ascending, both
    tables), locks the rows as a resolve would until the step, which then gives the twins'
    rows."""
    batches = _batches(2, seed=5)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch)
        gen = torch.Generator().manual_seed(0)
        _train(ebc, opt, batches[:1])
        out = ebc(batches[1]).values()
        assert _directs(ebc) == [backend == "auto"]
        _loss(out, gen).backward()
        trace = [(name, ids.clone(), grads.clone()) for name, ids, grads in ebc._trace]
        locked = ebc.caches()[0].locked_slots()
        opt.step()
        assert ebc.caches()[0].locked_slots() == 0
        runs[backend] = (trace, locked, ebc.cache_stats(), _rows(ebc))
    (trace, locked, stats, rows), (twin_trace, twin_locked, twin_stats, twin_rows) = runs.values()
    expected = _touched(batches[1:])
    assert [n for n, _, _ in trace] == [n for n, _, _ in twin_trace] == ["t0", "t1"]
    for (name, ids, grads), (_, twin_ids, twin_grads) in zip(trace, twin_trace, strict=True):
        assert torch.equal(ids, twin_ids)
        assert ids.tolist() == sorted(expected[name])
        torch.testing.assert_close(grads, twin_grads, rtol=1e-5, atol=1e-6)
    assert locked == twin_locked == sum(map(len, expected.values()))
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)


@pytest.mark.parametrize("case", ["reordered", "extra_key", "kjt"])
def test_keys_in_another_order_or_unused(monkeypatch, case: str) -> None:
    keys = {"reordered": ["f2", "f0", "f1"], "extra_key": ["f0", "fx", "f1", "f2"]}.get(case, KEYS)
    batches = _batches(3, keys=keys, seed=11)
    if case == "kjt":
        torchrec = pytest.importorskip("torchrec")
        batches = [
            torchrec.KeyedJaggedTensor(b.keys(), b.values(), lengths=b.lengths().int())
            for b in batches
        ]
        for kjt in batches:
            kjt.offsets()  # computed and kept: the direct share takes the KJT's own (int32)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, "adagrad")
        gen = torch.Generator().manual_seed(2)
        outs = []
        for batch in batches:
            out = ebc(batch).values()
            assert _directs(ebc) == [backend == "auto"]
            outs.append(out.detach().clone())
            _loss(out, gen).backward()
            opt.step()
        runs[backend] = (outs, ebc.cache_stats(), _rows(ebc))
    (outs, stats, rows), (twin_outs, twin_stats, twin_rows) = runs.values()
    for out, twin in zip(outs, twin_outs, strict=True):
        torch.testing.assert_close(out, twin, rtol=1e-5, atol=1e-6)
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)


@pytest.mark.parametrize("rule", list(RULES))
def test_a_direct_and_a_set_associative_cache_side_by_side(monkeypatch, rule: str) -> None:
    """Capacity 500 holds the dim-8 tables whole (500 rows: direct) but not the dim-16 one
    (1000 rows: set-associative, evicting): each takes its own path in one step."""
    cache = embcache.CacheConfig(capacity=500, ways=2)
    batches = _batches(4, keys=["f0", "f1", "f2", "f3"], seed=13)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, rule, cache=cache, wide=True)
        assert [(c.dim, c.direct) for c in ebc.caches()] == [(8, True), (16, False)]
        assert all(e.tbe_step is not None for e in ebc.engines.engines) == (backend == "auto")
        seen = _train(ebc, opt, batches)
        runs[backend] = (seen, ebc.cache_stats(), _rows(ebc))
    (seen, stats, rows), (twin_seen, twin_stats, twin_rows) = runs.values()
    assert seen == [[True, False]] * 4 and twin_seen == [[False, False]] * 4
    assert stats == twin_stats and stats["misses"] > 0 and stats["evictions"] > 0
    _assert_rows_close(rows, twin_rows)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_per_sample_weights(monkeypatch, pooling: str) -> None:
    """Weighted SUM is served directly; weighted MEAN (FBGEMM's differs from the twins') is
    not. Both train as the twins."""
    batches = _batches(3, weighted=True, seed=17)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, "rowwise_adagrad", pooling, is_weighted=True)
        seen = _train(ebc, opt, batches)
        runs[backend] = (seen, ebc.cache_stats(), _rows(ebc))
    (seen, stats, rows), (_, twin_stats, twin_rows) = runs.values()
    assert seen == [[pooling == "sum"]] * 3
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)


def test_an_evaluation_forward_between_forward_and_backward(monkeypatch) -> None:
    """A ``no_grad`` forward (which resolves, as evaluation does) between a direct training
    forward and its backward leaves the direct share as it was: same rows as the twins."""
    batches = _batches(3, seed=19)
    evals = _batches(3, seed=23)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, "sgd")
        gen = torch.Generator().manual_seed(3)
        seen, scores = [], []
        for batch, held_out in zip(batches, evals, strict=True):
            out = ebc(batch).values()
            seen.append(_directs(ebc))
            with torch.no_grad():
                scores.append(ebc(held_out).values())
            assert _directs(ebc) == seen[-1]  # the batch in flight is still the training one
            _loss(out, gen).backward()
            opt.step()
            assert ebc.caches()[0].locked_slots() == 0
        runs[backend] = (seen, scores, ebc.cache_stats(), _rows(ebc))
    (seen, scores, stats, rows), (_, twin_scores, twin_stats, twin_rows) = runs.values()
    assert seen == [[True]] * 3
    for score, twin in zip(scores, twin_scores, strict=True):
        torch.testing.assert_close(score, twin, rtol=1e-5, atol=1e-6)
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)


def test_update_in_backward_and_prefetch(monkeypatch) -> None:
    """Applied inside backward; and with every other batch prefetched while the one before it
    is in flight: a prefetched share of a direct-mapped cache is served directly too (checked
    on the calling thread, counted on the prefetch worker)."""
    batches = _batches(4, seed=29)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, "adagrad", update_in_backward=True)
        assert _train(ebc, opt, batches) == [[backend == "auto"]] * 4
        inside = _rows(ebc)
        ebc, opt = _build(backend, monkeypatch, "adagrad")
        gen = torch.Generator().manual_seed(4)
        seen = []
        for i, batch in enumerate(batches):
            out = ebc(batch).values()
            seen.append(_directs(ebc))
            if i % 2 == 0:
                ebc.issue_fused_prefetch(batches[i + 1])
            _loss(out, gen).backward()
            opt.step()
        assert ebc.caches()[0].locked_slots() == 0
        runs[backend] = (inside, seen, ebc.cache_stats(), _rows(ebc))
    (inside, seen, stats, rows), (twin_inside, _, twin_stats, twin_rows) = runs.values()
    assert seen == [[True]] * 4
    _assert_rows_close(inside, twin_inside)
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)


def test_zero_grad_drops_a_direct_update(monkeypatch) -> None:
    """A direct backward dropped by ``zero_grad`` changes no row and marks none dirty; the next
    step trains as the twins'."""
    batches = _batches(3, seed=37)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, "rowwise_adagrad")
        _train(ebc, opt, batches[:1])
        before = _rows(ebc)
        ebc(batches[1]).values().square().sum().backward()
        assert _directs(ebc) == [backend == "auto"] and ebc.engines.has_gradients
        opt.zero_grad()
        assert not ebc.engines.has_gradients and ebc.caches()[0].locked_slots() == 0
        ebc.flush()
        assert ebc.store.row_count("t0") + ebc.store.row_count("t1") == sum(
            map(len, _touched(batches[:1]).values())
        )
        after = _rows(ebc)
        for name in before:
            assert torch.equal(after[name], before[name]), name
        _train(ebc, opt, batches[2:])
        runs[backend] = (ebc.cache_stats(), _rows(ebc))
    (stats, rows), (twin_stats, twin_rows) = runs.values()
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)


def test_a_prefetched_direct_share_read_without_gradients(monkeypatch) -> None:
    """A forward without gradients that takes a prefetched direct share pools it through the
    twins (its unique ids and slots made first), returns the twins' output, releases what it
    held, and the training after it matches the twins'."""
    batches = _batches(3, seed=41)
    runs = {}
    for backend in BACKENDS:
        ebc, opt = _build(backend, monkeypatch, "sgd")
        engine = ebc.engines.engines[0]
        made = []
        materialize = engine.materialize

        def spy(p, materialize=materialize, made=made):
            made.append(p.direct is not None and p.unique is None)
            return materialize(p)

        monkeypatch.setattr(engine, "materialize", spy)
        _train(ebc, opt, batches[:1])
        ebc.issue_fused_prefetch(batches[1])
        with torch.no_grad():
            evaluated = ebc(batches[1]).values()
        assert any(made) == (backend == "auto")
        assert ebc.caches()[0].locked_slots() == 0
        _train(ebc, opt, batches[2:])
        runs[backend] = (evaluated, ebc.cache_stats(), _rows(ebc))
    (out, stats, rows), (twin_out, twin_stats, twin_rows) = runs.values()
    torch.testing.assert_close(out, twin_out)
    assert stats == twin_stats
    _assert_rows_close(rows, twin_rows)
