"""The compiled pass of a direct share (`ops.ids.native`) against the torch path it
replaces (the specification: `CacheEngine._direct_slots`, the cache's map or stamps).

Two collections on the TBE step, one with the compiled kernels and one without (the native
backend without numba: `backend.NATIVE` patched to `NATIVE_WITHOUT_NUMBA`), train on the
same batches. After every forward and every step they must agree exactly on the cache's hits,
dirty flags, rows and optimizer state (both run the same FBGEMM kernels on the same rows), and
each must have taken its own path. The kernel itself is checked against ``torch.unique``.
"""

from __future__ import annotations

import pytest
import torch

import embcache
import embcache.backend as backend
import embcache.native as native_module
from embcache.engine.batch_state import Prepared
from embcache.ops.ids.native import BitmapDirectRows
from embcache.ops.registry import implementations

pytest.importorskip("fbgemm_gpu")
pytestmark = pytest.mark.skipif(
    not native_module.importable(), reason="numba cannot be imported here"
)

KEYS = ["f0", "f1", "f2"]
ROWS = {"f0": 300, "f1": 300, "f2": 200}
B = 16


def _tables() -> list[embcache.TableConfig]:
    """t0 (two features: a shared table) and t1, both dim 8: one direct-mapped cache."""
    return [
        embcache.TableConfig(name="t0", embedding_dim=8, num_embeddings=300,
                             feature_names=["f0", "f1"]),
        embcache.TableConfig(name="t1", embedding_dim=8, num_embeddings=200,
                             feature_names=["f2"]),
    ]  # fmt: skip


