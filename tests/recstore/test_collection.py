"""RecStoreEmbeddingBagCollection as the RecStore page describes it.

* Its tables are tensors of its KV client (``module.kv_client``, `get_kv_client()` for the
  default store): ``pull`` sees a dirty cached row, ``push``/``update_async``/``add_async`` are
  applied coherently with the cache (against a float64 dense reference over training steps with
  a cache that evicts), and ``update_async`` with a sparse optimizer attached is exactly that
  optimizer's step.
* ``issue_fused_prefetch`` returns while its tier read is still held back, and the forward
  after it finished makes no tier call; the handle is recorded on the module.
* Handles cannot leak: 300 steps of each misuse pattern with a scratch area of one batch end
  with nothing locked and never run out of room.
* RecStore's names and constructor keywords.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torchrec import KeyedJaggedTensor

import embcache
from embcache.recstore.kv_client import KVClient
from tests.recstore.conftest import TIMEOUT_S, GatedKV

CONFIGS = [
    {"name": "t0", "embedding_dim": 4, "num_embeddings": 60, "feature_names": ["f0", "f1"]},
    {"name": "t1", "embedding_dim": 3, "num_embeddings": 40, "feature_names": ["f2"]},
]
ROWS = {"f0": 60, "f1": 60, "f2": 40}
TABLE_OF = {"f0": "t0", "f1": "t0", "f2": "t1"}


def make_kjt(gen: torch.Generator, batch: int = 4) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (3 * batch,), generator=gen)
    limits = torch.tensor(list(ROWS.values())).repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=gen) * limits).long()
    return KeyedJaggedTensor.from_lengths_sync(keys=list(ROWS), values=values, lengths=lengths)


def pooled(weights: dict[str, torch.Tensor], kjt: KeyedJaggedTensor) -> torch.Tensor:
    """The float64 reference: sum-pooled bags of each feature, side by side."""
    blocks = []
    for f in ROWS:
        jt = kjt[f]
        w = weights[TABLE_OF[f]]
        bags = [w[ids].sum(0) for ids in torch.split(jt.values(), jt.lengths().tolist())]
        blocks.append(torch.stack(bags))
    return torch.cat(blocks, dim=1)


def collection(**kwargs) -> embcache.RecStoreEmbeddingBagCollection:
    """A collection of CONFIGS whose rows depend on the seed alone (two built alike agree)."""
    kwargs.setdefault("seed", 0)
    return embcache.RecStoreEmbeddingBagCollection(embedding_bag_configs=CONFIGS, **kwargs)


def locked(m) -> int:
    return sum(c.locked_slots() for c in m.caches())


# ----------------------------------------------------------------------------------------------
# one view of the rows


def test_the_collection_tables_are_tensors_of_the_kv_client() -> None:
    """Code written from the page: train a collection with table t0, then read t0 through the
    KV client while its newest rows are dirty in the cache."""
    module = collection(lr=0.1, cache=embcache.CacheConfig(capacity=8, ways=2))
    opt = embcache.SparseSGD([module], lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        module(make_kjt(gen)).values().sum().backward()
        opt.step()
    assert any(bool(c.dirty.any()) for c in module.caches()), "no dirty cached row to read"
    ids = torch.arange(60)
    got = embcache.get_kv_client().pull("t0", ids)
    assert torch.equal(got, module.state_dict()["embedding_bags.t0.weight"])
    assert module.kv_client is embcache.get_kv_client()
    assert embcache.get_kv_client().shape("t1") == (40, 3)


def test_kv_calls_on_collection_tables_stay_coherent_with_the_cache() -> None:
    m = collection(cache=embcache.CacheConfig(capacity=6, ways=2))
    opt = embcache.SparseSGD([m], lr=0.1)
    kv = m.kv_client
    dense = {k.split(".")[1]: v.double() for k, v in m.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        kjt = make_kjt(gen)
        weights = {t: w.clone().requires_grad_() for t, w in dense.items()}
        expected = pooled(weights, kjt)
        coeff = torch.randn(expected.shape, generator=gen)
        out = m(kjt).values()
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
        (out * coeff).sum().backward()
        opt.step()
        (expected * coeff.double()).sum().backward()
        dense = {t: (w - 0.1 * w.grad).detach() for t, w in weights.items()}

        # between steps, through the KV client: pull, push, the backend step, a raw add
        ids = torch.randint(0, 60, (10,), generator=gen)
        torch.testing.assert_close(kv.pull("t0", ids).double(), dense["t0"][ids])
        pushed = torch.randperm(40, generator=gen)[:5]
        rows = torch.randn(5, 3, generator=gen)
        kv.push("t1", pushed, rows)
        dense["t1"][pushed] = rows.double()
        ids[1] = ids[0]
        grads = torch.randn(10, 4, generator=gen)
        kv.wait(kv.update_async("t0", ids, grads))
        dense["t0"].index_add_(0, ids, -0.1 * grads.double())  # the attached SGD's lr
        added = torch.randint(0, 40, (6,), generator=gen)
        deltas = torch.randn(6, 3, generator=gen)
        kv.wait(kv.add_async("t1", added, deltas))
        dense["t1"].index_add_(0, added, deltas.double())
        assert locked(m) == 0
    for name, value in m.state_dict().items():
        torch.testing.assert_close(value.double(), dense[name.split(".")[1]], rtol=1e-5, atol=1e-6)
    m.flush()  # the tier alone now holds the model
    for t in ("t0", "t1"):
        tier = m.store.get(t, torch.arange(dense[t].shape[0]))
        torch.testing.assert_close(tier.double(), dense[t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda m: embcache.SparseAdaGrad([m], lr=0.1),
        lambda m: embcache.SparseRowWiseAdagrad([m], lr=0.1),
        lambda m: embcache.SparseAdam([m], lr=0.05),
    ],
    ids=["adagrad", "rowwise-adagrad", "adam"],
)
def test_update_async_is_the_attached_optimizers_step(make_opt: Callable) -> None:
    """What the page's SparseSGD does (aggregate the trace, update_async per table) gives the
    same bits as the optimizer's own step, state included."""
    cache = embcache.CacheConfig(capacity=6, ways=2)
    a, b = (
        collection(cache=cache, store=embcache.HostKV()),
        collection(cache=cache, store=embcache.HostKV()),
    )
    opt_a, opt_b = make_opt(a), make_opt(b)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        kjt = make_kjt(gen)
        coeff = torch.randn(4, 11, generator=gen)
        (a(kjt).values() * coeff).sum().backward()
        trace = list(a._trace)
        opt_a.step()
        for table_name, ids, grads in trace:
            b.kv_client.update_async(table_name, ids, grads)
    for key, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[key], value), key
    for table, parts in opt_a.state_dict()["state"][0].items():
        for name, value in parts.items():
            assert torch.equal(opt_b.state_dict()["state"][0][table][name], value), table


