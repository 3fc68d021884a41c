"""RecStoreEmbeddingCollection: the sequence collection's tables are tensors of its KV client,
as `RecStoreEmbeddingBagCollection`'s are.

* ``kv_client.pull`` returns the rows the forward reads, before and after training steps (dirty
  cached rows, a cache that evicts), against a float64 dense reference of the training, with
  SparseSGD's own rule and with a backend optimizer driving the rows.
* ``push`` changes what the next forward returns; ``update_async`` applies the collection's
  optimizer (none attached: SGD at its ``lr``; a sparse optimizer; the backend optimizer when
  the client has one), against a float64 reference of that update on those ids (duplicates,
  the last row, state carried between calls).
* Two live collections (sequence or bag) cannot register the same table name on one client.
* RecStore's constructor conventions and backend-optimizer rules.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor

import embcache
from embcache.recstore.kv_client import KVClient
from tests.recstore.test_collection import ROWS, TABLE_OF, make_kjt

# The features and rows of test_collection's CONFIGS (so its make_kjt fits), dims not powers of 2.
CONFIGS = [
    {"name": "t0", "embedding_dim": 5, "num_embeddings": 60, "feature_names": ["f0", "f1"]},
    {"name": "t1", "embedding_dim": 3, "num_embeddings": 40, "feature_names": ["f2"]},
]
NUM_ROWS = {"t0": 60, "t1": 40}
EVICTING = embcache.CacheConfig(capacity=8, ways=2)
RTOL, ATOL = 1e-5, 1e-6

Rule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def collection(**kwargs) -> embcache.RecStoreEmbeddingCollection:
    kwargs.setdefault("seed", 0)
    return embcache.RecStoreEmbeddingCollection(embedding_configs=CONFIGS, **kwargs)


def kjt_of(ids: dict[str, list[int]]) -> KeyedJaggedTensor:
    """One sample per feature holding ``ids`` (every feature of ROWS, empty where not given)."""
    values = [torch.tensor(ids.get(f, []), dtype=torch.int64) for f in ROWS]
    lengths = torch.tensor([v.numel() for v in values])
    return KeyedJaggedTensor.from_lengths_sync(list(ROWS), torch.cat(values), lengths)


def dense_rows(module) -> dict[str, torch.Tensor]:
    """Every row of every table through the KV client, float64."""
    kv = module.kv_client
    return {t: kv.pull(t, torch.arange(n)).double() for t, n in NUM_ROWS.items()}


def assert_forward_reads(module, kjt: KeyedJaggedTensor, dense: dict[str, torch.Tensor]) -> None:
    """The no-grad forward returns ``dense``'s row of every id, key by key."""
    with torch.no_grad():
        out = module(kjt)
    assert list(out) == list(ROWS)
    for f, jt in out.items():
        assert torch.equal(jt.lengths(), kjt[f].lengths())
        expected = dense[TABLE_OF[f]][kjt[f].values()]
        torch.testing.assert_close(jt.values().double(), expected, rtol=RTOL, atol=ATOL)


def table_grads(kjt: KeyedJaggedTensor, coeffs: dict[str, torch.Tensor]):
    """``{table: (unique ids, summed float64 gradient rows)}`` of ``sum(values * coeffs)``."""
    out = {}
    for t, n in NUM_ROWS.items():
        features = [f for f in ROWS if TABLE_OF[f] == t]
        ids = torch.cat([kjt[f].values() for f in features])
        grads = torch.cat([coeffs[f] for f in features]).double()
        dense = torch.zeros(n, grads.shape[1], dtype=torch.float64).index_add_(0, ids, grads)
        unique = torch.unique(ids)
        out[t] = (unique, dense[unique])
    return out


# float64 references of the rules: (weights [rows, dim], state [rows, dim], unique ids, grads)


def sgd(lr: float) -> Rule:
    def step(w, acc, ids, g):
        w[ids] -= lr * g

    return step


def adagrad(lr: float, eps: float = 1e-10) -> Rule:
    def step(w, acc, ids, g):
        acc[ids] += g * g
        w[ids] -= lr * g / (acc[ids].sqrt() + eps)

    return step


def rowwise_adagrad(lr: float, eps: float = 1e-10) -> Rule:
    def step(w, acc, ids, g):  # one accumulator per row, kept in every column
        acc[ids] += (g * g).mean(dim=1, keepdim=True)
        w[ids] -= lr * g / (acc[ids].sqrt() + eps)

    return step


# ----------------------------------------------------------------------------------------------
# pull: the rows the forward reads


