"""Parity with torchrec and FBGEMM: same weights in, same numbers out.

* Forward: `CachedEmbeddingBagCollection` loaded from a `torchrec.EmbeddingBagCollection`'s
  state_dict gives the same KeyedTensor (keys, length_per_key, values) on random KJTs with empty
  bags, duplicate ids, the last row of each table, a batch of one, weighted SUM and unweighted
  SUM/MEAN, two tables sharing a cache and tables of different dims.
* Training: N steps of `SparseSGD` / `SparseAdaGrad` / `SparseAdam` against torch's SGD /
  Adagrad / SparseAdam on torchrec's EBC (with sparse gradients), caches of 1%, 10% and 100% of
  the rows, LRU and LFU; weights agree after each step (or, without intermediate flushes, at the
  end, so that dirty rows must survive eviction on their own).
* `SparseRowWiseAdaGrad` against FBGEMM's CPU TBE with EXACT_ROWWISE_ADAGRAD.
* KJTs whose keys come in another order, and steps in which a table or the whole batch has no
  ids (torch still counts an optimizer step for every table).
"""

from __future__ import annotations

import pytest
import torch
from torchrec import KeyedJaggedTensor

import embcache
from tests.models.conftest import (
    assert_close,
    assert_state_dicts_close,
    cached_copy,
    feature_rows,
    loss_of,
    random_kjt,
    table_configs,
    torchrec_reference,
)

# (poolings of t0, t1, t2; weighted). torchrec supports per-sample weights with SUM only.
LAYOUTS = {
    "sum-mean-mixed": (("sum", "mean", "mean"), False),
    "all-sum": (("sum", "sum", "sum"), False),
    "all-mean": (("mean", "mean", "mean"), False),
    "all-sum-weighted": (("sum", "sum", "sum"), True),
}

CACHES = {
    "lru-1%": dict(load_factor=0.01, policy="lru"),
    "lfu-1%": dict(load_factor=0.01, policy="lfu"),
    "lru-10%": dict(load_factor=0.1, policy="lru"),
    "lfu-10%": dict(load_factor=0.1, policy="lfu"),
    "lru-10%-4way": dict(load_factor=0.1, policy="lru", ways=4),
    "lfu-10%-4way": dict(load_factor=0.1, policy="lfu", ways=4),
    "full": dict(load_factor=1.0),
}

STEPS = 5


def _forward_cases():
    for layout in LAYOUTS:
        for lf in (0.01, 0.1, 1.0):
            for batch_size in (1, 7):
                yield pytest.param(layout, lf, batch_size, id=f"{layout}-lf{lf}-B{batch_size}")


@pytest.mark.parametrize(("layout", "load_factor", "batch_size"), list(_forward_cases()))
def test_forward_matches_torchrec(layout: str, load_factor: float, batch_size: int) -> None:
    poolings, weighted = LAYOUTS[layout]
    tables = table_configs(poolings)
    ref = torchrec_reference(tables, weighted)
    m = cached_copy(ref, tables, weighted, embcache.CacheConfig(load_factor=load_factor))
    gen = torch.Generator().manual_seed(batch_size)
    for i in range(4):
        kjt = random_kjt(gen, feature_rows(tables), batch_size, weighted=weighted)
        expected = ref(kjt)
        with torch.no_grad():
            no_grad_out = m(kjt)
        grad_out = m(kjt)  # a training forward, never backpropagated
        for out, how in ((no_grad_out, "no_grad"), (grad_out, "grad")):
            assert out.keys() == expected.keys() == ["f0", "f1", "f2", "f3"]
            assert out.length_per_key() == expected.length_per_key() == [6, 6, 6, 3]
            assert out.values().shape == (batch_size, 21)
            assert_close(out.values(), expected.values(), f"batch {i} ({how}) values")
            for key in out.keys():  # noqa: SIM118 (a KeyedTensor, not a dict)
                assert_close(out[key], expected[key], f"batch {i} ({how}) feature {key}")


def test_torchrec_refuses_weighted_mean() -> None:
    """Why weighted parity is checked with SUM only: torchrec (nn.EmbeddingBag) refuses
    per-sample weights with MEAN; our weighted MEAN is checked against a float64 reference in
    test_collection.py."""
    tables = table_configs(("mean", "mean", "mean"))
    ref = torchrec_reference(tables, weighted=True)
    kjt = random_kjt(torch.Generator().manual_seed(0), feature_rows(tables), 3, weighted=True)
    with pytest.raises((NotImplementedError, RuntimeError), match="per_sample_weights"):
        ref(kjt)


