"""DistEmbedding: RecStore's single-table module.

The backward's ``_trace`` holds unique ids and summed gradients equal to a dense reference's, on
the ids' device;
`SparseSGD` steps to ``w - lr * g`` (duplicate ids included); its rows are its ``state_dict()``
and part of `embcache.save` checkpoints, from which a model resumes bit-exact.
"""

from __future__ import annotations

import pytest
import torch
from torchrec import KeyedJaggedTensor

import embcache


def _dense_reference(emb: embcache.DistEmbedding) -> torch.Tensor:
    return emb.weight[torch.arange(emb.num_embeddings)].double().requires_grad_()


@pytest.mark.parametrize(
    "ids",
    [torch.tensor([3, 7, 3, 3, 19, 0]), torch.tensor([[5, 5], [1, 19], [5, 2]])],
    ids=["1d-duplicates", "2d-duplicates"],
)
def test_dist_embedding_trace_holds_unique_ids_and_summed_grads(ids: torch.Tensor) -> None:
    emb = embcache.DistEmbedding(20, 4, name="traced")
    dense = _dense_reference(emb)
    out = emb(ids)
    assert out.shape == (*ids.shape, 4)
    assert torch.equal(out.double(), dense[ids].detach())
    coeff = torch.randn(*ids.shape, 4, generator=torch.Generator().manual_seed(2))
    (out * coeff).square().sum().backward()
    (dense[ids] * coeff.double()).square().sum().backward()
    assert len(emb._trace) == 1
    trace_ids, grads = emb._trace[0]
    expected_ids = torch.unique(ids)
    assert torch.equal(trace_ids, expected_ids)
    torch.testing.assert_close(grads.double(), dense.grad[expected_ids], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lr", [None, 0.3], ids=["module-lr", "given-lr"])
def test_dist_embedding_sgd_step(lr: float | None) -> None:
    emb = embcache.DistEmbedding(20, 4, name="stepped", lr=0.05)
    opt = embcache.SparseSGD([emb]) if lr is None else embcache.SparseSGD([emb], lr=lr)
    expected_lr = 0.05 if lr is None else lr
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        ids = torch.randint(0, 20, (12,), generator=gen)
        ids[1] = ids[0]  # a duplicate
        dense = _dense_reference(emb)
        coeff = torch.randn(12, 4, generator=gen)
        (emb(ids) * coeff).square().sum().backward()
        (dense[ids] * coeff.double()).square().sum().backward()
        opt.step()
        assert emb._trace == []
        expected = dense.detach() - expected_lr * dense.grad
        torch.testing.assert_close(
            emb.weight[torch.arange(20)].double(),
            expected,
            rtol=1e-5,
            atol=1e-6,
            msg=f"step {step}",
        )


def test_dist_embedding_runs_on_the_ids_device(backend: str, device: torch.device) -> None:
    """Ids on the device (CUDA where there is one): rows come back there, the backward sums on
    the gradient's device (Triton or the twin), and SGD writes the tier on the host."""
    emb = embcache.DistEmbedding(20, 4, name="on_device")
    opt = embcache.SparseSGD([emb], lr=0.1)
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([3, 7, 3, 3, 19, 0, 7])
    coeff = torch.randn(ids.numel(), 4, generator=gen)
    dense = _dense_reference(emb)
    out = emb(ids.to(device))
    assert out.device == device
    (out * coeff.to(device)).square().sum().backward()
    (dense[ids] * coeff.double()).square().sum().backward()
    [(trace_ids, grads)] = emb._trace
    assert trace_ids.device == device and grads.device == device
    assert torch.equal(trace_ids.cpu(), torch.unique(ids))
    torch.testing.assert_close(grads.double().cpu(), dense.grad[trace_ids.cpu()])
    opt.step()
    expected = dense.detach() - 0.1 * dense.grad
    torch.testing.assert_close(emb.weight[torch.arange(20)].double(), expected)


def test_dist_embedding_uses_init_func() -> None:
    def init_func(shape, dtype):
        return torch.linspace(-1, 1, shape[0] * shape[1], dtype=dtype).reshape(shape)

    emb = embcache.DistEmbedding(9, 2, name="init_emb", init_func=init_func)
    ids = torch.tensor([8, 0, 4])
    assert torch.equal(emb(ids).detach(), init_func((9, 2), torch.float32)[ids])


def test_dist_embedding_forward_with_pending_trace_is_an_error() -> None:
    emb = embcache.DistEmbedding(10, 3, name="pending")
    opt = embcache.SparseSGD([emb], lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"step|zero_grad"):
        emb(torch.tensor([3]))
    with torch.no_grad():
        emb(torch.tensor([3]))  # evaluation is fine
    opt.zero_grad()
    emb(torch.tensor([3])).sum().backward()
    opt.step()


def test_dist_embedding_ids_out_of_range() -> None:
    emb = embcache.DistEmbedding(10, 3, name="ranged_emb")
    with pytest.raises(ValueError):
        emb(torch.tensor([0, 10]))
    with pytest.raises(ValueError):
        emb(torch.tensor([-1]))
    assert emb._trace == []


def test_dist_embedding_nan_gradient_is_refused() -> None:
    emb = embcache.DistEmbedding(10, 3, name="nan_emb")
    opt = embcache.SparseSGD([emb], lr=0.1)
    before = emb.weight[torch.arange(10)]
    out = emb(torch.tensor([1, 4]))
    out.backward(torch.tensor([[1.0, float("nan"), 0.0], [1.0, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        opt.step()
    assert torch.equal(emb.weight[torch.arange(10)], before)


def test_one_sgd_over_a_dist_embedding_and_a_collection() -> None:
    emb = embcache.DistEmbedding(12, 3, name="beside_ebc")
    ebc = embcache.RecStoreEmbeddingBagCollection(
        embedding_bag_configs=[
            {"name": "t", "embedding_dim": 3, "num_embeddings": 12, "feature_names": ["f"]}
        ],
        store=embcache.HostKV(),
    )
    opt = embcache.SparseSGD([emb, ebc], lr=0.5)
    ids = torch.tensor([2, 2, 7])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.tensor([3]))
    emb_before = emb.weight[torch.arange(12)]
    ebc_before = ebc.state_dict()["embedding_bags.t.weight"]
    (emb(ids).sum() + ebc(kjt).values().sum()).backward()
    opt.step()
    expected_grad = torch.zeros(12, 3).index_add_(0, ids, torch.ones(3, 3))
    torch.testing.assert_close(emb.weight[torch.arange(12)], emb_before - 0.5 * expected_grad)
    torch.testing.assert_close(
        ebc.state_dict()["embedding_bags.t.weight"], ebc_before - 0.5 * expected_grad
    )


# ----------------------------------------------------------------------------------------------
# state_dict and checkpoints


def test_state_dict_holds_the_rows_and_loads_them_back() -> None:
    emb = embcache.DistEmbedding(7, 3, name="sd_emb")
    rows = emb.weight[torch.arange(7)]
    state = emb.state_dict()
    assert list(state) == ["weight"] and torch.equal(state["weight"], rows)
    model = torch.nn.Sequential(emb)
    assert torch.equal(model.state_dict()["0.weight"], rows)
    new = torch.randn(7, 3, generator=torch.Generator().manual_seed(4))
    emb.load_state_dict({"weight": new})
    assert torch.equal(emb.weight[torch.arange(7)], new)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (torch.zeros(6, 3), "size mismatch"),
        (torch.zeros(7, 3, dtype=torch.int64), "floating point"),
        (torch.full((7, 3), float("nan")), "NaN"),
    ],
    ids=["shape", "dtype", "nan"],
)
def test_bad_state_dict_is_refused_and_changes_nothing(value: torch.Tensor, match: str) -> None:
    emb = embcache.DistEmbedding(7, 3, name="sd_bad")
    before = emb.weight[torch.arange(7)]
    with pytest.raises(RuntimeError, match=match):
        emb.load_state_dict({"weight": value})
    with pytest.raises(RuntimeError, match="Missing key"):
        emb.load_state_dict({})
    assert torch.equal(emb.weight[torch.arange(7)], before)


class _Model(torch.nn.Module):
    """A DistEmbedding and a RecStore collection side by side, with a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.user = embcache.DistEmbedding(40, 4, name="user_embedding")
        self.items = embcache.RecStoreEmbeddingBagCollection(
            embedding_bag_configs=[
                {"name": "item", "embedding_dim": 4, "num_embeddings": 50, "feature_names": ["i"]}
            ],
            cache=embcache.CacheConfig(capacity=8, ways=2),
        )
        self.head = torch.nn.Linear(8, 1)

    def forward(self, users: torch.Tensor, items: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([self.user(users), self.items(items).values()], dim=1)
        return self.head(x).square().mean()


def _batch(step: int) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(step)
    users = torch.randint(0, 40, (5,), generator=gen)
    users[1] = users[0]
    items = KeyedJaggedTensor.from_lengths_sync(
        keys=["i"],
        values=torch.randint(0, 50, (9,), generator=gen),
        lengths=torch.tensor([2, 1, 3, 0, 3]),
    )
    return users, items


def _train(model: _Model, sparse, dense, steps: range, backend: bool) -> None:
    kv = embcache.get_kv_client()
    for step in steps:
        loss = model(*_batch(step))
        loss.backward()
        sparse.step()
        dense.step()
        dense.zero_grad()
        if backend:  # the backend optimizer's state beside the DistEmbedding's rows changes too
            kv.update_async("user_embedding", _batch(step)[0], torch.ones(5, 4) * 0.1)


def _build(backend: bool) -> tuple[_Model, embcache.SparseSGD, torch.optim.SGD]:
    if backend:
        embcache.get_kv_client(optimizer=embcache.KVOptimizer("AdaGrad", lr=0.05))
    model = _Model()
    sparse = embcache.SparseSGD([model.user, model.items], lr=0.1)
    return model, sparse, torch.optim.SGD(model.head.parameters(), lr=0.05)


def _everything(model: _Model) -> dict[str, torch.Tensor]:
    kv = embcache.get_kv_client()
    kv.flush()
    return {
        "user_rows_and_state": kv.store.get("user_embedding", torch.arange(40)),
        **{k: v.clone() for k, v in model.state_dict().items()},
    }


@pytest.mark.parametrize("backend", [False, True], ids=["page-usage", "backend-state"])
def test_a_model_with_a_dist_embedding_resumes_bit_exact(tmp_path, backend: bool) -> None:
    """Train, save, train on; a fresh process loads the checkpoint and trains the same steps:
    every row (and the backend optimizer's state beside the DistEmbedding's) is equal."""
    model, sparse, dense = _build(backend)
    _train(model, sparse, dense, range(3), backend)
    embcache.save(tmp_path / "ckpt", model, [sparse, dense])
    _train(model, sparse, dense, range(3, 6), backend)
    straight = _everything(model)
    if backend:
        assert bool((straight["user_rows_and_state"][:, 4:] > 0).any()), "no state to keep"

    embcache.reset_kv_client()  # a new process: the KV client starts empty
    model, sparse, dense = _build(backend)
    embcache.load(tmp_path / "ckpt", model, [sparse, dense])
    _train(model, sparse, dense, range(3, 6), backend)
    resumed = _everything(model)
    assert resumed.keys() == straight.keys()
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key


def test_a_checkpoint_without_the_dist_embedding_is_refused(tmp_path) -> None:
    head = torch.nn.Sequential(torch.nn.Linear(2, 2))
    ebc = embcache.RecStoreEmbeddingBagCollection(
        embedding_bag_configs=[
            {"name": "item", "embedding_dim": 2, "num_embeddings": 5, "feature_names": ["i"]}
        ]
    )
    embcache.save(tmp_path / "ckpt", torch.nn.ModuleDict({"coll": ebc, "head": head}))
    with_emb = torch.nn.ModuleDict(
        {"coll": ebc, "head": head, "user": embcache.DistEmbedding(5, 2, name="user_embedding")}
    )
    before = with_emb["user"].weight[torch.arange(5)]
    with pytest.raises(ValueError, match=r"no rows for tables \[\('user', 'user_embedding'\)\]"):
        embcache.load(tmp_path / "ckpt", with_emb)
    assert torch.equal(with_emb["user"].weight[torch.arange(5)], before)
