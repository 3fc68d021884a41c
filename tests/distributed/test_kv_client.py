"""The KV client (RecStore's calls), DistTensor and DistEmbedding.

* DistTensor: get/set round trip, declarations by name (same shape attaches, another shape or
  dtype is refused), ids checked, DGL-style ``init_func(shape, dtype)``.
* KVClient: `update_async` really is asynchronous (a store whose writes are held back shows
  the handle pending and the rows unchanged), keeps submission order and applies every update
  exactly once (bit-exact sequential sums), and a `pull` right after it sees it; `prefetch` +
  `wait_and_get`.
* DistEmbedding: the backward's ``_trace`` holds unique ids and summed gradients equal to a
  dense reference's, on the ids' device; `SparseSGD` steps to ``w - lr * g`` (duplicate ids
  included).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torchrec import KeyedJaggedTensor

import embcache

TIMEOUT_S = 10.0  # bound on every wait, so a broken client fails instead of hanging


@pytest.fixture(autouse=True)
def fresh_kv_client():
    embcache.reset_kv_client()
    yield
    embcache.reset_kv_client()


class GatedKV(embcache.HostKV):
    """A HostKV whose writes wait for ``gate`` (open by default) and then sleep ``delay``."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.delay = delay
        self.writing = threading.Event()  # set once a write is waiting at the gate

    def put(self, table, ids, rows) -> None:
        self.writing.set()
        assert self.gate.wait(TIMEOUT_S), "the test never opened the gate"
        if self.delay:
            time.sleep(self.delay)
        super().put(table, ids, rows)


def _client(store=None) -> embcache.KVClient:
    return embcache.get_kv_client(store)


# ----------------------------------------------------------------------------------------------
# DistTensor


@pytest.mark.parametrize("ids_shape", [(7,), (2, 3)], ids=["1d", "2d"])
def test_dist_tensor_set_then_get(ids_shape: tuple[int, ...]) -> None:
    t = embcache.DistTensor((40, 5), torch.float32, name="rt")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(40, generator=gen)[: torch.Size(ids_shape).numel()].reshape(ids_shape)
    rows = torch.randn(*ids_shape, 5, generator=gen)
    t[ids] = rows
    got = t[ids]
    assert got.shape == (*ids_shape, 5)
    assert torch.equal(got, rows)
    # duplicates and the last row in a read
    again = t[torch.tensor([int(ids.flatten()[0]), int(ids.flatten()[0]), 39])]
    assert torch.equal(again[0], rows.reshape(-1, 5)[0])
    assert torch.equal(again[1], again[0])
    assert len(t) == 40


def test_dist_tensor_same_name_attaches_to_the_same_rows() -> None:
    a = embcache.DistTensor((10, 3), torch.float32, name="shared")
    b = embcache.DistTensor((10, 3), torch.float32, name="shared")
    a[torch.tensor([4])] = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(b[torch.tensor([4])], torch.tensor([[1.0, 2.0, 3.0]]))


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((10, 4), torch.float32), ((11, 3), torch.float32), ((10, 3), torch.float64)],
    ids=["other-dim", "other-rows", "other-dtype"],
)
def test_dist_tensor_same_name_other_declaration_is_refused(shape, dtype) -> None:
    embcache.DistTensor((10, 3), torch.float32, name="declared")
    with pytest.raises(ValueError, match="declared"):
        embcache.DistTensor(shape, dtype, name="declared")


@pytest.mark.parametrize("bad", [-1, 10, 2**40], ids=["negative", "at-rows", "huge"])
def test_dist_tensor_ids_out_of_range_are_refused(bad: int) -> None:
    t = embcache.DistTensor((10, 3), torch.float32, name="ranged")
    before = t[torch.arange(10)]
    with pytest.raises(ValueError, match=str(bad)):
        t[torch.tensor([0, bad])]
    with pytest.raises(ValueError, match=str(bad)):
        t[torch.tensor([1, bad])] = torch.ones(2, 3)
    with pytest.raises(ValueError):
        _client().update_async("ranged", torch.tensor([bad]), torch.ones(1, 3))
    assert torch.equal(t[torch.arange(10)], before)


def test_dist_tensor_init_func_is_used() -> None:
    calls = []

    def init_func(shape, dtype):
        calls.append((tuple(shape), dtype))
        return torch.arange(shape[0] * shape[1], dtype=dtype).reshape(shape) / 8

    t = embcache.DistTensor((6, 4), torch.float32, name="initialised", init_func=init_func)
    assert calls == [((6, 4), torch.float32)]
    assert torch.equal(t[torch.arange(6)], torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8)


def test_default_init_is_independent_of_access_order() -> None:
    a = embcache.DistTensor((50, 3), torch.float32, name="order_a")
    forward = a[torch.arange(50)]
    embcache.reset_kv_client()
    b = embcache.DistTensor((50, 3), torch.float32, name="order_a")
    backward = torch.cat([b[torch.tensor([i])] for i in range(49, -1, -1)]).flip(0)
    assert torch.equal(forward, backward)
    assert bool((forward != 0).any())


# ----------------------------------------------------------------------------------------------
# KV client


