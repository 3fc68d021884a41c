"""The KV client (RecStore's calls) over a tier.

* The backend optimizer: ``update_async`` hands gradients to SGD, AdaGrad or RowWiseAdaGrad
  (duplicate ids summed first), whose state lives beside the row in the tier; each rule against
  a float64 reference over several calls; configured per tensor or by RecStore's configuration
  keys; the page's example gives RecStore's SGD numbers.
* Asynchrony and order: ``update_async`` returns before the tier has the update (a store whose
  writes are held back), calls keep their order and apply once (``add_async``, the raw additive
  update, gives bit-exact sums), and a ``pull`` right after sees them.
* ``push`` overwrites the weights and keeps the optimizer state; bad ids and values are refused
  with nothing changed.
"""

from __future__ import annotations

import pytest
import torch

import embcache
from embcache.recstore.kv_client import KVClient, KVOptimizer
from tests.recstore.conftest import TIMEOUT_S, GatedKV


def _client(store=None, optimizer=None) -> embcache.KVClient:
    return embcache.get_kv_client(store, optimizer)


def zeros(shape, dtype):
    return torch.zeros(shape, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# the backend optimizer


@pytest.mark.parametrize(
    "grads",
    [[[1, 2], [1, 2], [3, 3]], [[1.0, 2.0], [1.0, 2.0], [3.0, 3.0]]],
    ids=["ints", "floats"],
)
def test_update_async_applies_the_backend_optimizer_as_the_page_says(grads: list) -> None:
    """Code written from the page: the gradients go to the backend's SGD (lr 0.01), which
    steps against them; duplicate ids are summed first."""
    kv = embcache.get_kv_client()
    kv.init_data("kv", (6, 2), torch.float32, init_func=zeros)
    kv.update_async("kv", [1, 1, 4], grads)
    got = kv.pull("kv", [1, 4])
    torch.testing.assert_close(got, torch.tensor([[-0.02, -0.04], [-0.03, -0.03]]))
    assert torch.equal(kv.pull("kv", [0, 2, 3, 5]), torch.zeros(4, 2))


def _reference_step(
    w: torch.Tensor, acc: torch.Tensor, g: torch.Tensor, opt: KVOptimizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """One float64 step of ``opt`` on rows ``w`` with state ``acc`` and summed gradients ``g``."""
    g = g + opt.weight_decay * w
    rule = opt.rule.name
    if rule == "SGD":
        return w - opt.lr * g, acc
    if rule == "ADAGRAD":
        acc = acc + g * g
        return w - opt.lr * g / (acc.sqrt() + opt.eps), acc
    acc = acc + (g * g).mean(dim=1, keepdim=True)
    return w - opt.lr * g / (acc.sqrt() + opt.eps), acc


OPTIMIZERS = {
    "sgd": KVOptimizer("SGD", lr=0.05),
    "sgd-weight-decay": KVOptimizer("SGD", lr=0.05, weight_decay=0.1),
    "adagrad": KVOptimizer("AdaGrad", lr=0.1, initial_accumulator_value=0.25),
    "rowwise-adagrad": KVOptimizer("RowWiseAdaGrad", lr=0.1, eps=1e-8),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_backend_rule_matches_a_float64_reference(name: str) -> None:
    opt = OPTIMIZERS[name]
    rows, dim = 37, 5
    kv = _client()
    kv.init_data("t", (rows, dim), torch.float32, optimizer=opt)
    spec = kv.store.table_spec("t")
    assert spec.state_dim == opt.state_dim(dim) and spec.row_width == dim + spec.state_dim
    w = kv.pull("t", torch.arange(rows)).double()
    acc = torch.full((rows, spec.state_dim), opt.initial_accumulator_value, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        ids = torch.randint(0, rows, (20,), generator=gen)
        ids[1] = ids[0]
        ids[2] = rows - 1
        grads = torch.randn(20, dim, generator=gen)
        kv.update_async("t", ids, grads)
        unique, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(unique.numel(), dim, dtype=torch.float64)
        summed.index_add_(0, inverse, grads.double())
        w[unique], acc[unique] = _reference_step(w[unique], acc[unique], summed, opt)
    kv.flush()
    torch.testing.assert_close(kv.pull("t", torch.arange(rows)).double(), w, rtol=1e-5, atol=1e-6)
    # The state lives beside the row in the tier.
    stored = kv.store.get("t", torch.arange(rows))
    torch.testing.assert_close(stored[:, dim:].double(), acc, rtol=1e-5, atol=1e-6)


def test_optimizer_from_recstore_configuration_and_per_tensor() -> None:
    kv = KVClient(
        optimizer={"type": "RowWiseAdaGrad", "learning_rate": 0.05, "epsilon": 1e-8,
                   "beta1": 0.9, "beta2": 0.98, "weight_decay": 0.0}
    )  # fmt: skip
    kv.init_data("a", (4, 3))
    kv.init_data("b", (4, 3), optimizer=KVOptimizer("sgd", lr=0.5))
    assert kv.optimizer_of("a") == KVOptimizer("RowWiseAdaGrad", lr=0.05, eps=1e-8)
    assert kv.store.table_spec("a").state_dim == 1
    assert kv.store.table_spec("b").state_dim == 0
    before = kv.pull("b", [2])
    kv.update_async("b", [2], [[1.0, 0.0, -2.0]])
    torch.testing.assert_close(kv.pull("b", [2]), before - 0.5 * torch.tensor([[1.0, 0.0, -2.0]]))
    kv.init_data("b", (4, 3), optimizer=KVOptimizer("sgd", lr=0.5))  # the same: a no-op
    with pytest.raises(ValueError, match="cannot redeclare"):
        kv.init_data("b", (4, 3), optimizer=KVOptimizer("AdaGrad"))
    kv.close()


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"type": "Lamb"}, ValueError, "SGD, AdaGrad, RowWiseAdaGrad, Adam, AdamW"),
        ({"type": "SGD", "momentum": 0.9}, ValueError, "momentum"),
        ({"type": "SGD", "learning_rate": -1.0}, ValueError, "lr"),
        ({"type": "AdaGrad", "initial_accumulator_value": -0.1}, ValueError, "initial_acc"),
        ("sgd", TypeError, "KVOptimizer or a configuration mapping"),
    ],
    ids=["unknown-type", "unknown-key", "negative-lr", "negative-accumulator", "a-string"],
)
def test_bad_optimizer_configurations_are_refused(config, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        KVClient(optimizer=config)


def test_push_overwrites_weights_and_keeps_the_optimizer_state() -> None:
    kv = _client()
    kv.init_data("st", (6, 2), init_func=zeros, optimizer=KVOptimizer("AdaGrad", lr=0.1))
    kv.update_async("st", [3], [[3.0, 4.0]])
    kv.flush()
    state = kv.store.get("st", torch.tensor([3]))[:, 2:].clone()
    assert torch.equal(state, torch.tensor([[9.0, 16.0]]))
    kv.push("st", [3], [[1.5, -1.5]])
    assert torch.equal(kv.pull("st", [3]), torch.tensor([[1.5, -1.5]]))
    assert torch.equal(kv.store.get("st", torch.tensor([3]))[:, 2:], state)


# ----------------------------------------------------------------------------------------------
# asynchrony and order


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
    torch.testing.assert_close(store.get("slow", ids), before - 0.01)


def test_calls_keep_their_order_and_apply_once() -> None:
    kv = _client(GatedKV(delay=0.002))
    kv.init_data("ordered", (6, 3), torch.float32)
    ids = torch.tensor([0, 3, 5])
    expected = kv.pull("ordered", ids).clone()
    gen = torch.Generator().manual_seed(1)
    handles = []
    for _ in range(20):
        delta = torch.randn(3, 3, generator=gen) * 1e-3
        expected = expected + delta  # float32, in submission order
        handles.append(kv.add_async("ordered", ids, delta))
    kv.flush()
    assert all(h.done() for h in handles)
    assert torch.equal(kv.pull("ordered", ids), expected)


def test_add_async_sums_duplicate_ids() -> None:
    kv = _client()
    kv.init_data("dups", (4, 2), torch.float32, init_func=zeros)
    kv.wait(kv.add_async("dups", torch.tensor([2, 2, 0, 2]), torch.ones(4, 2)))
    assert torch.equal(
        kv.pull("dups", torch.arange(4)), torch.tensor([[1.0] * 2, [0.0] * 2, [3.0] * 2, [0.0] * 2])
    )


def test_pull_right_after_an_update_sees_it() -> None:
    store = GatedKV(delay=0.05)
    kv = _client(store)
    kv.init_data("ryw", (5, 2), torch.float32, init_func=zeros)
    ids = torch.tensor([4, 1])
    kv.update_async("ryw", ids, torch.full((2, 2), 0.5))
    torch.testing.assert_close(kv.pull("ryw", ids), torch.full((2, 2), -0.005))  # no wait
    handle = kv.prefetch("ryw", ids)
    kv.add_async("ryw", ids, torch.full((2, 2), 0.25))  # after the prefetch: not in it
    torch.testing.assert_close(kv.wait_and_get(handle), torch.full((2, 2), -0.005))
    torch.testing.assert_close(kv.pull("ryw", ids), torch.full((2, 2), 0.245))


def test_prefetch_then_wait_and_get() -> None:
    kv = _client()
    kv.init_data("pf", (30, 4), torch.float32)
    ids = torch.tensor([[3, 29], [3, 0]])
    handle = kv.prefetch("pf", ids)
    rows = kv.wait_and_get(handle)
    assert rows.shape == (4, 4)
    assert torch.equal(rows, kv.pull("pf", ids.flatten()))
    assert torch.equal(rows[0], rows[2])


def test_push_and_updates_interleave_in_order() -> None:
    kv = _client(GatedKV(delay=0.002))
    kv.init_data("mixed", (3, 2), torch.float32)
    ids = torch.tensor([0, 2])
    kv.add_async("mixed", ids, torch.ones(2, 2))
    kv.push("mixed", ids, torch.full((2, 2), 10.0))  # overwrites the earlier update
    kv.add_async("mixed", ids, torch.ones(2, 2))
    kv.update_async("mixed", ids, torch.full((2, 2), 100.0))  # SGD at lr 0.01: -1
    kv.flush()
    assert torch.equal(kv.pull("mixed", ids), torch.full((2, 2), 10.0))


# ----------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize(
    ("grads", "error"),
    [
        (torch.tensor([[float("nan"), 0.0]]), ValueError),
        (torch.ones(1, 3), ValueError),
        (torch.ones(1, 2, dtype=torch.int64), TypeError),
    ],
    ids=["nan", "wrong-shape", "integer-tensor"],
)
@pytest.mark.parametrize("call", ["update_async", "add_async"])
def test_bad_values_are_refused(grads: torch.Tensor, error: type, call: str) -> None:
    kv = _client()
    kv.init_data("checked", (3, 2), torch.float32)
    before = kv.pull("checked", torch.arange(3))
    with pytest.raises(error):
        getattr(kv, call)("checked", torch.tensor([1]), grads)
    kv.flush()
    assert torch.equal(kv.pull("checked", torch.arange(3)), before)