# ----------------------------------------------------------------------------------------------
# training


def _torch_optimizer(name: str, ref) -> torch.optim.Optimizer:
    params = list(ref.parameters())
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1, eps=1e-10)
    return torch.optim.SparseAdam(params, lr=0.05, eps=1e-8)


def _our_optimizer(name: str, m) -> embcache.SparseOptimizer:
    if name == "sgd":
        return embcache.SparseSGD([m], lr=0.1)
    if name == "adagrad":
        return embcache.SparseAdaGrad([m], lr=0.1, eps=1e-10)
    return embcache.SparseAdam([m], lr=0.05, eps=1e-8)


def _training_cases():
    for opt in ("sgd", "adagrad", "adam"):
        for cache in CACHES:
            for check in ("every-step", "at-end"):
                yield pytest.param(opt, cache, "sum-mean-mixed", check, id=f"{opt}-{cache}-{check}")
        for cache in ("lru-1%", "lfu-10%-4way", "full"):
            yield pytest.param(
                opt, cache, "all-sum-weighted", "at-end", id=f"{opt}-{cache}-weighted"
            )


@pytest.mark.parametrize(("opt_name", "cache", "layout", "check"), list(_training_cases()))
def test_training_matches_torchrec(opt_name: str, cache: str, layout: str, check: str) -> None:
    poolings, weighted = LAYOUTS[layout]
    tables = table_configs(poolings)
    ref = torchrec_reference(tables, weighted)
    m = cached_copy(ref, tables, weighted, embcache.CacheConfig(**CACHES[cache]))
    ref_opt = _torch_optimizer(opt_name, ref)
    opt = _our_optimizer(opt_name, m)
    gen = torch.Generator().manual_seed(5)
    for step in range(1, STEPS + 1):
        # id_pool: ids recur across steps, so rows are hit, evicted dirty and read back.
        kjt = random_kjt(gen, feature_rows(tables), 8, weighted=weighted, id_pool=80)
        coeff = torch.randn(8, 21, generator=gen)

        ref_opt.zero_grad()
        expected = ref(kjt)
        loss_of(expected.values(), coeff).backward()
        ref_opt.step()

        out = m(kjt)
        assert_close(out.values(), expected.values(), f"step {step} forward")
        loss_of(out.values(), coeff).backward()
        opt.step()
        if check == "every-step":
            assert_state_dicts_close(m.state_dict(), ref.state_dict(), f"after step {step}")
    assert_state_dicts_close(m.state_dict(), ref.state_dict(), f"after {STEPS} steps")
    assert [c.locked_slots() for c in m.caches()] == [0, 0]


# ----------------------------------------------------------------------------------------------
# row-wise AdaGrad against FBGEMM