def test_two_live_collections_cannot_share_a_table_of_one_client() -> None:
    a = collection()
    with pytest.raises(ValueError, match="another live collection"):
        collection()
    embcache.get_kv_client().init_data("free", (3, 2))
    with pytest.raises(ValueError, match="already holds a tensor"):
        embcache.RecStoreEmbeddingBagCollection(
            embedding_bag_configs=[
                {"name": "free", "embedding_dim": 2, "num_embeddings": 3, "feature_names": ["x"]}
            ]
        )
    del a
    gc.collect()
    assert collection().kv_client.shape("t0") == (60, 4)  # the name is free again


# ----------------------------------------------------------------------------------------------
# asynchronous prefetch


def test_issue_fused_prefetch_returns_before_its_tier_read() -> None:
    """The page's call order overlaps the tier: the issue returns while the worker is held at
    the tier, and the forward after the worker finished reads nothing more."""
    store = GatedKV()
    module = collection(store=store, cache=embcache.CacheConfig(capacity=8, ways=2))
    features = make_kjt(torch.Generator().manual_seed(3))
    reference = collection(store=embcache.HostKV())(features).values()
    store.read_gate.clear()
    store.reading.clear()
    handle = module.issue_fused_prefetch(features)  # returns although the tier is held back
    assert store.reading.wait(TIMEOUT_S), "the prefetch never reached the tier"
    assert not handle.done()
    assert module._fused_prefetch_handle is handle  # recorded on the module, as RecStore does
    store.read_gate.set()
    module.set_fused_prefetch_handle(handle)
    assert handle.wait() is None and handle.done()
    reads = store.gets
    out = module(features).values()
    assert store.gets == reads, "the forward read the tier although its prefetch was done"
    assert torch.equal(out, reference)
    assert module._fused_prefetch_handle is None


# ----------------------------------------------------------------------------------------------
# handles that cannot leak


def _misuse(pattern: str, m, kjt, next_kjt, held: list) -> None:
    """What one step does with prefetch handles before its forward on ``kjt``."""
    if pattern == "issue_without_set":  # RecStore records the handle: the forward uses it
        m.issue_fused_prefetch(kjt)
    elif pattern == "set_then_replaced":  # the user still holds the older handle
        held.append(m.issue_fused_prefetch(kjt))
        m.set_fused_prefetch_handle(held[-1])
        m.issue_fused_prefetch(kjt)
    elif pattern == "issued_for_the_next_batch":  # never used by this forward
        m.issue_fused_prefetch(next_kjt)
    elif pattern == "set_none_and_dropped":
        handle = m.issue_fused_prefetch(kjt)
        m.set_fused_prefetch_handle(None)
        del handle
    elif pattern == "kept_but_never_set":
        held.append(m.issue_fused_prefetch(kjt))
        m.set_fused_prefetch_handle(None)
    elif pattern == "reset_trace":
        m.issue_fused_prefetch(next_kjt)
        m.reset_trace()
    elif pattern == "zero_grad":
        m.issue_fused_prefetch(next_kjt)
        m.zero_grad()
    elif pattern == "used_by_no_grad":
        m.issue_fused_prefetch(kjt)
        with torch.no_grad():
            m(kjt)