def test_push_refuses_duplicate_ids_and_init_func_of_wrong_shape() -> None:
    kv = _client()
    kv.init_data("strict", (5, 2), torch.float32)
    before = kv.pull("strict", torch.arange(5))
    with pytest.raises(ValueError, match="duplicate"):
        kv.push("strict", torch.tensor([1, 1]), torch.ones(2, 2))
    assert torch.equal(kv.pull("strict", torch.arange(5)), before)
    with pytest.raises(ValueError, match="shape"):
        kv.init_data("bad_init", (5, 2), torch.float32, init_func=lambda s, d: torch.zeros(5, 3))


def test_unknown_tensor_names_what_is_declared() -> None:
    kv = _client()
    kv.init_data("known", (2, 2))
    with pytest.raises(KeyError, match=r"unknown tensor 'other'; declared: \['known'\]"):
        kv.pull("other", [0])


def test_get_kv_client_is_one_per_process() -> None:
    kv = _client()
    assert embcache.get_kv_client() is kv
    with pytest.raises(ValueError, match="another store"):
        embcache.get_kv_client(embcache.HostKV())
    with pytest.raises(ValueError, match="another default optimizer"):
        embcache.get_kv_client(optimizer=KVOptimizer("AdaGrad"))
    assert embcache.get_kv_client(optimizer=KVOptimizer()) is kv
