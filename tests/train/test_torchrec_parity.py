"""On the same Criteo text file and from the same weights, DLRM over embcache's cached
collection (SparseAdaGrad, a 10% cache) and DLRM over torchrec's EmbeddingBagCollection trained
with torch.optim.Adagrad reach the same held-out AUC and log loss."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

import embcache
from embcache.data import CriteoText
from embcache.train.loop import evaluate
from tests.data.formats import write_criteo

STEPS, BATCH, DIM = 60, 128, 8
LR, DENSE_LR = 0.05, 0.01


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _dlrm(collection_or_tables, **kwargs) -> embcache.DLRM:
    return embcache.DLRM(
        collection_or_tables, dense_in_features=13, bottom_mlp=(16, DIM), top_mlp=(16,),
        seed=5, **kwargs,
    )  # fmt: skip


def test_embcache_and_torchrec_reach_the_same_auc(tmp_path: Path) -> None:
    data = CriteoText(write_criteo(tmp_path / "train.txt", 9000, seed=7), BATCH, buckets=300)
    ours = _dlrm(data.tables(DIM), cache=embcache.CacheConfig(load_factor=0.1))
    configs = [
        EmbeddingBagConfig(name=t.name, embedding_dim=DIM, num_embeddings=t.num_embeddings,
                           feature_names=t.feature_names)
        for t in data.tables(DIM)
    ]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=configs)
    ebc.load_state_dict(ours.sparse_arch.state_dict())  # the same starting rows
    theirs = _dlrm(ebc)  # and, by the seed, the same MLPs
    sparse_opt = embcache.SparseAdaGrad(ours.sparse_arch, lr=LR)
    dense_opt = torch.optim.Adagrad(ours.dense_parameters(), lr=DENSE_LR)
    torch_opt = torch.optim.Adagrad(
        [{"params": ebc.parameters(), "lr": LR}, {"params": theirs.dense_parameters()}],
        lr=DENSE_LR,
    )
    for batch in itertools.islice(data.train_batches(), STEPS):
        loss = ours.loss(ours(batch.dense_features, batch.sparse_features), batch.labels)
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        dense_opt.zero_grad()
        kjt = batch.sparse_features.to_kjt()
        ref = theirs.loss(theirs(batch.dense_features, kjt), batch.labels)
        ref.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)

    got = evaluate(ours, data.eval_batches())
    held = list(data.eval_batches())
    for b in held:  # the same held-out batches, in torchrec's input type
        b.sparse_features = b.sparse_features.to_kjt()
    want = evaluate(theirs, held)
    assert got["samples"] == want["samples"] > 800
    assert got["auc"] > 0.7, got  # it learned: the labels follow cat_0, cat_3 and I1
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-4)
    assert got["logloss"] == pytest.approx(want["logloss"], rel=1e-4)
    ours.sparse_arch.flush()
    for name, weight in ebc.state_dict().items():
        torch.testing.assert_close(
            ours.sparse_arch.state_dict()[name], weight, rtol=1e-3, atol=1e-4
        )
