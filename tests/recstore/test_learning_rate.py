"""One learning rate per KV client (issue 44, finding 11): `KVClient.learning_rate` is the
client's optimizer's (0.01 unless given), what ``update_async`` applies to every tensor declared
without an optimizer of its own; whatever asks ``update_async`` for another one says so once
per tensor (`KVLearningRateWarning`, naming both values), and a client given its optimizer
applies that one learning rate to the collections' tables too. ``SparseSGD.flush()`` exists."""

from __future__ import annotations

import warnings

import pytest
import torch

import embcache
from embcache.recstore import KVLearningRateWarning

TABLE = {"name": "t0", "embedding_dim": 3, "num_embeddings": 8, "feature_names": ["f0"]}
IDS = torch.tensor([1, 5])
GRADS = torch.ones(2, 3)


def _updated(kv, name: str) -> torch.Tensor:
    before = kv.pull(name, IDS).clone()
    kv.wait(kv.update_async(name, IDS, GRADS))
    return before - kv.pull(name, IDS)  # SGD: lr * grad


def test_the_default_client_has_one_learning_rate_for_its_tensors():
    kv = embcache.get_kv_client()
    assert kv.learning_rate == 0.01
    kv.init_data("a", (8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVLearningRateWarning)
        assert torch.allclose(_updated(kv, "a"), torch.full((2, 3), 0.01))


def test_a_tensor_declared_with_another_learning_rate_is_warned_about_once():
    kv = embcache.get_kv_client()
    with pytest.warns(
        KVLearningRateWarning, match=r"'b'.*learning rate 0.5, not the KV client's 0.01"
    ):
        kv.init_data("b", (8, 3), optimizer={"type": "SGD", "learning_rate": 0.5})
    assert torch.allclose(_updated(kv, "b"), torch.full((2, 3), 0.5))  # it keeps its own


@pytest.mark.parametrize("attach", [False, True], ids=["collection_lr", "sparse_sgd"])
def test_a_collection_table_with_another_learning_rate_warns_at_update_async(attach):
    ebc = embcache.RecStoreEmbeddingBagCollection([TABLE], lr=0.2, seed=0)
    kv = ebc.kv_client
    assert kv is embcache.get_kv_client()
    if attach:
        embcache.SparseSGD([ebc], lr=0.3)
    lr = 0.3 if attach else 0.2
    with pytest.warns(
        KVLearningRateWarning, match=f"'t0'.*learning rate {lr}, not the KV client's 0.01"
    ):
        step = _updated(kv, "t0")
    torch.testing.assert_close(step, torch.full((2, 3), lr))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVLearningRateWarning)  # said once per tensor
        _updated(kv, "t0")


def test_a_client_given_its_optimizer_applies_its_learning_rate_everywhere():
    kv = embcache.get_kv_client(optimizer={"type": "SGD", "learning_rate": 0.05})
    assert kv.learning_rate == 0.05
    ebc = embcache.RecStoreEmbeddingBagCollection([TABLE], lr=0.2, seed=0)
    embcache.SparseSGD([ebc], lr=0.3)
    kv.init_data("c", (8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVLearningRateWarning)
        torch.testing.assert_close(_updated(kv, "t0"), torch.full((2, 3), 0.05))
        torch.testing.assert_close(_updated(kv, "c"), torch.full((2, 3), 0.05))


def test_sparse_sgd_has_flush():
    ebc = embcache.RecStoreEmbeddingBagCollection([TABLE], seed=0)
    opt = embcache.recstore.optimizer.SparseSGD([ebc], lr=0.01)
    opt.flush()
