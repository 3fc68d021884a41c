"""The backend optimizer of a KV client drives a RecStore collection's rows (RecStore's page:
"SparseSGD aggregates ``_trace`` and calls ``kv_client.update_async(name, ids, grads)``; the
learning rate and the optimizer formula are handled by the backend"); without one the sparse
optimizer's own rule applies, and DistEmbedding keeps its Python-side SGD."""

from __future__ import annotations

import pytest
import torch
from torchrec import KeyedJaggedTensor

import embcache
from embcache.recstore.kv_client import KVClient
from tests.recstore.test_collection import CONFIGS, ROWS, TABLE_OF, make_kjt, pooled

STEPS = 6


def rows_of(module) -> dict[str, torch.Tensor]:
    return {
        c["name"]: module.kv_client.pull(c["name"], torch.arange(c["num_embeddings"])).double()
        for c in CONFIGS
    }


def grads_of(weights: dict[str, torch.Tensor], kjt: KeyedJaggedTensor, coef: torch.Tensor):
    """Per-table float64 gradients of ``(pooled * coef).sum()`` ([rows, dim], zero where
    untouched) and the touched ids."""
    leaves = {t: w.clone().requires_grad_(True) for t, w in weights.items()}
    (pooled(leaves, kjt) * coef).sum().backward()
    touched = {t: torch.zeros(w.shape[0], dtype=torch.bool) for t, w in weights.items()}
    for f in ROWS:
        touched[TABLE_OF[f]][kjt[f].values()] = True
    return {t: leaves[t].grad for t in weights}, touched


def train(module, opt, reference_step) -> None:
    gen = torch.Generator().manual_seed(3)
    weights = rows_of(module)
    state = {t: torch.zeros_like(w) for t, w in weights.items()}
    for _ in range(STEPS):
        kjt = make_kjt(gen)
        out = module(kjt).values()
        coef = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out * coef.float()).sum().backward()
        opt.step()
        grads, touched = grads_of(weights, kjt, coef)
        for t in weights:
            reference_step(weights[t], state[t], grads[t], touched[t])
    module.flush()
    for t, w in rows_of(module).items():
        torch.testing.assert_close(w, weights[t], rtol=1e-5, atol=1e-6)


def adagrad(lr: float, eps: float = 1e-10):
    def step(w, acc, g, touched):
        acc[touched] += g[touched] ** 2
        w[touched] -= lr * g[touched] / (acc[touched].sqrt() + eps)

    return step


def sgd(lr: float):
    def step(w, acc, g, touched):
        w[touched] -= lr * g[touched]

    return step


def test_backend_adagrad_drives_the_collection_rows_whatever_sparse_sgd_says() -> None:
    embcache.get_kv_client(optimizer={"type": "AdaGrad", "learning_rate": 0.05})
    ebc = embcache.RecStoreEmbeddingBagCollection(CONFIGS, lr=0.01, seed=0)
    assert ebc.backend_optimizer is not None
    opt = embcache.SparseSGD([ebc], lr=0.01)
    train(ebc, opt, adagrad(0.05))


def test_backend_optimizer_through_recstores_module_paths() -> None:
    from embcache.recstore.KVClient import get_kv_client
    from embcache.recstore.optimizer import SparseSGD
    from embcache.torchrec_kv.EmbeddingBag import RecStoreEmbeddingBagCollection

    get_kv_client(optimizer={"type": "SGD", "learning_rate": 0.2})
    ebc = RecStoreEmbeddingBagCollection(embedding_bag_configs=CONFIGS, lr=0.01, seed=0)
    train(ebc, SparseSGD(params=[ebc], lr=0.01), sgd(0.2))


@pytest.mark.parametrize("make_opt", ["sgd", "adagrad"], ids=["SparseSGD", "SparseAdaGrad"])
def test_without_a_backend_optimizer_the_sparse_optimizer_applies(make_opt: str) -> None:
    """A client never given an optimizer (the default, or a collection's own store's client)
    leaves the rule to the attached sparse optimizer, as before."""
    ebc = embcache.RecStoreEmbeddingBagCollection(CONFIGS, lr=0.01, seed=0)
    assert ebc.backend_optimizer is None
    if make_opt == "sgd":
        train(ebc, embcache.SparseSGD([ebc], lr=0.3), sgd(0.3))
    else:
        train(ebc, embcache.SparseAdaGrad([ebc], lr=0.1), adagrad(0.1))


def test_update_async_on_a_collection_table_uses_the_backend_optimizer() -> None:
    kv = embcache.get_kv_client(optimizer={"type": "AdaGrad", "learning_rate": 0.5})
    ebc = embcache.RecStoreEmbeddingBagCollection(CONFIGS, seed=0)
    ids = torch.tensor([3, 3, 7])
    grads = torch.tensor([[1.0, 2, 0, -1], [1.0, 0, 0, 1], [0.5, 0.5, 0.5, 0.5]])
    before = kv.pull("t0", torch.tensor([3, 7])).double()
    kv.wait(kv.update_async("t0", ids, grads))
    g = torch.stack([grads[0] + grads[1], grads[2]]).double()
    expected = before - 0.5 * g / (g.abs() + 1e-10)  # first AdaGrad step: sqrt(g*g) = |g|
    torch.testing.assert_close(kv.pull("t0", torch.tensor([3, 7])).double(), expected)
    del ebc


def test_another_rule_than_the_backends_is_refused() -> None:
    embcache.get_kv_client(optimizer={"type": "AdaGrad", "learning_rate": 0.05})
    ebc = embcache.RecStoreEmbeddingBagCollection(CONFIGS, seed=0)
    with pytest.raises(ValueError, match="backend optimizer"):
        embcache.SparseRowWiseAdaGrad([ebc], lr=0.05)
    embcache.SparseAdaGrad([ebc], lr=0.05)  # the backend's own settings: accepted


def test_dist_embedding_keeps_python_side_sgd_on_a_backend_client() -> None:
    embcache.get_kv_client(optimizer={"type": "AdaGrad", "learning_rate": 0.05})
    emb = embcache.DistEmbedding(10, 3, name="d", init_func=lambda s, d: torch.ones(s, dtype=d))
    opt = embcache.SparseSGD([emb], lr=0.1)
    emb(torch.tensor([1, 1, 4])).sum().backward()
    opt.step()
    expected = torch.ones(10, 3)
    expected[1] -= 0.1 * 2
    expected[4] -= 0.1
    torch.testing.assert_close(emb.weight[torch.arange(10)], expected)


def test_a_collection_of_its_own_store_has_no_backend_optimizer() -> None:
    kv = KVClient(optimizer={"type": "AdaGrad", "learning_rate": 0.05})
    own = embcache.RecStoreEmbeddingBagCollection(CONFIGS, kv_client=kv, seed=0)
    assert own.backend_optimizer is not None
    other = embcache.RecStoreEmbeddingBagCollection(CONFIGS, store=embcache.HostKV(), seed=0)
    assert other.backend_optimizer is None