def test_update_async_returns_before_the_update_is_applied() -> None:
    store = GatedKV()
    kv = _client(store)
    kv.init_data("slow", (8, 2), torch.float32)
    ids = torch.tensor([1, 5])
    before = kv.pull("slow", ids)
    store.gate.clear()
    handle = kv.update_async("slow", ids, torch.ones(2, 2))
    assert store.writing.wait(TIMEOUT_S)
    assert not handle.done()
    assert torch.equal(store.get("slow", ids), before)  # the tier has not seen it yet
    store.gate.set()
    kv.wait(handle)
    assert handle.done()
    assert torch.equal(store.get("slow", ids), before + 1)


def test_update_async_keeps_order_and_applies_each_update_once() -> None:
    kv = _client(GatedKV(delay=0.002))
    kv.init_data("ordered", (6, 3), torch.float32)
    ids = torch.tensor([0, 3, 5])
    expected = kv.pull("ordered", ids).clone()
    gen = torch.Generator().manual_seed(1)
    handles = []
    for _ in range(20):
        delta = torch.randn(3, 3, generator=gen) * 1e-3
        expected = expected + delta  # float32, in submission order
        handles.append(kv.update_async("ordered", ids, delta))
    kv.flush()
    assert all(h.done() for h in handles)
    assert torch.equal(kv.pull("ordered", ids), expected)


def test_update_async_sums_duplicate_ids() -> None:
    kv = _client()
    kv.init_data("dups", (4, 2), torch.float32, init_func=lambda s, d: torch.zeros(s, dtype=d))
    kv.wait(kv.update_async("dups", torch.tensor([2, 2, 0, 2]), torch.ones(4, 2)))
    assert torch.equal(
        kv.pull("dups", torch.arange(4)), torch.tensor([[1.0] * 2, [0.0] * 2, [3.0] * 2, [0.0] * 2])
    )


def test_pull_right_after_update_async_sees_it() -> None:
    store = GatedKV(delay=0.05)
    kv = _client(store)
    kv.init_data("ryw", (5, 2), torch.float32)
    ids = torch.tensor([4, 1])
    before = kv.pull("ryw", ids)
    kv.update_async("ryw", ids, torch.full((2, 2), 0.5))
    assert torch.equal(kv.pull("ryw", ids), before + 0.5)  # no wait, no flush
    handle = kv.prefetch("ryw", ids)
    kv.update_async("ryw", ids, torch.full((2, 2), 0.25))  # after the prefetch: not in it
    assert torch.equal(kv.wait_and_get(handle), before + 0.5)
    assert torch.equal(kv.pull("ryw", ids), before + 0.75)


def test_prefetch_then_wait_and_get() -> None:
    kv = _client()
    kv.init_data("pf", (30, 4), torch.float32)
    ids = torch.tensor([[3, 29], [3, 0]])
    handle = kv.prefetch("pf", ids)
    rows = kv.wait_and_get(handle)
    assert rows.shape == (4, 4)
    assert torch.equal(rows, kv.pull("pf", ids.flatten()))
    assert torch.equal(rows[0], rows[2])


def test_push_and_update_async_interleave_in_order() -> None:
    kv = _client(GatedKV(delay=0.002))
    kv.init_data("mixed", (3, 2), torch.float32)
    ids = torch.tensor([0, 2])
    kv.update_async("mixed", ids, torch.ones(2, 2))
    kv.push("mixed", ids, torch.full((2, 2), 10.0))  # overwrites the earlier update
    kv.update_async("mixed", ids, torch.ones(2, 2))
    kv.flush()
    assert torch.equal(kv.pull("mixed", ids), torch.full((2, 2), 11.0))


@pytest.mark.parametrize(
    ("grads", "error"),
    [
        (torch.tensor([[float("nan"), 0.0]]), ValueError),
        (torch.ones(1, 3), ValueError),
        (torch.ones(1, 2, dtype=torch.int64), TypeError),
    ],
    ids=["nan", "wrong-shape", "integer"],
)
def test_update_async_refuses_bad_grads(grads: torch.Tensor, error: type) -> None:
    kv = _client()
    kv.init_data("checked", (3, 2), torch.float32)
    before = kv.pull("checked", torch.arange(3))
    with pytest.raises(error):
        kv.update_async("checked", torch.tensor([1]), grads)
    kv.flush()
    assert torch.equal(kv.pull("checked", torch.arange(3)), before)


def test_get_kv_client_is_one_per_process() -> None:
    kv = _client()
    assert embcache.get_kv_client() is kv
    with pytest.raises(ValueError):
        embcache.get_kv_client(embcache.HostKV())


# ----------------------------------------------------------------------------------------------
# DistEmbedding


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


def test_push_refuses_duplicate_ids_and_init_func_of_wrong_shape() -> None:
    kv = _client()
    kv.init_data("strict", (5, 2), torch.float32)
    before = kv.pull("strict", torch.arange(5))
    with pytest.raises(ValueError, match="duplicate"):
        kv.push("strict", torch.tensor([1, 1]), torch.ones(2, 2))
    assert torch.equal(kv.pull("strict", torch.arange(5)), before)
    with pytest.raises(ValueError, match="shape"):
        kv.init_data("bad_init", (5, 2), torch.float32, init_func=lambda s, d: torch.zeros(5, 3))


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
