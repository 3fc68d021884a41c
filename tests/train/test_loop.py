"""The training loop and evaluation: AUC and log loss against float64
references, evaluation of any dataset (no hidden model needed), evaluations during a run kept
out of its cache counters, and counters that are the same with and without prefetch."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

import embcache
from embcache.cache.policy_registry import policy_names
from embcache.data import CriteoText, MovieLens
from embcache.models.dlrm import DLRM
from embcache.train.loop import (
    binary_metrics,
    evaluate,
    make_dense_optimizer,
    make_sparse_optimizer,
    train,
)
from tests.data.formats import write_criteo, write_ml_100k


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a positive > score of a negative) + P(tie) / 2, over every pair, in float64."""
    s = scores.double()
    pos, neg = s[labels > 0.5], s[labels < 0.5]
    greater = (pos[:, None] > neg[None, :]).double().sum()
    ties = (pos[:, None] == neg[None, :]).double().sum()
    return float((greater + 0.5 * ties) / (pos.numel() * neg.numel()))


@pytest.mark.parametrize("n", [2, 7, 123, 1000], ids=lambda n: f"n{n}")
def test_metrics_match_float64_references(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    labels = (torch.rand(n, generator=gen) < 0.3).float()
    labels[:2] = torch.tensor([0.0, 1.0])  # both classes
    logits = torch.randint(-3, 4, (n,), generator=gen).float()  # many ties
    logits += torch.randn(n, generator=gen) * (n > 100)
    got = binary_metrics(logits, labels)
    assert got["auc"] == pytest.approx(reference_auc(logits, labels), abs=1e-6)
    p = torch.sigmoid(logits.double())
    logloss = -(labels * p.log() + (1 - labels) * (1 - p).log()).mean()
    assert got["logloss"] == pytest.approx(float(logloss), rel=1e-5)
    assert got["samples"] == n


def test_auc_needs_no_torchmetrics_and_is_nan_only_for_one_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert math.isnan(binary_metrics(torch.randn(5), torch.zeros(5))["auc"])
    monkeypatch.setitem(sys.modules, "torchmetrics", None)
    monkeypatch.setitem(sys.modules, "torchmetrics.functional.classification", None)
    out = binary_metrics(torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3, 0.7]), torch.tensor([0.0, 1.0] * 3))
    assert out["auc"] == 1.0 and math.isfinite(out["logloss"])


def _model(data, cache: embcache.CacheConfig | None = None, seed: int = 0) -> DLRM:
    bottom = (16, 8) if data.num_dense else ()
    return DLRM(
        data.tables(8),
        cache=cache,
        dense_in_features=data.num_dense,
        bottom_mlp=bottom,
        top_mlp=(16,),
        seed=seed,
    )


def test_evaluate_needs_no_hidden_model(tmp_path: Path) -> None:
    data = MovieLens(write_ml_100k(tmp_path / "ml"), batch_size=100, eval_fraction=0.2)
    model = _model(data)
    got = evaluate(model, data.eval_batches())
    with torch.no_grad():
        batches = list(data.eval_batches())
        logits = torch.cat([model(b.dense_features, b.sparse_features) for b in batches])
    assert got == binary_metrics(logits, torch.cat([b.labels for b in batches]))
    assert got["samples"] == 600 and model.training
    with pytest.raises(ValueError, match="gave no batch"):
        evaluate(model, [])


def _unique_lookups(batches) -> int:
    """Unique (table, id) pairs per batch, summed: a cache's lookups over those batches."""
    return sum(
        int(torch.unique(b.sparse_features[f].values()).numel())
        for b in batches
        for f in b.sparse_features.keys()  # noqa: SIM118 (a JaggedBatch, not a dict)
    )


def test_evaluations_during_a_run_stay_out_of_its_counters(tmp_path: Path) -> None:
    data = CriteoText(write_criteo(tmp_path / "t.txt", 1200, seed=3), batch_size=64, buckets=300)
    model = _model(data, embcache.CacheConfig(load_factor=0.1, ways=4))
    sparse = make_sparse_optimizer("adagrad", model.sparse_arch, 0.05)
    dense = make_dense_optimizer("adagrad", model.dense_parameters(), 0.01)
    result = train(
        model, data.train_batches(), sparse, dense, 12, prefetch=True, progress=False,
        evaluate_every=5, held_out=lambda: data.eval_batches(2),
    )  # fmt: skip
    assert [e["step"] for e in result.evals] == [5.0, 10.0]
    held = sum(b.labels.numel() for b in data.eval_batches(2))
    assert all(0.0 <= e["auc"] <= 1.0 and e["samples"] == held for e in result.evals)
    looked_up = result.cache_stats["hits"] + result.cache_stats["misses"]
    assert looked_up == _unique_lookups(itertools.islice(data.train_batches(), 12))
    assert result.samples == 12 * 64
    with pytest.raises(ValueError, match="evaluate_every needs held_out"):
        train(model, data.train_batches(), sparse, dense, 2, False, False, evaluate_every=1)


@pytest.mark.parametrize("policy", policy_names())
def test_counters_and_weights_are_the_same_with_and_without_prefetch(
    tmp_path: Path, policy: str
) -> None:
    """A cache much smaller than a batch's rows (scratch rows, evictions, write-backs): the
    prefetching run counts what the synchronous one counts, and ends with the same rows."""
    data = CriteoText(write_criteo(tmp_path / "t.txt", 2000, seed=4), batch_size=128, buckets=400)
    runs = []
    for prefetch in (False, True):
        model = _model(data, embcache.CacheConfig(load_factor=0.02, ways=4, policy=policy))
        sparse = make_sparse_optimizer("adagrad", model.sparse_arch, 0.05)
        dense = make_dense_optimizer("adagrad", model.dense_parameters(), 0.01)
        result = train(model, data.train_batches(), sparse, dense, 14, prefetch, False)
        model.sparse_arch.flush()
        runs.append((result, model.sparse_arch.table_rows("t_cat_0")))
    (sync, rows_sync), (pre, rows_pre) = runs
    assert sync.losses == pre.losses
    assert torch.equal(rows_sync, rows_pre)
    assert sync.cache_stats == pre.cache_stats
    assert sync.cache_stats["evictions"] > 0 and sync.cache_stats["writebacks"] > 0
