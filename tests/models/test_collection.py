"""CachedEmbeddingBagCollection / RecStoreEmbeddingBagCollection: the module's behaviour.

Construction (RecStore signature, dict configs, fusion_k), input validation that never
half-applies, the trace/step protocol (pending gradients, accumulation, forwards that are never
backpropagated, no_grad), fused prefetch handles, update in backward, flush, statistics,
state_dict compatibility with torchrec, MAX and weighted MEAN pooling against float64
references, and tables of different dims.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch.nn import functional
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import embcache
from tests.models.conftest import (
    assert_close,
    assert_state_dicts_close,
    assert_state_dicts_equal,
    cached_copy,
    feature_rows,
    locked_slots,
    loss_of,
    random_kjt,
    table_configs,
    torchrec_reference,
)

TABLES = table_configs()  # t0 (dim 6: f0, f1, SUM), t1 (dim 6: f2, MEAN), t2 (dim 3: f3, SUM)
ROWS = feature_rows(TABLES)
WIDTH = 21  # 3 features of dim 6 and one of dim 3

CACHES = {
    "1%": embcache.CacheConfig(load_factor=0.01),
    "10%-4way": embcache.CacheConfig(load_factor=0.1, ways=4),
    "full": embcache.CacheConfig(load_factor=1.0),
}


def make_pair(cache: str = "10%-4way", weighted: bool = False, tables=TABLES, **kwargs):
    """A torchrec reference (sparse grads) and a cached collection with its weights."""
    ref = torchrec_reference(tables, weighted)
    return ref, cached_copy(ref, tables, weighted, CACHES[cache], **kwargs)


def kjts(seed: int, n: int, batch_size: int = 6, rows=ROWS, **kwargs) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    return [random_kjt(gen, rows, batch_size, **kwargs) for _ in range(n)]


def torch_step(ref, opt, kjt, coeff) -> torch.Tensor:
    opt.zero_grad()
    out = ref(kjt)
    loss_of(out.values(), coeff).backward()
    opt.step()
    return out.values()


def our_step(m, opt, kjt, coeff) -> torch.Tensor:
    out = m(kjt)
    loss_of(out.values(), coeff).backward()
    opt.step()
    return out.values()


# ----------------------------------------------------------------------------------------------
# float64 reference for MAX, weighted MEAN and arbitrary dims


def reference_pooled(
    weights: dict[str, torch.Tensor], layout: list[tuple[str, list[str], str]], kjt
) -> torch.Tensor:
    """Pooled output ``[B, sum of dims]`` in float64 by the definitions (SUM: Σ w x, MEAN:
    Σ w x / L, MAX: elementwise max of w x; empty bags give zeros), one bag at a time."""
    per_key = kjt.to_dict()
    blocks = []
    for table, features, pooling in layout:
        w = weights[table]
        for f in features:
            jt = per_key[f]
            offsets = jt.offsets().tolist()
            sample_weights = jt.weights_or_none()
            bags = []
            for lo, hi in itertools.pairwise(offsets):
                x = w[jt.values()[lo:hi].long()]
                if sample_weights is not None:
                    x = x * sample_weights[lo:hi, None].double()
                if hi == lo:
                    bags.append(torch.zeros(w.shape[1], dtype=torch.float64))
                elif pooling == "sum":
                    bags.append(x.sum(0))
                elif pooling == "mean":
                    bags.append(x.sum(0) / (hi - lo))
                else:
                    bags.append(x.max(0).values)
            blocks.append(torch.stack(bags))
    return torch.cat(blocks, 1)


def check_against_float64(m, layout, batches, lr: float = 0.1, coeff_seed: int = 0) -> None:
    """Forward and SGD steps of ``m`` against the float64 reference of ``layout``."""
    opt = embcache.SparseSGD([m], lr=lr)
    weights = {k.split(".")[1]: v.double().requires_grad_() for k, v in m.state_dict().items()}
    gen = torch.Generator().manual_seed(coeff_seed)
    for step, kjt in enumerate(batches):
        expected = reference_pooled(weights, layout, kjt)
        coeff = torch.randn(expected.shape, generator=gen)
        out = m(kjt)
        assert out.keys() == [f for _, fs, _ in layout for f in fs]
        assert_close(out.values(), expected, f"step {step} forward")
        loss_of(out.values(), coeff).backward()
        opt.step()
        loss_of(expected, coeff.double()).backward()
        with torch.no_grad():
            for w in weights.values():
                w -= lr * w.grad
                w.grad = None
        for name, w in m.state_dict().items():
            assert_close(w, weights[name.split(".")[1]], f"step {step} {name}")


# ----------------------------------------------------------------------------------------------
# construction


@pytest.mark.parametrize("lr", [0.01, 0.25], ids=["lr0.01", "lr0.25"])
def test_recstore_collection_takes_dicts_and_gives_sgd_its_lr(lr: float) -> None:
    configs = [
        {"name": "user", "embedding_dim": 5, "num_embeddings": 100, "feature_names": ["u"]},
        EmbeddingBagConfig(
            name="item", embedding_dim=5, num_embeddings=120, feature_names=["i0", "i1"]
        ),
    ]
    m = embcache.RecStoreEmbeddingBagCollection(
        embedding_bag_configs=configs, lr=lr, enable_fusion=True, fusion_k=30
    )
    assert isinstance(m, embcache.CachedEmbeddingBagCollection)
    opt = embcache.SparseSGD([m])
    assert opt.lr == lr
    layout = [("user", ["u"], "sum"), ("item", ["i0", "i1"], "sum")]
    rows = {"u": 100, "i0": 120, "i1": 120}
    check_against_float64(m, layout, kjts(1, 2, rows=rows), lr=lr)


def test_fusion_k_too_small_is_refused_naming_the_table() -> None:
    configs = [
        {"name": "small", "embedding_dim": 4, "num_embeddings": 10, "feature_names": ["a"]},
        {"name": "wide_table", "embedding_dim": 4, "num_embeddings": 1025, "feature_names": ["b"]},
    ]
    with pytest.raises(ValueError, match="wide_table"):
        embcache.RecStoreEmbeddingBagCollection(embedding_bag_configs=configs, fusion_k=10)


def test_fusion_k_exactly_enough_keeps_tables_apart() -> None:
    """With num_embeddings == 2**fusion_k, id 1023 of one table and id 0 of the next (same
    cache) differ only in the table prefix; they must stay distinct rows."""
    configs = [
        {"name": "a", "embedding_dim": 4, "num_embeddings": 1024, "feature_names": ["fa"]},
        {"name": "b", "embedding_dim": 4, "num_embeddings": 1024, "feature_names": ["fb"]},
    ]
    m = embcache.RecStoreEmbeddingBagCollection(
        embedding_bag_configs=configs,
        fusion_k=10,
        cache=embcache.CacheConfig(capacity=8, ways=2),
        store=embcache.HostKV(),
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["fa", "fb"],
        values=torch.tensor([1023, 1023, 0, 0, 1023]),
        lengths=torch.tensor([1, 1, 2, 1]),
    )
    layout = [("a", ["fa"], "sum"), ("b", ["fb"], "sum")]
    check_against_float64(m, layout, [kjt, kjt, kjt])


# ----------------------------------------------------------------------------------------------
# bad input never half-applies


def _with_value(kjt: KeyedJaggedTensor, feature: str, bad: int) -> KeyedJaggedTensor:
    """``kjt`` with the last value of ``feature`` replaced by ``bad``."""
    values = kjt.values().clone()
    end = kjt.offset_per_key()[kjt.keys().index(feature) + 1]
    values[end - 1] = bad
    return KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=values, lengths=kjt.lengths()
    )


BAD_IDS = {
    # case: (feature, table, bad id, pattern of the limit in the message)
    "negative-first-cache": ("f3", "t2", -1, r"0"),
    "at-num_embeddings": ("f3", "t2", 200, r"200"),
    "negative-second-table": ("f2", "t1", -7, r"0"),
    "past-last-row": ("f1", "t0", 300, r"300"),
    "overflows-fusion_k": ("f0", "t0", 2**40, r"300|2\*\*30"),
    "into-sign-bit": ("f2", "t1", 2**62 + 5, r"250|2\*\*30"),
}


def _snapshot(m):
    return m.state_dict(), m.cache_stats()


@pytest.mark.parametrize("case", list(BAD_IDS))
@pytest.mark.parametrize("how", ["forward", "prefetch", "no_grad"])
def test_bad_ids_raise_naming_where_and_change_nothing(case: str, how: str) -> None:
    feature, table, bad, limit = BAD_IDS[case]
    _, m = make_pair("1%")
    opt = embcache.SparseAdaGrad([m], lr=0.1)
    good, other = kjts(2, 2)
    our_step(m, opt, good, torch.randn(6, WIDTH))  # leave state, dirty rows, scratch history
    weights, stats = _snapshot(m)
    optimizer_state = opt.state_dict()
    kjt = _with_value(other, feature, bad)
    with pytest.raises(ValueError) as info:
        if how == "forward":
            m(kjt)
        elif how == "prefetch":
            m.issue_fused_prefetch(kjt)
        else:
            with torch.no_grad():
                m(kjt)
    message = str(info.value)
    for part in (repr(feature), repr(table), str(bad)):
        assert part in message, f"{part} missing from {message!r}"
    assert re.search(limit, message.replace(f"id {bad}", "")), message
    assert locked_slots(m) == [0, 0]
    assert m._trace == []
    assert_state_dicts_equal(m.state_dict(), weights, "weights after a bad batch")
    assert m.cache_stats() == stats, "the bad batch touched the cache"
    after = opt.state_dict()["state"][0]
    for t in ("t0", "t1", "t2"):
        assert torch.equal(after[t]["sum"], optimizer_state["state"][0][t]["sum"])
    # The collection is still usable: the good batch trains as usual.
    our_step(m, opt, other, torch.randn(6, WIDTH))
    assert locked_slots(m) == [0, 0]


def _kjt(keys, values, lengths, weights=None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.as_tensor(values),
        lengths=torch.as_tensor(lengths),
        weights=None if weights is None else torch.as_tensor(weights),
    )


KEYS = ["f0", "f1", "f2", "f3"]
BAD_INPUTS = {
    "float-values": (TypeError, lambda: _kjt(KEYS, [1.0, 2.0, 3.0, 4.0], [1, 1, 1, 1])),
    "bool-values": (TypeError, lambda: _kjt(KEYS, [True, False, True, True], [1, 1, 1, 1])),
    "missing-key": (ValueError, lambda: _kjt(["f0", "f1", "f3"], [1, 2, 3], [1, 1, 1])),
    "lengths-sum-short": (ValueError, lambda: _kjt(KEYS, [1, 2, 3, 4, 5], [1, 1, 1, 1])),
    "lengths-sum-long": (ValueError, lambda: _kjt(KEYS, [1, 2, 3], [1, 1, 1, 1])),
    "negative-length": (ValueError, lambda: _kjt(KEYS, [1, 2, 3], [2, -1, 1, 1])),
    "weights-count": (
        ValueError,
        lambda: _kjt([*KEYS, "zz"], [1, 2, 3, 4, 5], [1, 1, 1, 1, 1], [1.0, 1.0]),
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_and_changes_nothing(case: str) -> None:
    error, make = BAD_INPUTS[case]
    _, m = make_pair("1%")
    opt = embcache.SparseSGD([m], lr=0.1)
    our_step(m, opt, kjts(3, 1)[0], torch.randn(6, WIDTH))
    weights, stats = _snapshot(m)
    with pytest.raises(error):
        m(make())
    assert locked_slots(m) == [0, 0]
    assert m._trace == []
    assert_state_dicts_equal(m.state_dict(), weights, "weights after bad input")
    assert m.cache_stats() == stats


def test_weighted_collection_checks_its_weights() -> None:
    _, m = make_pair("full", weighted=True, tables=table_configs(("sum", "sum", "sum")))
    with pytest.raises(ValueError):
        m(_kjt(KEYS, [1, 2, 3, 4], [1, 1, 1, 1]))  # no weights
    with pytest.raises(TypeError):
        m(_kjt(KEYS, [1, 2, 3, 4], [1, 1, 1, 1], [1, 2, 3, 4]))  # integer weights
    assert locked_slots(m) == [0, 0]


@pytest.mark.parametrize("layout", ["int32-values", "int32-lengths", "offsets-only-int32"])
def test_kjt_index_dtypes_and_forms_give_the_same_numbers(layout: str) -> None:
    ref, m = make_pair("10%-4way")
    kjt = kjts(4, 1)[0]
    values32 = kjt.values().to(torch.int32)
    other = {
        "int32-values": lambda: KeyedJaggedTensor.from_lengths_sync(
            keys=kjt.keys(), values=values32, lengths=kjt.lengths()
        ),
        "int32-lengths": lambda: KeyedJaggedTensor(
            keys=kjt.keys(), values=values32, lengths=kjt.lengths().to(torch.int32)
        ),
        "offsets-only-int32": lambda: KeyedJaggedTensor(
            keys=kjt.keys(), values=values32, offsets=kjt.offsets().to(torch.int32)
        ),
    }[layout]()
    with torch.no_grad():
        assert torch.equal(m(other).values(), m(kjt).values())
    assert_close(m(other).values(), ref(kjt).values(), layout)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=str)
@pytest.mark.parametrize("column", [0, 13, 18], ids=["t0", "t1", "t2"])
def test_nonfinite_gradient_is_refused_by_step(value: float, column: int) -> None:
    ref, m = make_pair("1%")
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=1e-10)
    opt = embcache.SparseAdaGrad([m], lr=0.1)
    first, bad, after = kjts(5, 3)
    coeff = torch.randn(6, WIDTH)
    torch_step(ref, ref_opt, first, coeff)
    our_step(m, opt, first, coeff)
    weights = m.state_dict()

    out = m(bad)
    grad = torch.randn_like(out.values())
    grad[-1, column] = value  # the last bag of every feature is not empty
    out.values().backward(grad)
    with pytest.raises(ValueError, match="NaN or Inf"):
        opt.step()
    assert_state_dicts_equal(m.state_dict(), weights, "weights after a refused step")
    opt.zero_grad()
    assert locked_slots(m) == [0, 0]

    # Training goes on as if the bad batch never happened.
    torch_step(ref, ref_opt, after, coeff)
    our_step(m, opt, after, coeff)
    assert_state_dicts_close(m.state_dict(), ref.state_dict(), "after the next good step")


@pytest.mark.parametrize("column", [pytest.param(0, id="t0"), pytest.param(18, id="t2")])
def test_nonfinite_gradient_in_backward_update_changes_no_table(column: int) -> None:
    """update_in_backward applies the optimizer inside backward, one cache group at a time;
    a NaN in any table must still leave every table unchanged."""
    _, m = make_pair("10%-4way", update_in_backward=True)
    opt = embcache.SparseSGD([m], lr=0.1)
    weights = m.state_dict()
    out = m(kjts(6, 1)[0])
    grad = torch.randn_like(out.values())
    grad[-1, column] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        out.values().backward(grad)
    assert_state_dicts_equal(m.state_dict(), weights, "weights after a refused backward")
    opt.zero_grad()
    assert locked_slots(m) == [0, 0]


# ----------------------------------------------------------------------------------------------
# the trace / step protocol


def test_forward_with_pending_gradients_is_an_error() -> None:
    _, m = make_pair("full")
    opt = embcache.SparseSGD([m], lr=0.1)
    a, b = kjts(7, 2)
    m(a).values().sum().backward()
    with pytest.raises(RuntimeError, match=r"step|zero_grad"):
        m(b)
    opt.zero_grad()
    assert m._trace == []
    assert locked_slots(m) == [0, 0]
    m(b).values().sum().backward()
    opt.step()
    assert locked_slots(m) == [0, 0]


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("cache", ["1%", "full"])
def test_accumulate_grads_sums_two_passes(opt_name: str, cache: str) -> None:
    ref, m = make_pair(cache, accumulate_grads=True)
    params = list(ref.parameters())
    ref_opt, opt = {
        "sgd": lambda: (torch.optim.SGD(params, lr=0.1), embcache.SparseSGD([m], lr=0.1)),
        "adagrad": lambda: (
            torch.optim.Adagrad(params, lr=0.1, eps=1e-10),
            embcache.SparseAdaGrad([m], lr=0.1, eps=1e-10),
        ),
        "adam": lambda: (
            torch.optim.SparseAdam(params, lr=0.05, eps=1e-8),
            embcache.SparseAdam([m], lr=0.05, eps=1e-8),
        ),
    }[opt_name]()
    gen = torch.Generator().manual_seed(8)
    batches = kjts(8, 6, id_pool=60)
    for step in range(3):
        first, second = batches[2 * step], batches[2 * step + 1]
        c1, c2 = torch.randn(6, WIDTH, generator=gen), torch.randn(6, WIDTH, generator=gen)
        ref_opt.zero_grad()
        loss_of(ref(first).values(), c1).backward()
        loss_of(ref(second).values(), c2).backward()
        ref_opt.step()
        loss_of(m(first).values(), c1).backward()
        loss_of(m(second).values(), c2).backward()
        opt.step()
        assert locked_slots(m) == [0, 0]
        assert_state_dicts_close(m.state_dict(), ref.state_dict(), f"step {step}")


def test_two_lookups_in_one_graph() -> None:
    """A model that looks up the same collection twice (two towers) before one backward."""
    ref, m = make_pair("1%")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = embcache.SparseSGD([m], lr=0.1)
    gen = torch.Generator().manual_seed(9)
    batches = kjts(9, 6, id_pool=40)
    for step in range(3):
        a, b = batches[2 * step], batches[2 * step + 1]
        c = torch.randn(6, WIDTH, generator=gen)
        ref_opt.zero_grad()
        (ref(a).values() * ref(b).values() * c).sum().backward()
        ref_opt.step()
        (m(a).values() * m(b).values() * c).sum().backward()
        opt.step()
        assert locked_slots(m) == [0, 0]
        assert_state_dicts_close(m.state_dict(), ref.state_dict(), f"step {step}")


def test_forward_never_backpropagated_leaks_no_lock() -> None:
    """Dropped forwards (e.g. an exception between forward and backward) release their slots at
    the next forward; with a small scratch bound, leaked locks would soon exhaust the cache."""
    tables = table_configs()
    ref = torchrec_reference(tables, False)
    cache = embcache.CacheConfig(capacity=8, ways=4, max_scratch_rows=48)
    m = cached_copy(ref, tables, False, cache)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = embcache.SparseSGD([m], lr=0.1)
    batches = kjts(10, 8, batch_size=4, max_len=3)
    for kjt in batches[:-1]:
        m(kjt)  # output dropped
        assert all(n <= 48 + 8 for n in locked_slots(m))
    last = batches[-1]
    coeff = torch.randn(4, WIDTH)
    out = our_step(m, opt, last, coeff)
    expected = torch_step(ref, ref_opt, last, coeff)
    assert_close(out, expected, "forward after dropped forwards")
    assert locked_slots(m) == [0, 0]
    assert_state_dicts_close(m.state_dict(), ref.state_dict(), "after the step")


def test_no_grad_forward_locks_and_records_nothing() -> None:
    ref, m = make_pair("1%")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = embcache.SparseSGD([m], lr=0.1)
    train, evaluate = kjts(11, 2, id_pool=50)
    coeff = torch.randn(6, WIDTH)

    with torch.no_grad():
        out = m(evaluate)
    assert locked_slots(m) == [0, 0]
    assert m._trace == []
    assert not out.values().requires_grad
    assert_close(out.values(), ref(evaluate).values(), "no_grad forward")

    # An evaluation forward between a training forward and its backward: it must neither
    # drop the training batch's locks nor evict its rows, nor mind its pending state.
    training_out = m(train)
    locks = locked_slots(m)
    with torch.no_grad():
        m(evaluate)
    assert locked_slots(m) == locks
    loss_of(training_out.values(), coeff).backward()
    with torch.no_grad():
        assert_close(m(evaluate).values(), ref(evaluate).values(), "no_grad with a pending trace")
    opt.step()
    torch_step(ref, ref_opt, train, coeff)
    assert locked_slots(m) == [0, 0]
    assert_state_dicts_close(m.state_dict(), ref.state_dict(), "after the step")


# ----------------------------------------------------------------------------------------------
# fused prefetch


def _run(m, opt, batches, coeffs, prefetch: bool) -> list[torch.Tensor]:
    """Train on ``batches``; with prefetch, batch i+1 is prefetched before step i."""
    outputs = []
    handle = m.issue_fused_prefetch(batches[0]) if prefetch else None
    for i, (kjt, coeff) in enumerate(zip(batches, coeffs, strict=True)):
        if prefetch:
            m.set_fused_prefetch_handle(handle)
        out = m(kjt)
        if prefetch and i + 1 < len(batches):
            handle = m.issue_fused_prefetch(batches[i + 1])
        loss_of(out.values(), coeff).backward()
        opt.step()
        outputs.append(out.values().detach())
    return outputs


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_prefetch_is_bit_identical_to_synchronous(opt_name: str, cache: str) -> None:
    make_opt = {
        "sgd": lambda m: embcache.SparseSGD([m], lr=0.1),
        "adam": lambda m: embcache.SparseAdam([m], lr=0.05),
    }[opt_name]
    _, sync = make_pair(cache)
    _, pre = make_pair(cache)
    batches = kjts(12, 5, id_pool=60)
    gen = torch.Generator().manual_seed(12)
    coeffs = [torch.randn(6, WIDTH, generator=gen) for _ in batches]
    sync_out = _run(sync, make_opt(sync), batches, coeffs, prefetch=False)
    pre_out = _run(pre, make_opt(pre), batches, coeffs, prefetch=True)
    for i, (a, b) in enumerate(zip(sync_out, pre_out, strict=True)):
        assert torch.equal(a, b), f"batch {i} outputs differ"
    assert_state_dicts_equal(pre.state_dict(), sync.state_dict(), "prefetch vs sync")
    assert locked_slots(pre) == [0, 0]


def test_prefetch_handle_of_another_collection_is_refused() -> None:
    _, a = make_pair("full")
    _, b = make_pair("full")
    kjt = kjts(13, 1)[0]
    handle = a.issue_fused_prefetch(kjt)
    with pytest.raises(ValueError, match="another collection"):
        b.set_fused_prefetch_handle(handle)
    assert locked_slots(b) == [0, 0]
    a.set_fused_prefetch_handle(handle)
    a(kjt)
    a.zero_grad()
    assert locked_slots(a) == [0, 0]


def test_used_prefetch_handle_is_refused() -> None:
    _, m = make_pair("10%-4way")
    kjt = kjts(14, 1)[0]
    handle = m.issue_fused_prefetch(kjt)
    m.set_fused_prefetch_handle(handle)
    m(kjt)
    with pytest.raises(ValueError, match=r"stale|used"):
        m.set_fused_prefetch_handle(handle)
    m.zero_grad()
    assert locked_slots(m) == [0, 0]


def test_prefetch_handle_for_other_features_is_refused() -> None:
    ref, m = make_pair("1%")
    a, b = kjts(15, 2)
    m.set_fused_prefetch_handle(m.issue_fused_prefetch(a))
    with pytest.raises(ValueError, match="other features"):
        m(b)
    assert locked_slots(m) == [0, 0]
    assert_close(m(b).values(), ref(b).values(), "forward after a refused handle")


def test_prefetch_handle_rejected_for_pending_gradients_leaks_no_lock() -> None:
    _, m = make_pair("10%-4way")
    opt = embcache.SparseSGD([m], lr=0.1)
    a, b = kjts(16, 2)
    m(a).values().sum().backward()
    m.set_fused_prefetch_handle(m.issue_fused_prefetch(b))
    with pytest.raises(RuntimeError, match=r"step|zero_grad"):
        m(b)
    opt.zero_grad()
    assert locked_slots(m) == [0, 0]


# ----------------------------------------------------------------------------------------------
# update in backward


OPTIMIZERS = {
    "sgd": lambda m: embcache.SparseSGD([m], lr=0.1),
    "adagrad": lambda m: embcache.SparseAdaGrad([m], lr=0.1),
    "rowwise_adagrad": lambda m: embcache.SparseRowWiseAdaGrad([m], lr=0.1),
    "adam": lambda m: embcache.SparseAdam([m], lr=0.05),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("cache", ["1%", "full"])
def test_update_in_backward_matches_trace_and_step(opt_name: str, cache: str) -> None:
    _, traced = make_pair(cache)
    _, eager = make_pair(cache, update_in_backward=True)
    traced_opt, _eager_opt = OPTIMIZERS[opt_name](traced), OPTIMIZERS[opt_name](eager)
    gen = torch.Generator().manual_seed(17)
    for step, kjt in enumerate(kjts(17, 4, id_pool=60)):
        coeff = torch.randn(6, WIDTH, generator=gen)
        expected = our_step(traced, traced_opt, kjt, coeff)
        out = eager(kjt)
        assert torch.equal(out.values(), expected), f"step {step} forward"
        loss_of(out.values(), coeff).backward()  # no step(): applied here
        assert eager._trace == []
        assert locked_slots(eager) == [0, 0]
        assert_state_dicts_close(eager.state_dict(), traced.state_dict(), f"step {step}")


# ----------------------------------------------------------------------------------------------
# flush, statistics, state_dict


@pytest.mark.parametrize("cache", list(CACHES))
def test_flush_leaves_the_trained_rows_in_the_store(cache: str) -> None:
    ref, m = make_pair(cache)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = embcache.SparseSGD([m], lr=0.1)
    gen = torch.Generator().manual_seed(18)
    for kjt in kjts(18, 4, id_pool=60):
        coeff = torch.randn(6, WIDTH, generator=gen)
        torch_step(ref, ref_opt, kjt, coeff)
        our_step(m, opt, kjt, coeff)
    m.flush()
    for t in TABLES:
        ids = torch.arange(t.num_embeddings)
        stored = m.store.get(t.name, ids)
        assert stored.shape == (t.num_embeddings, t.embedding_dim)  # SGD keeps no state
        expected = ref.embedding_bags[t.name].weight
        assert_close(stored, expected, f"store rows of {t.name}")


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])
def test_cache_stats_count_unique_ids(cache: str, prefetch: bool) -> None:
    _, m = make_pair(cache)
    opt = embcache.SparseSGD([m], lr=0.1)
    stats = m.cache_stats()
    assert set(stats) == {"hits", "misses", "evictions", "writebacks", "hit_rate"}
    assert stats["hits"] == stats["misses"] == 0
    looked_up = 0
    seen: set[tuple[str, int]] = set()
    table_of = {f: t.name for t in m.tables for f in t.feature_names}
    for i, kjt in enumerate(kjts(19, 5, id_pool=50)):
        pairs = {(table_of[k], int(v)) for k, jt in kjt.to_dict().items() for v in jt.values()}
        looked_up += len(pairs)
        seen |= pairs
        if i % 2:
            with torch.no_grad():
                m(kjt)
        else:
            if prefetch:
                m.set_fused_prefetch_handle(m.issue_fused_prefetch(kjt))
            m(kjt).values().sum().backward()
            opt.step()
    stats = m.cache_stats()
    assert stats["hits"] + stats["misses"] == looked_up
    assert stats["hit_rate"] == pytest.approx(stats["hits"] / looked_up)
    if cache == "full":  # every row has its slot, filled from the tier on first use
        assert stats["misses"] == 0 and stats["hits"] == looked_up
        assert stats["evictions"] == 0
    else:  # every id's first touch misses, and evicted rows miss again
        assert stats["misses"] >= len(seen)
        assert stats["evictions"] > 0


def test_state_dict_is_torchrecs() -> None:
    ref, m = make_pair("1%")
    opt = embcache.SparseAdam([m], lr=0.05)  # state columns must not leak into state_dict
    our_step(m, opt, kjts(20, 1)[0], torch.randn(6, WIDTH))
    ours = m.state_dict()
    assert (
        list(ours)
        == list(ref.state_dict())
        == [
            "embedding_bags.t0.weight",
            "embedding_bags.t1.weight",
            "embedding_bags.t2.weight",
        ]
    )
    for t in TABLES:
        assert ours[f"embedding_bags.{t.name}.weight"].shape == (t.num_embeddings, t.embedding_dim)
    # ... and torchrec loads it and computes the same outputs.
    ref.load_state_dict(ours)
    kjt = kjts(20, 2)[1]
    with torch.no_grad():
        assert_close(m(kjt).values(), ref(kjt).values(), "torchrec loaded from ours")


# case: (make the bad state dict from a good one, does torchrec refuse it too)
BAD_STATE_DICTS = {
    "wrong-shape-last-table": (
        lambda sd: {**sd, "embedding_bags.t2.weight": torch.zeros(200, 4)},
        True,
    ),
    "wrong-rows-first-table": (
        lambda sd: {**sd, "embedding_bags.t0.weight": torch.zeros(299, 6)},
        True,
    ),
    "missing-table": (lambda sd: {k: v for k, v in sd.items() if "t1" not in k}, True),
    # torchrec copies NaN weights without a word; refusing them is our extension.
    "nan-values": (
        lambda sd: {**sd, "embedding_bags.t2.weight": torch.full((200, 3), float("nan"))},
        False,
    ),
    "unexpected-table": (
        lambda sd: {**sd, "embedding_bags.t9.weight": torch.zeros(5, 3)},
        True,
    ),
    "unexpected-key": (lambda sd: {**sd, "bogus.weight": torch.zeros(5, 3)}, True),
    # torchrec casts these silently (copy_); a weight that is not floating point is refused.
    "bool-values": (
        lambda sd: {**sd, "embedding_bags.t1.weight": torch.ones(250, 6, dtype=torch.bool)},
        False,
    ),
    "int64-values": (
        lambda sd: {**sd, "embedding_bags.t0.weight": torch.ones(300, 6, dtype=torch.int64)},
        False,
    ),
    "complex-values": (
        lambda sd: {**sd, "embedding_bags.t2.weight": torch.ones(200, 3, dtype=torch.complex64)},
        False,
    ),
}


@pytest.mark.parametrize("case", list(BAD_STATE_DICTS))
def test_load_state_dict_refuses_bad_input_and_changes_nothing(case: str) -> None:
    make_bad, torchrec_refuses = BAD_STATE_DICTS[case]
    ref, m = make_pair("1%")
    opt = embcache.SparseSGD([m], lr=0.1)
    our_step(m, opt, kjts(21, 1)[0], torch.randn(6, WIDTH))
    before = m.state_dict()
    new = {k: v + 1.0 for k, v in before.items()}  # would change every table if loaded
    if torchrec_refuses:
        with pytest.raises(RuntimeError):
            ref.load_state_dict(make_bad(new))
    with pytest.raises(RuntimeError) as info:
        m.load_state_dict(make_bad(new))
    if case.endswith("-values") and case != "nan-values":
        assert "dtype" in str(info.value) and "floating point" in str(info.value), info.value
    assert_state_dicts_equal(m.state_dict(), before, "weights after a refused load")


# ----------------------------------------------------------------------------------------------
# MAX and weighted MEAN pooling, mixed dims


@pytest.mark.parametrize("spelling", ["dict-str", "PoolingMode"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("cache", ["1%", "full"])
def test_max_pooling_against_float64(spelling: str, weighted: bool, cache: str) -> None:
    pooling = "max" if spelling == "dict-str" else embcache.PoolingMode.MAX
    configs = [
        {"name": "m0", "embedding_dim": 5, "num_embeddings": 150, "feature_names": ["a", "b"]},
        {"name": "m1", "embedding_dim": 3, "num_embeddings": 90, "feature_names": ["c"]},
    ]
    for c in configs:
        c["pooling"] = pooling
    m = embcache.CachedEmbeddingBagCollection(
        tables=configs, is_weighted=weighted, cache=CACHES[cache], store=embcache.HostKV()
    )
    layout = [("m0", ["a", "b"], "max"), ("m1", ["c"], "max")]
    rows = {"a": 150, "b": 150, "c": 90}
    check_against_float64(m, layout, kjts(22, 3, rows=rows, weighted=weighted, id_pool=40))


@pytest.mark.parametrize("cache", ["1%", "full"])
def test_weighted_mean_divides_by_bag_length(cache: str) -> None:
    configs = [
        {
            "name": "w0",
            "embedding_dim": 4,
            "num_embeddings": 120,
            "feature_names": ["a"],
            "pooling": PoolingType.MEAN,
        },
        {
            "name": "w1",
            "embedding_dim": 4,
            "num_embeddings": 80,
            "feature_names": ["b"],
            "pooling": "sum",
        },
    ]
    m = embcache.CachedEmbeddingBagCollection(
        tables=configs, is_weighted=True, cache=CACHES[cache], store=embcache.HostKV()
    )
    layout = [("w0", ["a"], "mean"), ("w1", ["b"], "sum")]
    check_against_float64(m, layout, kjts(23, 3, rows={"a": 120, "b": 80}, weighted=True))


@pytest.mark.parametrize("cache", ["1%", "full"])
def test_tables_of_many_dims_in_one_collection(cache: str) -> None:
    dims = {"d1": 1, "d7": 7, "d16": 16, "d5": 5, "d7b": 7}
    poolings = {"d1": "sum", "d7": "mean", "d16": "max", "d5": "sum", "d7b": "sum"}
    configs = [
        {
            "name": name,
            "embedding_dim": dim,
            "num_embeddings": 100 + 10 * i,
            "feature_names": [f"{name}_x", f"{name}_y"] if name == "d5" else [f"{name}_x"],
            "pooling": poolings[name],
        }
        for i, (name, dim) in enumerate(dims.items())
    ]
    m = embcache.CachedEmbeddingBagCollection(
        tables=configs, cache=CACHES[cache], store=embcache.HostKV()
    )
    layout = [(c["name"], c["feature_names"], c["pooling"]) for c in configs]
    rows = {f: c["num_embeddings"] for c in configs for f in c["feature_names"]}
    batches = kjts(24, 3, rows=rows, batch_size=5)
    out = m(batches[0])
    assert out.length_per_key() == [1, 7, 16, 5, 5, 7]
    assert out.values().shape == (5, 41)
    m.zero_grad()
    check_against_float64(m, layout, batches)


def test_enable_fusion_false_gives_the_same_numbers() -> None:
    ref = torchrec_reference(TABLES, False)
    fused = cached_copy(ref, TABLES, False, CACHES["1%"])
    plain = cached_copy(ref, TABLES, False, CACHES["1%"], enable_fusion=False)
    a, b = embcache.SparseSGD([fused], lr=0.1), embcache.SparseSGD([plain], lr=0.1)
    gen = torch.Generator().manual_seed(25)
    for kjt in kjts(25, 3):
        coeff = torch.randn(6, WIDTH, generator=gen)
        assert torch.equal(our_step(fused, a, kjt, coeff), our_step(plain, b, kjt, coeff))
    assert_state_dicts_equal(plain.state_dict(), fused.state_dict(), "fusion on vs off")


def test_embedding_bag_reference_agrees_with_torch() -> None:
    """The float64 reference above is itself checked against F.embedding_bag."""
    w = torch.randn(50, 4, dtype=torch.float64)
    kjt = kjts(26, 1, rows={"a": 50}, batch_size=5)[0]
    jt = kjt.to_dict()["a"]
    for mode in ("sum", "mean", "max"):
        expected = functional.embedding_bag(
            jt.values(), w, jt.offsets(), mode=mode, include_last_offset=True
        )
        got = reference_pooled({"t": w}, [("t", ["a"], mode)], kjt)
        assert_close(got, expected, mode)


def test_a_table_the_host_cannot_hold_is_refused_cleanly_at_its_first_write() -> None:
    """2**32 rows x 64 in the default HostKV: the collection builds (a cache within its
    budget, no table allocated); the first forward is refused with the tier's ValueError,
    nothing locked or cached, and the same call fails the same way again."""
    table = embcache.TableConfig(
        name="huge", embedding_dim=64, num_embeddings=2**32, feature_names=["f"]
    )
    budget = embcache.CacheConfig(memory_budget=1 << 22)  # a small cache: a light test
    ebc = embcache.CachedEmbeddingBagCollection(tables=[table], cache=budget, fusion_k=32)
    assert ebc.caches()[0].num_slots * 4 * 3 * 64 <= 1 << 22
    batch = embcache.JaggedBatch.from_lengths(
        ["f"], torch.tensor([5, 2**32 - 1]), torch.ones(2, dtype=torch.int64)
    )
    for _ in range(2):
        with pytest.raises(ValueError, match=r"'huge': 4,294,967,296 rows .* dense host array"):
            ebc(batch)
        assert ebc.caches()[0].locked_slots() == 0
        assert int((ebc.caches()[0].slot_keys >= 0).sum()) == 0
    assert ebc.store.memory_bytes() == 0
