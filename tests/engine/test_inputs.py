"""JaggedBatch, PooledEmbeddings and TableConfig: embcache's own input, output and table config,
read like torchrec's KJT, KeyedTensor and EmbeddingBagConfig, and checked the same way."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType

import embcache
from embcache import JaggedBatch, PooledEmbeddings, TableConfig

KEYS = ["f0", "f1", "f2"]


def _random_batch(gen: torch.Generator, batch: int = 5, weighted: bool = False):
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=gen)
    lengths[0] = 0  # an empty bag
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return lengths, values, weights


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_jagged_batch_reads_like_the_same_kjt(weighted: bool) -> None:
    lengths, values, weights = _random_batch(torch.Generator().manual_seed(0), weighted=weighted)
    jb = JaggedBatch.from_lengths(KEYS, values, lengths, weights)
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, weights)
    assert jb.keys() == kjt.keys()
    assert jb.stride() == kjt.stride()
    assert torch.equal(jb.values(), kjt.values())
    assert torch.equal(jb.lengths(), kjt.lengths())
    assert torch.equal(jb.offsets(), kjt.offsets())
    assert jb.length_per_key() == kjt.length_per_key()
    assert jb.offset_per_key() == kjt.offset_per_key()
    for key in KEYS:
        assert torch.equal(jb[key].values(), kjt[key].values()), key
        assert torch.equal(jb[key].lengths(), kjt[key].lengths()), key
        if weighted:
            assert torch.equal(jb[key].weights(), kjt[key].weights()), key
    assert (jb.weights_or_none() is None) == (not weighted)
    back = JaggedBatch.from_kjt(jb.to_kjt())
    assert back.keys() == KEYS and torch.equal(back.values(), values)


def test_from_offsets_equals_from_lengths_and_refuses_a_nonzero_start() -> None:
    lengths, values, _ = _random_batch(torch.Generator().manual_seed(1))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    a = JaggedBatch.from_offsets(KEYS, values, offsets)
    b = JaggedBatch.from_lengths(KEYS, values, lengths)
    assert torch.equal(a.lengths(), b.lengths()) and torch.equal(a.offsets(), b.offsets())
    with pytest.raises(ValueError, match="start at 0, got 2"):
        JaggedBatch.from_offsets(KEYS, values, offsets + 2)


def test_pooled_embeddings_reads_like_a_keyed_tensor() -> None:
    values = torch.randn(4, 3 + 5 + 2)
    ours = PooledEmbeddings(["a", "b", "c"], [3, 5, 2], values)
    theirs = KeyedTensor(keys=["a", "b", "c"], length_per_key=[3, 5, 2], values=values)
    assert ours.keys() == theirs.keys()
    assert ours.length_per_key() == theirs.length_per_key()
    assert ours.offset_per_key() == theirs.offset_per_key()
    assert torch.equal(ours.values(), theirs.values())
    mine, ref = ours.to_dict(), theirs.to_dict()
    assert list(mine) == list(ref)
    for k in ref:
        assert torch.equal(mine[k], ref[k]), k
        assert torch.equal(ours[k], theirs[k]), k


def _tables(kind: str):
    fields = [
        dict(name="t0", embedding_dim=6, num_embeddings=60, feature_names=["f0", "f1"]),
        dict(name="t1", embedding_dim=3, num_embeddings=50, feature_names=["f2"], pooling="mean"),
    ]
    if kind == "dict":
        return fields
    if kind == "TableConfig":
        return [TableConfig(**f) for f in fields]
    pool = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
    return [EmbeddingBagConfig(**{**f, "pooling": pool[f.get("pooling", "sum")]}) for f in fields]


def _train(tables, inputs, weighted: bool = False):
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=tables,
        is_weighted=weighted,
        cache=embcache.CacheConfig(capacity=8, ways=4),
        store=embcache.HostKV(),
        seed=0,  # the same rows in every collection, whatever torch's generator holds
    )
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    outs = []
    gen = torch.Generator().manual_seed(7)
    for batch in inputs:
        out = ebc(batch)
        coeff = torch.randn(out.values().shape, generator=gen)
        ((out.values() * coeff).sum() + out.values().square().sum()).backward()
        opt.step()
        outs.append(out)
    return ebc, outs


@pytest.mark.parametrize("kind", ["dict", "TableConfig", "EmbeddingBagConfig"])
def test_jagged_batch_trains_bit_identically_to_the_kjt(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    raw = [_random_batch(gen, batch=6) for _ in range(4)]
    jbs = [JaggedBatch.from_lengths(KEYS, v, ln) for ln, v, _ in raw]
    kjts = [KeyedJaggedTensor.from_lengths_sync(KEYS, v, ln) for ln, v, _ in raw]
    ours, our_outs = _train(_tables(kind), jbs)
    ref, ref_outs = _train(_tables("EmbeddingBagConfig"), kjts)
    for a, b in zip(our_outs, ref_outs, strict=True):
        assert isinstance(a, PooledEmbeddings) and isinstance(b, KeyedTensor)
        assert a.keys() == b.keys() and a.length_per_key() == b.length_per_key()
        assert torch.equal(a.values(), b.values())
    for name in ("t0", "t1"):
        assert torch.equal(ours.table_rows(name), ref.table_rows(name)), name


BAD = {
    # name: (exception, batch builder, words the message must hold)
    "2-D ids": (
        ValueError,
        lambda: JaggedBatch.from_lengths(KEYS, torch.ones(2, 2, dtype=torch.int64), torch.ones(3)),
        ["1-D", "(2, 2)"],
    ),
    "duplicate key": (
        ValueError,
        lambda: JaggedBatch.from_lengths(["f0", "f0", "f2"], torch.ones(3), torch.ones(3)),
        ["duplicate", "'f0'"],
    ),
    "float lengths": (
        TypeError,
        lambda: JaggedBatch.from_lengths(KEYS, torch.ones(3, dtype=torch.int64), torch.ones(3)),
        ["lengths", "float32"],
    ),
    "lengths not per feature": (
        ValueError,
        lambda: JaggedBatch.from_lengths(
            KEYS, torch.ones(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64)
        ),
        ["multiple", "3 features"],
    ),
    "kjt offsets past 0": (
        ValueError,
        lambda: KeyedJaggedTensor(
            keys=KEYS, values=torch.arange(6), offsets=torch.tensor([2, 3, 4, 6])
        ),
        ["offsets", "start at 0", "2"],
    ),
    "not a batch": (TypeError, lambda: {"f0": torch.ones(2)}, ["JaggedBatch", "dict"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_what_and_changes_nothing(case: str) -> None:
    error, build, words = BAD[case]
    ebc, _ = _train(_tables("TableConfig"), [])
    before = {n: ebc.table_rows(n) for n in ("t0", "t1")}
    with pytest.raises(error) as info:
        ebc(build())
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert [c.locked_slots() for c in ebc.caches()] == [0, 0]
    for n, rows in before.items():
        assert torch.equal(ebc.table_rows(n), rows), n


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(num_embeddings=0), ["num_embeddings", "positive int"]),
        (dict(embedding_dim=2.5), ["embedding_dim"]),
        (dict(feature_names="f0"), ["feature_names", "list of strings"]),
        (dict(feature_names=["f", "f"]), ["feature_names", "repeat"]),
        (dict(init_fn=0.1), ["init_fn", "callable"]),
        (dict(data_type="int8"), ["data_type", "FP16"]),
        (dict(pooling="median"), ["pooling", "median"]),
        (dict(name=""), ["name"]),
    ],
    ids=[
        "zero-rows",
        "float-dim",
        "str-features",
        "repeated-feature",
        "init-not-callable",
        "int8",
        "bad-pooling",
        "no-name",
    ],
)
def test_table_config_refuses_bad_fields(fields: dict, words: list[str]) -> None:
    base = dict(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    with pytest.raises(ValueError) as info:
        TableConfig(**{**base, **fields})
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


def test_table_config_pooling_names_match_torchrec() -> None:
    for name, mode in (("SUM", "sum"), ("MEAN", "mean")):
        ours = embcache.CachedEmbeddingBagCollection(
            tables=[
                TableConfig(
                    name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"], pooling=mode
                )
            ]
        ).tables[0]
        theirs = embcache.CachedEmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="t",
                    embedding_dim=4,
                    num_embeddings=10,
                    feature_names=["f"],
                    pooling=PoolingType[name],
                )
            ]
        ).tables[0]
        assert ours == theirs
    with pytest.raises(ValueError, match="NONE"):
        embcache.CachedEmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="t",
                    embedding_dim=4,
                    num_embeddings=10,
                    feature_names=["f"],
                    pooling=PoolingType.NONE,
                )
            ]
        )


def test_jagged_batch_keys_not_looked_up_and_unused_weights_are_ignored() -> None:
    gen = torch.Generator().manual_seed(5)
    lengths, values, weights = _random_batch(gen, batch=4, weighted=True)
    exact = JaggedBatch.from_lengths(KEYS, values, lengths)
    extra_len = torch.tensor([2, 0, 1, 1])
    extra_val = torch.tensor([9, 8, 7, 6])
    lenient = JaggedBatch.from_lengths(
        ["x", *KEYS], torch.cat([extra_val, values]), torch.cat([extra_len, lengths]),
        torch.cat([torch.rand(4), weights]),
    )  # fmt: skip
    _, want = _train(_tables("TableConfig"), [exact])
    _, got = _train(_tables("TableConfig"), [lenient])
    assert got[0].keys() == want[0].keys() == KEYS
    assert torch.equal(got[0].values(), want[0].values())


def test_a_table_config_without_features_looks_up_its_own_name() -> None:
    tables = [
        TableConfig(name="t", embedding_dim=4, num_embeddings=10),
        dict(name="u", embedding_dim=2, num_embeddings=5),
    ]
    ebc = embcache.CachedEmbeddingBagCollection(tables=tables)
    out = ebc(JaggedBatch.from_lengths(["u", "t"], torch.tensor([1, 2]), torch.tensor([1, 1])))
    assert out.keys() == ["t", "u"] and out.values().shape == (1, 6)