@pytest.mark.parametrize("cache", [EVICTING, None], ids=["evicting-cache", "every-row-cached"])
@pytest.mark.parametrize(
    ("backend", "rule"),
    [(None, sgd(0.2)), ({"type": "AdaGrad", "learning_rate": 0.05}, adagrad(0.05))],
    ids=["sparse-sgd", "backend-adagrad"],
)
def test_pull_returns_the_rows_the_forward_reads(cache, backend, rule: Rule) -> None:
    """Train with SparseSGD(lr=0.2) (on a backend client the backend's rule applies), and after
    every step pull every row: the float64 reference's, which the next forward reads too."""
    if backend is not None:
        embcache.get_kv_client(optimizer=backend)
    m = collection(cache=cache)
    assert m.kv_client is embcache.get_kv_client()
    assert (m.backend_optimizer is None) == (backend is None)
    opt = embcache.SparseSGD([m], lr=0.2)
    dense = dense_rows(m)
    state = {t: torch.zeros_like(w) for t, w in dense.items()}
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        kjt = make_kjt(gen, batch=5)
        out = m(kjt)
        coeffs = {f: torch.randn(jt.values().shape, generator=gen) for f, jt in out.items()}
        sum((jt.values() * coeffs[f]).sum() for f, jt in out.items()).backward()
        opt.step()
        for t, (ids, g) in table_grads(kjt, coeffs).items():
            rule(dense[t], state[t], ids, g)
        for t, w in dense_rows(m).items():
            torch.testing.assert_close(w, dense[t], rtol=RTOL, atol=ATOL)
        assert_forward_reads(m, kjt, dense)
    if cache is EVICTING:
        assert any(bool(c.dirty.any()) for c in m.caches()), "no dirty cached row was pulled"
    for t in NUM_ROWS:
        weight = m.state_dict()[f"embeddings.{t}.weight"]
        assert torch.equal(m.kv_client.pull(t, torch.arange(NUM_ROWS[t])), weight)


# ----------------------------------------------------------------------------------------------
# push and update_async


@pytest.mark.parametrize("cache", [EVICTING, None], ids=["evicting-cache", "every-row-cached"])
def test_push_changes_what_the_next_forward_returns(cache) -> None:
    m = collection(cache=cache)
    opt = embcache.SparseSGD([m], lr=0.1)
    kv = m.kv_client
    gen = torch.Generator().manual_seed(1)
    m(make_kjt(gen)).popitem()[1].values().sum().backward()  # some rows dirty in the cache
    opt.step()
    dense = dense_rows(m)
    pushed = {"t0": torch.tensor([0, 7, 59, 31]), "t1": torch.tensor([39, 2])}  # last rows too
    for t, ids in pushed.items():
        rows = torch.randn(ids.numel(), dense[t].shape[1], generator=gen)
        kv.push(t, ids, rows)
        dense[t][ids] = rows.double()
    kjt = kjt_of({"f0": [59, 7, 7, 1], "f1": [0, 31, 59], "f2": [39, 2, 39, 5]})
    assert_forward_reads(m, kjt, dense)
    for t, w in dense_rows(m).items():
        assert torch.equal(w, dense[t]), t


def _none(m) -> None:
    return None


@pytest.mark.parametrize(
    ("backend", "attach", "rule"),
    [
        (None, _none, sgd(0.3)),  # the collection's lr
        (None, lambda m: embcache.SparseSGD([m], lr=0.2), sgd(0.2)),
        (None, lambda m: embcache.SparseAdaGrad([m], lr=0.1), adagrad(0.1)),
        (None, lambda m: embcache.SparseRowWiseAdaGrad([m], lr=0.1), rowwise_adagrad(0.1)),
        (
            {"type": "AdaGrad", "learning_rate": 0.05},
            lambda m: embcache.SparseSGD([m], lr=0.2),
            adagrad(0.05),
        ),
        ({"type": "RowWiseAdaGrad", "learning_rate": 0.07}, _none, rowwise_adagrad(0.07)),
    ],
    ids=[
        "none-attached",
        "sparse-sgd",
        "sparse-adagrad",
        "sparse-rowwise-adagrad",
        "backend-adagrad-under-sparse-sgd",
        "backend-rowwise-adagrad",
    ],
)
@pytest.mark.parametrize("cache", [EVICTING, None], ids=["evicting-cache", "every-row-cached"])
def test_update_async_applies_the_collections_optimizer(cache, backend, attach, rule) -> None:
    """Two update_async calls per table (duplicate ids, the last row, ids in both calls, so the
    state the first leaves matters) give the float64 reference of the rule on those ids."""
    if backend is not None:
        embcache.get_kv_client(optimizer=backend)
    m = collection(cache=cache, lr=0.3)
    attach(m)
    kv = m.kv_client
    dense = dense_rows(m)
    state = {t: torch.zeros_like(w) for t, w in dense.items()}
    gen = torch.Generator().manual_seed(2)
    calls = {
        "t0": [torch.tensor([3, 3, 59, 10, 3]), torch.tensor([59, 0, 10, 10])],
        "t1": [torch.tensor([39, 1, 1]), torch.tensor([1, 39, 20])],
    }
    for t, per_call in calls.items():
        for ids in per_call:
            grads = torch.randn(ids.numel(), dense[t].shape[1], generator=gen)
            kv.wait(kv.update_async(t, ids, grads))
            unique = torch.unique(ids)
            summed = torch.zeros_like(dense[t]).index_add_(0, ids, grads.double())[unique]
            rule(dense[t], state[t], unique, summed)
            torch.testing.assert_close(kv.pull(t, unique).double(), dense[t][unique])
    for t, w in dense_rows(m).items():
        torch.testing.assert_close(w, dense[t], rtol=RTOL, atol=ATOL)
    assert_forward_reads(m, kjt_of({"f0": [3, 59], "f1": [10, 0, 3], "f2": [1, 39, 20]}), dense)


