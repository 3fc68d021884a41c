"""The synthetic Criteo-like data: seeded, scaled, in range, skewed, and learnable."""

from __future__ import annotations

import math

import pytest
import torch

from embcache.data.synthetic import (
    CRITEO_KAGGLE_CARDINALITIES,
    NUM_DENSE,
    SyntheticConfig,
    SyntheticCriteo,
)
from embcache.train.loop import binary_metrics


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one CPU thread is faster than two spin-waiting on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _data(**kw) -> SyntheticCriteo:
    kw.setdefault("scale", 0.001)
    kw.setdefault("batch_size", 256)
    return SyntheticCriteo(SyntheticConfig(**kw))


def _same(a, b) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.labels, b.labels)
    )


def test_criteo_cardinalities() -> None:
    assert len(CRITEO_KAGGLE_CARDINALITIES) == 26
    assert sum(CRITEO_KAGGLE_CARDINALITIES) == 33_762_577


def test_same_seed_same_batches_in_any_order() -> None:
    a, b = _data(seed=3), _data(seed=3)
    assert _same(a.batch(5), b.batch(5))
    forward = [a.batch(i) for i in range(3)]
    backward = [b.batch(i) for i in reversed(range(3))][::-1]
    assert all(_same(x, y) for x, y in zip(forward, backward, strict=True))


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ((0, "train", 0), (1, "train", 0)),
        ((0, "train", 0), (0, "eval", 0)),
        ((0, "train", 0), (0, "train", 1)),
    ],
    ids=["seed", "split", "index"],
)
def test_different_streams_differ(left, right) -> None:
    a = _data(seed=left[0]).batch(left[2], left[1])
    b = _data(seed=right[0]).batch(right[2], right[1])
    assert not torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert not torch.equal(a.dense_features, b.dense_features)


@pytest.mark.parametrize("scale", [1e-6, 0.001, 0.05], ids=lambda s: f"scale{s:g}")
def test_cardinalities_scaled(scale: float) -> None:
    data = _data(scale=scale, batch_size=8)
    expected = [max(1, math.ceil(c * scale)) for c in CRITEO_KAGGLE_CARDINALITIES]
    assert data.rows == expected
    tables = data.tables(dim=8)
    assert [t.num_embeddings for t in tables] == expected
    assert [t.feature_names for t in tables] == [[f"cat_{i}"] for i in range(26)]


@pytest.mark.parametrize("multi_hot", [1, 3], ids=["one_hot", "multi_hot3"])
def test_batch_layout_and_ids_in_range(multi_hot: int) -> None:
    data = _data(scale=0.0005, batch_size=100, multi_hot=multi_hot)
    batch = data.batch(0)
    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    assert kjt.stride() == 100
    assert torch.equal(kjt.lengths(), torch.full((2600,), multi_hot))
    assert batch.dense_features.shape == (100, NUM_DENSE)
    assert batch.dense_features.dtype == torch.float32
    assert bool(torch.isfinite(batch.dense_features).all())
    assert batch.labels.shape == (100,)
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    for key, rows in zip(kjt.keys(), data.rows, strict=True):
        ids = kjt[key].values()
        assert ids.dtype == torch.int64
        assert int(ids.min()) >= 0 and int(ids.max()) < rows, key
    # The smallest tables are hit at their last row too.
    assert int(kjt["cat_8"].values().max()) == data.rows[8] - 1


def _top_share(ids: torch.Tensor, rows: int, fraction: float) -> float:
    counts = torch.bincount(ids, minlength=rows).sort(descending=True).values
    k = max(1, int(rows * fraction))
    return float(counts[:k].sum()) / ids.numel()


def test_zipf_skew_is_measurable() -> None:
    table = 2  # 10M rows at full scale, 10,132 here
    skewed = _data(scale=0.001, batch_size=4096, zipf=1.05)
    uniform = _data(scale=0.001, batch_size=4096, zipf=0.0)
    rows = skewed.rows[table]
    ids_s = torch.cat([skewed.batch(i).sparse_features["cat_2"].values() for i in range(5)])
    ids_u = torch.cat([uniform.batch(i).sparse_features["cat_2"].values() for i in range(5)])
    # Top 1% of ids: a Zipf(1.05) law over 10k ranks puts ~60% of the mass there.
    assert _top_share(ids_s, rows, 0.01) > 0.4
    assert _top_share(ids_u, rows, 0.01) < 0.05
    # Hot ids are scattered over the table, not packed at its start.
    hottest = torch.bincount(ids_s, minlength=rows).topk(10).indices
    assert int(hottest.max()) > rows // 10


def test_labels_vary_and_follow_the_hidden_model() -> None:
    data = _data(scale=0.001, batch_size=2048, positive_rate=0.26)
    labels = torch.cat([data.batch(i).labels for i in range(4)])
    assert 0.18 < float(labels.mean()) < 0.34
    hidden = torch.cat([data.hidden_logits(i) for i in range(4)])
    assert binary_metrics(hidden, labels)["auc"] > 0.8


def test_labels_are_learnable_from_ids() -> None:
    """Per-id click rates counted on the training split predict the held-out labels."""
    data = _data(scale=0.001, batch_size=4096)
    table, key = 23, "cat_23"  # a label table (287 rows here)
    rows = data.rows[table]
    clicks, views = torch.zeros(rows), torch.zeros(rows)
    for i in range(4):
        b = data.batch(i)
        ids = b.sparse_features[key].values()
        clicks.index_add_(0, ids, b.labels)
        views.index_add_(0, ids, torch.ones_like(b.labels))
    rate = (clicks + 1) / (views + 4)  # smoothed towards ~0.25
    held = data.batch(0, split="eval")
    scores = torch.logit(rate[held.sparse_features[key].values()])
    assert binary_metrics(scores, held.labels)["auc"] > 0.6


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"scale": 0.0}, "scale"),
        ({"scale": 1.5}, "scale"),
        ({"batch_size": 0}, "batch_size"),
        ({"multi_hot": 0}, "multi_hot"),
        ({"zipf": -1.0}, "zipf"),
        ({"seed": -1}, "seed"),
        ({"label_tables": (26,)}, "label_tables"),
        ({"positive_rate": 1.0}, "positive_rate"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_config_checked(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticConfig(**kw)


def test_bad_split_and_index() -> None:
    data = _data(batch_size=4)
    with pytest.raises(ValueError, match="split"):
        data.batch(0, split="test")
    with pytest.raises(ValueError, match="index"):
        data.batch(-1)
