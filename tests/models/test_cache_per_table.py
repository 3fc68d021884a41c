"""Cache sizes per table (issue 44, finding 12): ``CacheConfig(load_factor={"t0": 0.1, ...})`` or
``capacity={"t0": rows, ...}`` gives each named table a cache of its own of that size, the
tables not named sharing their dim's cache; bad sizes are refused naming the field and the
table. Training through such caches equals torchrec's ``EmbeddingBagCollection`` + torch SGD."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

import embcache
from embcache import CacheConfig

# t0, t1 and t2 share dim 8 (one cache without per-table sizes), t3 has dim 5.
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=200, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f1"]),
    EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=30, feature_names=["f2"]),
    EmbeddingBagConfig(name="t3", embedding_dim=5, num_embeddings=17, feature_names=["f3"]),
]
ROWS = {t.name: t.num_embeddings for t in TABLES}


def _slots(ebc, table: str) -> int:
    return ebc.engines.engine_of(table).cache.num_slots


def _kjt(step: int, batch: int = 6) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(step)
    lengths, values = [], []
    for t in TABLES:
        ln = torch.randint(0, 5, (batch,), generator=gen)
        ln[0] = 0  # an empty bag
        v = torch.randint(0, t.num_embeddings, (int(ln.sum()),), generator=gen)
        if v.numel() >= 3:
            v[1], v[2] = v[0], t.num_embeddings - 1  # a duplicate, the last row
        lengths.append(ln)
        values.append(v)
    return KeyedJaggedTensor(
        keys=[f for t in TABLES for f in t.feature_names],
        values=torch.cat(values),
        lengths=torch.cat(lengths),
    )


def test_a_load_factor_per_table_gives_each_named_table_its_own_cache():
    lf = {"t0": 0.1, "t1": 0.5}
    ebc = embcache.CachedEmbeddingBagCollection(
        TABLES, cache=CacheConfig(load_factor=lf, ways=4), device="cpu"
    )
    assert len(ebc.caches()) == 4  # t0, t1, {t2} of dim 8, {t3} of dim 5
    assert _slots(ebc, "t0") == 20  # 0.1 * 200 rows, 5 sets of 4 ways
    assert _slots(ebc, "t1") == 20  # 0.5 * 40
    assert ebc.engines.engine_of("t0").cache is not ebc.engines.engine_of("t1").cache
    # Not named: t2 and t3 are cached whole (each the only table of its cache), as by default.
    assert ebc.engines.engine_of("t2").cache.direct and _slots(ebc, "t2") == ROWS["t2"]
    assert ebc.engines.engine_of("t3").cache.direct


def test_a_capacity_per_table_is_the_rows_its_cache_holds():
    ebc = embcache.CachedEmbeddingBagCollection(
        TABLES, cache=CacheConfig(capacity={"t0": 12, "t3": 17}, ways=4), device="cpu"
    )
    assert _slots(ebc, "t0") == 12
    assert ebc.engines.engine_of("t3").cache.direct  # 17 rows: the whole table
    # t1 and t2 share one cache (their dim's), whole.
    assert ebc.engines.engine_of("t1").cache is ebc.engines.engine_of("t2").cache
    assert _slots(ebc, "t1") == ROWS["t1"] + ROWS["t2"]


def _only(feature: str, ids: torch.Tensor) -> KeyedJaggedTensor:
    """One bag per id of ``feature``; the other features' bags empty."""
    keys = [f for t in TABLES for f in t.feature_names]
    lengths = [
        torch.ones(ids.numel(), dtype=torch.int64) if k == feature
        else torch.zeros(ids.numel(), dtype=torch.int64)
        for k in keys
    ]  # fmt: skip
    return KeyedJaggedTensor(keys=keys, values=ids, lengths=torch.cat(lengths))


def _second_pass_hits(cache: CacheConfig, churn: bool) -> float:
    """Hits of t1's 39 rows looked up again, after t0's 200 rows (``churn``) or nothing."""
    ebc = embcache.CachedEmbeddingBagCollection(TABLES, cache=cache, device="cpu")
    every_t1 = _only("f1", torch.arange(39))
    with torch.no_grad():
        ebc(every_t1)
        if churn:
            ebc(_only("f0", torch.arange(200)))
        ebc.reset_stats()
        ebc(every_t1)
    return ebc.cache_stats()["hits"]


def test_a_table_with_its_own_cache_keeps_its_rows_while_another_table_churns():
    own = CacheConfig(capacity={"t0": 8, "t1": 39}, ways=4)
    assert _second_pass_hits(own, churn=True) == _second_pass_hits(own, churn=False) > 30
    # The same 47 rows in one shared cache of dim 8: t0's rows evict t1's.
    shared = CacheConfig(capacity=47, ways=4)
    assert _second_pass_hits(shared, churn=True) < _second_pass_hits(shared, churn=False)


@pytest.mark.parametrize(
    "cache",
    [
        CacheConfig(load_factor={"t0": 0.05, "t1": 0.25}, ways=2),
        CacheConfig(capacity={"t0": 3, "t2": 5}, ways=2),
    ],
    ids=["load_factor", "capacity"],
)
def test_training_through_per_table_caches_equals_torchrec(cache):
    torch.manual_seed(3)
    ref = EmbeddingBagCollection(TABLES)
    ebc = embcache.CachedEmbeddingBagCollection(TABLES, cache=cache, device="cpu")
    ebc.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = embcache.SparseSGD([ebc], lr=0.1)
    for step in range(4):
        kjt = _kjt(step)
        out, want = ebc(kjt).values(), ref(kjt).values()
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        out.square().sum().backward()
        want.square().sum().backward()
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
    assert ebc.cache_stats()["evictions"] > 0
    ebc.flush()
    got, want = ebc.state_dict(), ref.state_dict()
    for t in TABLES:
        key = f"embedding_bags.{t.name}.weight"
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"load_factor": {"t0": 1.5}}, ValueError, "load_factor['t0'] must be in (0, 1]"),
        ({"load_factor": {"t0": "0.1"}}, TypeError, "load_factor['t0'] must be a float"),
        ({"capacity": {"t1": 0}}, ValueError, "CacheConfig.capacity['t1'] must be >= 1 row"),
        ({"capacity": {"t1": 2.5}}, TypeError, "CacheConfig.capacity['t1'] must be an int"),
        ({"capacity": {"t1": 4}, "load_factor": 0.5}, ValueError, "not both"),
        ({"load_factor": [0.1]}, TypeError, "CacheConfig.load_factor must be a float"),
    ],
    ids=["lf_range", "lf_type", "cap_range", "cap_type", "both", "list"],
)  # fmt: skip
def test_bad_per_table_sizes_are_refused_naming_field_and_table(kwargs, error, words):
    with pytest.raises(error) as info:
        CacheConfig(**kwargs)
    text = str(info.value)
    assert words in text and "\n" not in text
    assert "CacheConfig" in text


@pytest.mark.parametrize("field", ["load_factor", "capacity"])
def test_a_size_for_an_unknown_table_is_refused_before_anything_is_built(field):
    store = embcache.kv.HostKV()
    cache = CacheConfig(**{field: {"t0": 1 if field == "capacity" else 0.5, "t9": 1}})
    with pytest.raises(ValueError) as info:
        embcache.CachedEmbeddingBagCollection(TABLES, cache=cache, store=store, device="cpu")
    text = str(info.value)
    assert f"CacheConfig.{field} names table 't9'" in text and "'t3'" in text
    assert not store.tables()  # nothing declared in the tier