# ----------------------------------------------------------------------------------------------
# one collection per table name


def test_two_live_collections_cannot_register_the_same_table_name() -> None:
    a = collection()
    with pytest.raises(ValueError, match="another live collection"):
        collection()
    bag_t0 = [{"name": "t0", "embedding_dim": 5, "num_embeddings": 60, "feature_names": ["f0"]}]
    with pytest.raises(ValueError, match="another live collection"):
        embcache.RecStoreEmbeddingBagCollection(embedding_bag_configs=bag_t0)
    embcache.get_kv_client().init_data("free", (3, 2))
    with pytest.raises(ValueError, match="already holds a tensor"):
        embcache.RecStoreEmbeddingCollection(
            [{"name": "free", "embedding_dim": 2, "num_embeddings": 3, "feature_names": ["x"]}]
        )
    other = collection(store=embcache.HostKV())  # another store: another client, no conflict
    assert other.kv_client is not a.kv_client
    del a
    gc.collect()
    assert collection().kv_client.shape("t0") == (60, 5)  # the name is free again


# ----------------------------------------------------------------------------------------------
# RecStore's constructor conventions and backend-optimizer rules


def test_recstore_constructor_conventions() -> None:
    torchrec_configs = [
        EmbeddingConfig(name="e", embedding_dim=7, num_embeddings=11, feature_names=["x"])
    ]
    m = embcache.RecStoreEmbeddingCollection(torchrec_configs, 0.05, need_indices=True)
    assert m.lr == 0.05 and m.need_indices() and m.embedding_dim() == 7
    assert isinstance(m, embcache.CachedEmbeddingCollection)
    assert m.kv_client.shape("e") == (11, 7)
    out = m(KeyedJaggedTensor.from_lengths_sync(["x"], torch.tensor([10, 10]), torch.tensor([2])))
    assert out["x"].values().shape == (2, 7)
    assert torch.equal(out["x"].weights(), torch.tensor([10, 10]))

    with pytest.raises(ValueError, match="fast path"):
        collection(fast_path_mode="off")
    with pytest.raises(ValueError, match="go together"):
        collection(ps_port=6379)
    own = KVClient(embcache.HostKV())
    m = collection(kv_client=own, initialize_tables=False)
    assert m.kv_client is own and m.store is own.store
    assert own.pull("t1", [39]).shape == (1, 3)
    with pytest.raises(ValueError, match="not both"):
        collection(kv_client=KVClient(embcache.HostKV()), store=embcache.HostKV())
    with pytest.raises(ValueError, match="pool"):
        embcache.RecStoreEmbeddingCollection(
            [embcache.TableConfig(name="p", embedding_dim=2, num_embeddings=3,
                                  feature_names=["p"], pooling="sum")],
            store=embcache.HostKV(),
        )  # fmt: skip


def test_backend_optimizer_rules() -> None:
    embcache.get_kv_client(optimizer={"type": "AdaGrad", "learning_rate": 0.05})
    with pytest.raises(ValueError, match="optimizer_type"):
        collection(optimizer_type=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.05})
    m = collection()
    with pytest.raises(ValueError, match="backend optimizer"):
        embcache.SparseRowWiseAdaGrad([m], lr=0.05)
    embcache.SparseAdaGrad([m], lr=0.05)  # the backend's own settings: accepted
    assert collection(store=embcache.HostKV()).backend_optimizer is None  # a client of its own


@pytest.mark.parametrize("kind", ["sequence", "bag"])
def test_a_fused_optimizer_on_a_client_without_a_backend_one(kind: str) -> None:
    """``optimizer_type=`` attaches its optimizer while the collection is built, before the
    KV client is joined; the backward then updates the rows the client reads, and
    update_async applies the same rule."""
    fused = {"optimizer_type": torch.optim.SGD, "optimizer_kwargs": {"lr": 0.1}}
    if kind == "sequence":
        m = collection(cache=EVICTING, **fused)
    else:
        m = embcache.RecStoreEmbeddingBagCollection(CONFIGS, cache=EVICTING, seed=0, **fused)
    assert m.backend_optimizer is None
    dense = dense_rows(m)
    kjt = kjt_of({"f0": [4, 4, 59], "f2": [39]})
    out = m(kjt)
    values = [out[f].values() for f in ROWS] if kind == "sequence" else [out.values()]
    sum(v.sum() for v in values).backward()  # gradient 1 per occurrence (bag: per bag)
    dense["t0"][4] -= 0.1 * 2
    dense["t0"][59] -= 0.1
    dense["t1"][39] -= 0.1
    ids, grads = torch.tensor([59, 0]), torch.ones(2, 5)
    m.kv_client.wait(m.kv_client.update_async("t0", ids, grads))
    dense["t0"][ids] -= 0.1
    for t, w in dense_rows(m).items():
        torch.testing.assert_close(w, dense[t], rtol=RTOL, atol=ATOL)