PATTERNS = [
    "issue_without_set",
    "set_then_replaced",
    "issued_for_the_next_batch",
    "set_none_and_dropped",
    "kept_but_never_set",
    "reset_trace",
    "zero_grad",
    "used_by_no_grad",
]


@pytest.fixture
def one_thread():
    """Steps this small run fastest on one torch thread (two contend on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.usefixtures("one_thread")
def test_300_steps_of_misuse_leak_no_slot(pattern: str) -> None:
    gen = torch.Generator().manual_seed(4)
    batches = [make_kjt(gen, batch=3) for _ in range(8)]
    per_table = [
        [int(torch.unique(torch.cat([b[f].values() for f in fs])).numel()) for b in batches]
        for fs in (("f0", "f1"), ("f2",))
    ]
    need = max(max(rows) for rows in per_table)  # one batch's rows in one cache
    batch_rows = max(a + b for a, b in zip(*per_table, strict=True))  # ... in both caches
    # A scratch area of one batch: a leaked handle runs it out of room within a few steps.
    m = collection(cache=embcache.CacheConfig(capacity=1, ways=1, max_scratch_rows=need))
    opt = embcache.SparseSGD([m], lr=0.01)
    held: list = []
    for step in range(300):
        kjt, next_kjt = batches[step % 8], batches[(step + 1) % 8]
        _misuse(pattern, m, kjt, next_kjt, held)
        held[:] = held[-1:]  # a user who keeps handles drops them eventually
        m(kjt).values().sum().backward()
        opt.step()
        bound = batch_rows if held else 0  # a handle the user keeps may stay until unused
        assert locked(m) <= bound, f"step {step}: {locked(m)} slots locked"
    held.clear()
    m(batches[0]).values().sum().backward()  # the collection's next call collects them
    opt.step()
    assert locked(m) == 0
    assert all(c.scratch_rows <= need for c in m.caches())
    assert not m.engines.prefetches.issued and m._fused_prefetch_handle is None


# ----------------------------------------------------------------------------------------------
# RecStore's names and keywords


def test_recstore_names() -> None:
    module = collection(lr=0.05)
    assert embcache.SparseRowWiseAdagrad is embcache.SparseRowWiseAdaGrad
    opt = embcache.SparseSGD(params=[module], lr=0.01)
    assert opt.lr == 0.01 and opt.modules == [module]
    with pytest.raises(TypeError, match="once"):
        embcache.SparseSGD([module], params=[module])
    configs = module.embedding_bag_configs()
    assert [(c.name, c.embedding_dim, c.num_embeddings, c.feature_names) for c in configs] == [
        ("t0", 4, 60, ["f0", "f1"]),
        ("t1", 3, 40, ["f2"]),
    ]
    features = make_kjt(torch.Generator().manual_seed(6))
    module(features).values().sum().backward()
    entry = module._trace[0]
    table_name, ids, grads = entry  # (table_name, ids, grads), as the page says
    assert entry[0] == table_name and entry[1] is ids and entry[2] is grads
    assert {e[0] for e in module._trace} == {"t0", "t1"}
    assert ids.dtype == torch.int64 and grads.shape == (ids.numel(), {"t0": 4, "t1": 3}[table_name])
    module.issue_fused_prefetch(features)
    module.reset_trace()
    assert module._trace == [] and locked(module) == 0
    assert module._fused_prefetch_handle is None


def test_recstore_constructor_keywords(tmp_path: Path) -> None:
    from tests.kv.redis_servers import running_server

    with pytest.raises(ValueError, match="fast path"):
        collection(fast_path_mode="off")
    with pytest.raises(ValueError, match="go together"):
        collection(ps_host="127.0.0.1")
    own = KVClient(embcache.HostKV())
    m = collection(kv_client=own, initialize_tables=False)
    assert m.kv_client is own and m.store is own.store
    assert own.pull("t1", [0]).shape == (1, 3)
    with pytest.raises(ValueError, match="not both"):
        collection(kv_client=own, store=embcache.HostKV())
    with running_server(tmp_path) as server:
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        m = collection(ps_host="127.0.0.1", ps_port=port)
        assert m.kv_client is not embcache.get_kv_client()
        opt = embcache.SparseSGD([m])
        m(make_kjt(torch.Generator().manual_seed(7))).values().sum().backward()
        opt.step()
        m.flush()
        assert server.client().keys("*"), "nothing reached the Redis tier"
        m.store.close()