def _batches(n: int, shape: str, seed: int = 0) -> list[embcache.JaggedBatch]:
    """Skewed ids (repeats within and across bags, ids at each table's last row), bags of
    random lengths with empty ones ("random"), one length for every bag ("equal"), hundreds
    of values per bag with one feature empty ("long"), or no value at all ("empty")."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if shape == "equal":
            lengths = torch.full((len(KEYS) * B,), 3, dtype=torch.int64)
        elif shape == "long":
            lengths = torch.randint(100, 300, (len(KEYS), B), generator=gen)
            lengths[1] = 0
            lengths = lengths.view(-1)
        elif shape == "empty":
            lengths = torch.zeros(len(KEYS) * B, dtype=torch.int64)
        else:
            lengths = torch.randint(0, 6, (len(KEYS) * B,), generator=gen)
            lengths[0] = 0
        limits = torch.tensor([ROWS[k] for k in KEYS]).repeat_interleave(B)
        limits = limits.repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen).pow(3) * limits).long()
        if values.numel() > 2:
            values[-1] = limits[-1] - 1
        out.append(embcache.JaggedBatch.from_lengths(KEYS, values, lengths))
    return out


def _slots(batch: embcache.JaggedBatch) -> torch.Tensor:
    """The slot of each value: t0's rows first, then t1's."""
    feature = torch.arange(len(KEYS)).repeat_interleave(torch.tensor(batch.length_per_key()))
    return batch.values() + torch.tensor([0, 0, ROWS["f0"]])[feature]


def _build(monkeypatch):
    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    ebc = embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0)
    return ebc, embcache.SparseRowWiseAdaGrad([ebc], lr=0.1)


def _share(ebc) -> Prepared:
    (p,) = ebc.engines.inflight[-1].prepared
    assert p.direct is not None, "the share was not served directly"
    return p


def _cache_state(ebc) -> dict[str, object]:
    cache = ebc.caches()[0]
    return {
        "stats": ebc.cache_stats(),
        "dirty": cache.dirty.clone(),
        "weights": cache.weights.clone(),
        "state": cache.state.clone(),
    }


def _assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a["stats"] == b["stats"]
    for key in ("dirty", "weights", "state"):
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("shape", ["random", "equal", "long", "empty"])
def test_compiled_and_torch_direct_shares_train_alike(monkeypatch, shape: str) -> None:
    batches = _batches(4, shape, seed=11)
    runs = {}
    for native in (True, False):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(backend, "NATIVE", backend.NATIVE_WITHOUT_NUMBA)
            ebc, opt = _build(m)
            gen = torch.Generator().manual_seed(1)
            trace = []
            for i, batch in enumerate(batches):
                out = ebc(batch).values()
                p = _share(ebc)
                assert (p.direct.rows is not None) == native
                assert (p.direct.slots is None) == native  # no value slots written
                trace.append(_cache_state(ebc))  # after the forward: hits counted, nothing dirty
                (out * torch.randn(out.shape, generator=gen)).sum().backward()
                if i == 1:  # a flush between backward and step: the step's rows get dirty
                    ebc.flush()
                    assert not bool(ebc.caches()[0].dirty.any())
                opt.step()
                trace.append(_cache_state(ebc))
                if i == 1:
                    dirty = ebc.caches()[0].dirty.nonzero().squeeze(1)
                    assert torch.equal(dirty, _slots(batch).unique())
            ebc.flush()
            runs[native] = (trace, {t.name: ebc.table_rows(t.name) for t in ebc.tables})
    (trace, rows), (twin_trace, twin_rows) = runs[True], runs[False]
    for a, b in zip(trace, twin_trace, strict=True):
        _assert_same(a, b)
    for name in rows:
        assert torch.equal(rows[name], twin_rows[name]), name
    # Each forward counts its batch's distinct rows as hits, and marks nothing dirty.
    for i, batch in enumerate(batches):
        before = trace[2 * i - 1] if i else {"stats": {"hits": 0}, "dirty": trace[0]["dirty"]}
        forward = trace[2 * i]
        assert forward["stats"]["hits"] - before["stats"]["hits"] == _slots(batch).unique().numel()
        assert torch.equal(forward["dirty"], before["dirty"])


def test_value_slots_of_a_compiled_share_are_the_torch_paths(monkeypatch) -> None:
    """`CacheEngine.value_slots` (computed when a compiled share is read without its TBE)
    gives each value the slot `_direct_slots` gives it."""
    ebc, _ = _build(monkeypatch)
    engine = ebc.engines.engines[0]
    for shape in ("random", "equal", "long", "empty"):
        batch = _batches(1, shape, seed=5)[0]
        p = engine.direct_share(batch)
        assert p is not None and p.direct.slots is None
        lengths = batch.lengths()
        expected = engine._direct_slots(batch, batch.values(), lengths)
        assert torch.equal(engine.value_slots(p), expected)


def test_distinct_rows_kernel() -> None:
    """`BitmapDirectRows` finds each batch's distinct slots (in order of first sight), batch
    after batch (its bitmap cleared each time, after a refused batch too), and refuses an id
    out of its feature's table or offsets that do not span the values."""
    rows, bases = [300, 300, 200], [0, 0, 300]  # f0, f1 share the table at slot 0
    distinct = implementations("ids")["native"].direct_rows(rows, bases, 500)
    assert isinstance(distinct, BitmapDirectRows)
    gen = torch.Generator().manual_seed(2)
    for batch in _batches(3, "random", seed=9) + _batches(2, "long", seed=9):
        values, offsets = batch.values(), batch.offsets()
        assert values.dtype == offsets.dtype == torch.int64  # what the compiled pass takes
        feature = torch.arange(3).repeat_interleave(torch.tensor(batch.length_per_key()))
        slots = values + torch.tensor(bases)[feature]
        found = distinct(values, offsets, B)
        assert found is not None
        first = torch.tensor([slots[: i + 1].eq(s).sum() == 1 for i, s in enumerate(slots)])
        assert torch.equal(found, slots[first] if slots.numel() else slots[:0])
        assert torch.equal(found.sort().values, slots.unique())
        bad = values.clone()
        if bad.numel():
            pos = int(torch.randint(0, bad.numel(), (1,), generator=gen))
            bad[pos] = rows[int(feature[pos])]  # one past its table's last row
            assert distinct(bad, offsets, B) is None
            bad[pos] = -1
            assert distinct(bad, offsets, B) is None
            assert not distinct.seen.any(), "a refused batch left bits set"
            short = offsets.clone()
            short[-1] -= 1
            assert distinct(values, short, B) is None
        assert distinct(values, offsets[:-1], B) is None
        assert not distinct.seen.any()