def _fbgemm_tbe(tables, pooling: str, lr: float, eps: float):
    pytest.importorskip("fbgemm_gpu")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    feature_table_map = [i for i, t in enumerate(tables) for _ in t.feature_names]
    return SplitTableBatchedEmbeddingBagsCodegen(
        [
            (t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
            for t in tables
        ],
        feature_table_map=feature_table_map,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=lr,
        eps=eps,
        pooling_mode=PoolingMode.SUM if pooling == "sum" else PoolingMode.MEAN,
    )


def _rowwise_cases():
    for cache in ("lru-1%", "lfu-1%", "lru-10%-4way", "lfu-10%", "full"):
        yield pytest.param(cache, "sum", False, id=f"{cache}-sum")
    yield pytest.param("lru-1%", "sum", True, id="lru-1%-sum-weighted")
    yield pytest.param("lfu-10%-4way", "mean", False, id="lfu-10%-4way-mean")
    yield pytest.param("full", "mean", False, id="full-mean")


@pytest.mark.parametrize(("cache", "pooling", "weighted"), list(_rowwise_cases()))
def test_rowwise_adagrad_matches_fbgemm(cache: str, pooling: str, weighted: bool) -> None:
    lr, eps = 0.1, 1e-8
    tables = table_configs((pooling,) * 3, dims=(8, 4))  # FBGEMM wants dims % 4 == 0
    ref = torchrec_reference(tables, weighted)  # only its initial weights are used
    tbe = _fbgemm_tbe(tables, pooling, lr, eps)
    initial = ref.state_dict()
    for i, t in enumerate(tables):
        tbe.split_embedding_weights()[i].copy_(initial[f"embedding_bags.{t.name}.weight"])
    m = cached_copy(ref, tables, weighted, embcache.CacheConfig(**CACHES[cache]))
    opt = embcache.SparseRowWiseAdaGrad([m], lr=lr, eps=eps)
    gen = torch.Generator().manual_seed(17)
    for step in range(1, STEPS + 1):
        kjt = random_kjt(gen, feature_rows(tables), 8, weighted=weighted, id_pool=80)
        coeff = torch.randn(8, 28, generator=gen)

        expected = tbe(kjt.values(), kjt.offsets(), per_sample_weights=kjt.weights_or_none())
        loss_of(expected, coeff).backward()

        out = m(kjt)
        assert_close(out.values(), expected, f"step {step} forward")
        loss_of(out.values(), coeff).backward()
        opt.step()

        weights = m.state_dict()
        state = opt.state_dict()["state"][0]
        for i, t in enumerate(tables):
            assert_close(
                weights[f"embedding_bags.{t.name}.weight"],
                tbe.split_embedding_weights()[i],
                f"step {step} table {t.name} weights",
            )
            assert_close(
                state[t.name]["sum"].reshape(-1),
                tbe.split_optimizer_states()[i][0],
                f"step {step} table {t.name} row accumulators",
            )


# ----------------------------------------------------------------------------------------------
# KJT layouts torchrec accepts


def _rebuild(kjt: KeyedJaggedTensor, keys: list[str], empty: tuple[str, ...] = ()):
    """``kjt`` with its keys in ``keys`` order and the features in ``empty`` emptied."""
    d = kjt.to_dict()
    lengths = [torch.zeros_like(d[k].lengths()) if k in empty else d[k].lengths() for k in keys]
    values = [d[k].values()[:0] if k in empty else d[k].values() for k in keys]
    weights = None
    if kjt.weights_or_none() is not None:
        weights = torch.cat([d[k].weights()[:0] if k in empty else d[k].weights() for k in keys])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), weights=weights
    )


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("load_factor", [0.01, 1.0], ids=["lf0.01", "lf1.0"])
def test_kjt_keys_in_another_order(weighted: bool, load_factor: float) -> None:
    tables = table_configs(("sum", "sum", "sum") if weighted else ("sum", "mean", "sum"))
    ref = torchrec_reference(tables, weighted)
    m = cached_copy(ref, tables, weighted, embcache.CacheConfig(load_factor=load_factor))
    gen = torch.Generator().manual_seed(3)
    kjt = random_kjt(gen, feature_rows(tables), 5, weighted=weighted)
    for keys in (["f3", "f0", "f2", "f1"], ["f1", "f0", "f3", "f2"]):
        permuted = _rebuild(kjt, keys)
        expected, out = ref(permuted), m(permuted)
        assert out.keys() == expected.keys() == ["f0", "f1", "f2", "f3"]
        assert_close(out.values(), expected.values(), f"keys {keys}")
        assert_close(out.values(), m(kjt).values(), f"keys {keys} vs table order")


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("cache", ["lru-1%", "full"])
def test_training_through_empty_tables_and_empty_batches(opt_name: str, cache: str) -> None:
    """Steps where a whole table (t2: its own cache), a table of a shared cache (t1) or the
    whole batch has no ids: torch still counts a step for every table (SparseAdam's bias
    correction), and so must we."""
    tables = table_configs(("sum", "mean", "sum"))
    ref = torchrec_reference(tables, False)
    m = cached_copy(ref, tables, False, embcache.CacheConfig(**CACHES[cache]))
    ref_opt = _torch_optimizer(opt_name, ref)
    opt = _our_optimizer(opt_name, m)
    gen = torch.Generator().manual_seed(4)
    keys = ["f0", "f1", "f2", "f3"]
    for step, empty in enumerate([(), ("f3",), ("f2",), tuple(keys), (), ("f0", "f1", "f2")]):
        kjt = _rebuild(random_kjt(gen, feature_rows(tables), 4, id_pool=50), keys, empty)
        coeff = torch.randn(4, 21, generator=gen)
        ref_opt.zero_grad()
        expected = ref(kjt)
        loss_of(expected.values(), coeff).backward()
        ref_opt.step()
        out = m(kjt)
        assert_close(out.values(), expected.values(), f"step {step} forward")
        loss_of(out.values(), coeff).backward()
        opt.step()
        assert_state_dicts_close(m.state_dict(), ref.state_dict(), f"step {step} (empty {empty})")
