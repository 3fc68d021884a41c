"""Sparse optimizers: state that lives in the rows, and its state_dict round trip.

* The state columns stored beside each row in the tier (after `flush`) are torch's own state:
  Adagrad's ``sum``, SparseAdam's ``exp_avg``/``exp_avg_sq`` and step count.
* ``opt.state_dict()`` / ``load_state_dict()`` with the module's: training resumed in a fresh
  module and optimizer gives bit-identical weights and state.
* Bad optimizer states (another rule, wrong shapes, unknown tables) are refused and change
  nothing; optimizers refuse modules they cannot update.
"""

from __future__ import annotations

import copy

import pytest
import torch

import embcache
from tests.models.conftest import (
    assert_close,
    assert_state_dicts_close,
    assert_state_dicts_equal,
    cached_copy,
    feature_rows,
    loss_of,
    random_kjt,
    table_configs,
    torchrec_reference,
)

TABLES = table_configs()  # t0 (dim 6), t1 (dim 6), t2 (dim 3); 300, 250, 200 rows
ROWS = feature_rows(TABLES)
WIDTH = 21

OPTIMIZERS = {
    "sgd": lambda m: embcache.SparseSGD([m], lr=0.1),
    "adagrad": lambda m: embcache.SparseAdaGrad(
        [m], lr=0.1, initial_accumulator_value=0.05, lr_decay=0.01
    ),
    "rowwise_adagrad": lambda m: embcache.SparseRowWiseAdaGrad([m], lr=0.1, eps=1e-8),
    "adam": lambda m: embcache.SparseAdam([m], lr=0.05, betas=(0.8, 0.95)),
    "adamw": lambda m: embcache.SparseAdamW([m], lr=0.05, betas=(0.8, 0.95), weight_decay=0.1),
}
STATE_NAMES = {
    "sgd": [],
    "adagrad": ["sum"],
    "rowwise_adagrad": ["sum"],
    "adam": ["exp_avg", "exp_avg_sq"],
    "adamw": ["exp_avg", "exp_avg_sq"],
}
# x dim; None: 1
STATE_WIDTH = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": None, "adam": 2, "adamw": 2}


def batches(seed: int, n: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [
        (random_kjt(gen, ROWS, 6, id_pool=60), torch.randn(6, WIDTH, generator=gen))
        for _ in range(n)
    ]


def train(m, opt, data) -> None:
    for kjt, coeff in data:
        loss_of(m(kjt).values(), coeff).backward()
        opt.step()


def fresh(seed: int, cache: str = "1%") -> embcache.CachedEmbeddingBagCollection:
    config = embcache.CacheConfig(load_factor=0.01 if cache == "1%" else 1.0)
    return embcache.CachedEmbeddingBagCollection(
        tables=TABLES, cache=config, store=embcache.HostKV(), seed=seed
    )


def assert_optimizer_states_equal(actual: dict, expected: dict) -> None:
    assert actual["rule"] == expected["rule"]
    assert actual["steps"] == expected["steps"]
    assert actual["hyperparameters"] == expected["hyperparameters"]
    assert len(actual["state"]) == len(expected["state"])
    for i, (got, want) in enumerate(zip(actual["state"], expected["state"], strict=True)):
        assert sorted(got) == sorted(want)
        for table, parts in want.items():
            assert_state_dicts_equal(got[table], parts, f"optimizer state of {i}.{table}")


# ----------------------------------------------------------------------------------------------
# state_dict round trip


@pytest.mark.parametrize("order", ["module-first", "optimizer-first"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_state_dict_round_trip_resumes_training_exactly(opt_name: str, order: str) -> None:
    data = batches(1, 6)
    m = fresh(seed=0)
    opt = OPTIMIZERS[opt_name](m)
    train(m, opt, data[:3])
    saved_module = copy.deepcopy(m.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    train(m, opt, data[3:])

    restored = fresh(seed=1)  # other initial weights: everything must come from the load
    if order == "module-first":
        restored.load_state_dict(saved_module)
        restored_opt = OPTIMIZERS[opt_name](restored)
    else:
        restored_opt = OPTIMIZERS[opt_name](restored)
        restored.load_state_dict(saved_module)
    restored_opt.load_state_dict(saved_opt)
    assert_optimizer_states_equal(restored_opt.state_dict(), saved_opt)
    train(restored, restored_opt, data[3:])

    assert_state_dicts_equal(restored.state_dict(), m.state_dict(), "resumed weights")
    assert_optimizer_states_equal(restored_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_state_dict_layout(opt_name: str) -> None:
    m = fresh(seed=0)
    opt = OPTIMIZERS[opt_name](m)
    train(m, opt, batches(2, 2))
    state = opt.state_dict()
    assert state["rule"]
    assert [sorted(s) for s in state["state"]] == [["t0", "t1", "t2"]]
    for t in TABLES:
        parts = state["state"][0][t.name]
        assert sorted(parts) == sorted(STATE_NAMES[opt_name])
        width = 1 if STATE_WIDTH[opt_name] is None else STATE_WIDTH[opt_name] * t.embedding_dim
        for name in STATE_NAMES[opt_name]:
            assert parts[name].shape == (t.num_embeddings, width // len(STATE_NAMES[opt_name]))


def test_state_dict_is_a_snapshot() -> None:
    m = fresh(seed=0)
    opt = embcache.SparseAdaGrad([m], lr=0.1)
    data = batches(3, 2)
    train(m, opt, data[:1])
    state = opt.state_dict()
    kept = copy.deepcopy(state)
    train(m, opt, data[1:])
    assert_optimizer_states_equal(state, kept)


# ----------------------------------------------------------------------------------------------
# state lives in the rows


@pytest.mark.parametrize("initial", [0.0, 0.1], ids=["acc0", "acc0.1"])
@pytest.mark.parametrize("lr_decay", [0.0, 0.05], ids=["nodecay", "decay"])
def test_adagrad_state_is_torchs_sum_in_the_rows(initial: float, lr_decay: float) -> None:
    ref = torchrec_reference(TABLES, False)
    m = cached_copy(ref, TABLES, False, embcache.CacheConfig(load_factor=0.01))
    kwargs = dict(lr=0.1, eps=1e-10, initial_accumulator_value=initial, lr_decay=lr_decay)
    ref_opt = torch.optim.Adagrad(ref.parameters(), **kwargs)
    opt = embcache.SparseAdaGrad([m], **kwargs)
    for kjt, coeff in batches(4, 4):
        ref_opt.zero_grad()
        loss_of(ref(kjt).values(), coeff).backward()
        ref_opt.step()
        loss_of(m(kjt).values(), coeff).backward()
        opt.step()
    assert_state_dicts_close(m.state_dict(), ref.state_dict(), "weights")
    m.flush()
    state = opt.state_dict()["state"][0]
    for t in TABLES:
        dim = t.embedding_dim
        torch_sum = ref_opt.state[ref.embedding_bags[t.name].weight]["sum"]
        rows = m.store.get(t.name, torch.arange(t.num_embeddings))
        assert rows.shape == (t.num_embeddings, 2 * dim)  # [weights | sum of squares]
        assert_close(rows[:, :dim], ref.embedding_bags[t.name].weight, f"{t.name} weights")
        assert_close(rows[:, dim:], torch_sum, f"{t.name} sum in the store")
        assert_close(state[t.name]["sum"], torch_sum, f"{t.name} sum in state_dict")


def test_adam_state_is_torchs_in_the_rows() -> None:
    ref = torchrec_reference(TABLES, False)
    m = cached_copy(ref, TABLES, False, embcache.CacheConfig(load_factor=0.01))
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-8)
    opt = embcache.SparseAdam([m], lr=0.05, betas=(0.8, 0.95), eps=1e-8)
    for kjt, coeff in batches(5, 4):
        ref_opt.zero_grad()
        loss_of(ref(kjt).values(), coeff).backward()
        ref_opt.step()
        loss_of(m(kjt).values(), coeff).backward()
        opt.step()
    m.flush()
    state = opt.state_dict()
    for t in TABLES:
        dim = t.embedding_dim
        torch_state = ref_opt.state[ref.embedding_bags[t.name].weight]
        rows = m.store.get(t.name, torch.arange(t.num_embeddings))
        assert rows.shape == (t.num_embeddings, 3 * dim)  # [weights | exp_avg | exp_avg_sq]
        assert_close(rows[:, :dim], ref.embedding_bags[t.name].weight, f"{t.name} weights")
        assert_close(rows[:, dim : 2 * dim], torch_state["exp_avg"], f"{t.name} exp_avg")
        assert_close(rows[:, 2 * dim :], torch_state["exp_avg_sq"], f"{t.name} exp_avg_sq")
        for name in ("exp_avg", "exp_avg_sq"):
            assert_close(state["state"][0][t.name][name], torch_state[name], f"{t.name} {name}")


@pytest.mark.parametrize("opt_name", ["sgd", "rowwise_adagrad"])
def test_store_rows_hold_the_state_columns(opt_name: str) -> None:
    m = fresh(seed=0)
    opt = OPTIMIZERS[opt_name](m)
    train(m, opt, batches(6, 3))
    m.flush()
    state = opt.state_dict()["state"][0]
    weights = m.state_dict()
    for t in TABLES:
        rows = m.store.get(t.name, torch.arange(t.num_embeddings))
        dim = t.embedding_dim
        extra = 0 if opt_name == "sgd" else 1
        assert rows.shape == (t.num_embeddings, dim + extra)
        assert torch.equal(rows[:, :dim], weights[f"embedding_bags.{t.name}.weight"])
        if extra:
            acc = state[t.name]["sum"]
            assert torch.equal(rows[:, dim:], acc)
            assert bool((acc >= 0).all()) and bool((acc > 0).any())


# ----------------------------------------------------------------------------------------------
# refusals


def _trained_adagrad():
    m = fresh(seed=0)
    opt = embcache.SparseAdaGrad([m], lr=0.1)
    train(m, opt, batches(7, 2))
    return m, opt


BAD_OPTIMIZER_STATES = {
    "other-rule": lambda sd: {**sd, "rule": "ADAM"},
    "other-rule-sgd": lambda sd: {**sd, "rule": "SGD", "state": [{}]},
    "wrong-shape": lambda sd: {
        **sd,
        "state": [{**sd["state"][0], "t2": {"sum": torch.zeros(200, 4)}}],
    },
    "wrong-state-name": lambda sd: {
        **sd,
        "state": [{**sd["state"][0], "t1": {"exp_avg": sd["state"][0]["t1"]["sum"]}}],
    },
    "unknown-table": lambda sd: {
        **sd,
        "state": [{**sd["state"][0], "t9": {"sum": torch.zeros(5, 3)}}],
    },
}


@pytest.mark.parametrize("case", list(BAD_OPTIMIZER_STATES))
def test_bad_optimizer_state_is_refused_and_changes_nothing(case: str) -> None:
    m, opt = _trained_adagrad()
    weights, state = m.state_dict(), opt.state_dict()
    bad = BAD_OPTIMIZER_STATES[case](
        {
            **copy.deepcopy(state),
            "state": [
                {
                    t: {k: v + 1.0 for k, v in parts.items()}
                    for t, parts in state["state"][0].items()
                }
            ],
        }
    )
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert_state_dicts_equal(m.state_dict(), weights, "weights")
    assert_optimizer_states_equal(opt.state_dict(), state)


def test_optimizers_refuse_what_they_cannot_update() -> None:
    embcache.reset_kv_client()
    try:
        dist = embcache.DistEmbedding(10, 4, name="opt_test_table")
        with pytest.raises(TypeError):
            embcache.SparseAdaGrad([dist], lr=0.1)
        with pytest.raises(TypeError):
            embcache.SparseSGD([torch.nn.Linear(2, 2)], lr=0.1)
    finally:
        embcache.reset_kv_client()
    m = fresh(seed=0)
    with pytest.raises(ValueError):
        embcache.SparseSGD([m])  # no lr given, and the module carries none
    with pytest.raises(ValueError):
        embcache.SparseSGD([m], lr=float("nan"))


@pytest.mark.parametrize(
    "cls",
    [
        embcache.SparseSGD,
        embcache.SparseAdaGrad,
        embcache.SparseRowWiseAdaGrad,
        embcache.SparseAdam,
    ],
    ids=lambda c: c.__name__,
)
def test_optimizers_take_a_module_or_a_list(cls: type) -> None:
    """``cls(ebc, lr=...)`` (a module, as torch.optim takes parameters) is ``cls([ebc], ...)``."""
    data = batches(11, 3)
    alone, listed = fresh(seed=4), fresh(seed=4)
    opt_alone, opt_listed = cls(alone, lr=0.05), cls([listed], lr=0.05)
    assert opt_alone.modules == [alone]
    train(alone, opt_alone, data)
    train(listed, opt_listed, data)
    assert_state_dicts_equal(alone.state_dict(), listed.state_dict(), "module vs list")
    with pytest.raises(TypeError, match="a module or a list of modules, got str"):
        cls("ebc", lr=0.05)
    with pytest.raises(TypeError, match="got int"):
        cls(5, lr=0.05)


def test_zero_grad_drops_the_trace() -> None:
    m = fresh(seed=0)
    opt = embcache.SparseSGD([m], lr=0.1)
    weights = m.state_dict()
    kjt, coeff = batches(8, 1)[0]
    loss_of(m(kjt).values(), coeff).backward()
    assert m._trace
    opt.zero_grad()
    assert m._trace == []
    opt.step()  # nothing to apply
    assert_state_dicts_equal(m.state_dict(), weights, "weights after zero_grad + step")
    assert [c.locked_slots() for c in m.caches()] == [0, 0]


def test_one_optimizer_over_two_collections() -> None:
    """Two collections (other table names) under one SparseAdam: each matches its torchrec
    twin under torch's SparseAdam, and the state round-trips."""
    tables_b = [copy.deepcopy(t) for t in TABLES]
    for t in tables_b:
        t.name = f"b_{t.name}"
    ref_a, ref_b = torchrec_reference(TABLES, False, seed=0), torchrec_reference(tables_b, False, 1)
    a = cached_copy(ref_a, TABLES, False, embcache.CacheConfig(load_factor=0.01))
    b = cached_copy(ref_b, tables_b, False, embcache.CacheConfig(load_factor=0.1))
    ref_opt = torch.optim.SparseAdam([*ref_a.parameters(), *ref_b.parameters()], lr=0.05)
    opt = embcache.SparseAdam([a, b], lr=0.05)
    data = batches(9, 6)
    for i, (kjt, coeff) in enumerate(data):
        other = data[(i + 3) % len(data)][0]  # b looks up another batch
        ref_opt.zero_grad()
        (loss_of(ref_a(kjt).values(), coeff) + loss_of(ref_b(other).values(), coeff)).backward()
        ref_opt.step()
        (loss_of(a(kjt).values(), coeff) + loss_of(b(other).values(), coeff)).backward()
        opt.step()
    assert_state_dicts_close(a.state_dict(), ref_a.state_dict(), "collection a")
    assert_state_dicts_close(b.state_dict(), ref_b.state_dict(), "collection b")
    state = opt.state_dict()
    assert [sorted(s) for s in state["state"]] == [["t0", "t1", "t2"], ["b_t0", "b_t1", "b_t2"]]


def test_two_collections_with_the_same_table_names_round_trip() -> None:
    data = batches(10, 6)
    a, b = fresh(seed=0), fresh(seed=1)
    opt = embcache.SparseAdaGrad([a, b], lr=0.1)

    def both(m_a, m_b, o, part) -> None:
        for i, (kjt, coeff) in enumerate(part):
            other = data[(i + 2) % len(data)][0]
            (loss_of(m_a(kjt).values(), coeff) + loss_of(m_b(other).values(), coeff)).backward()
            o.step()

    both(a, b, opt, data[:3])
    saved = [copy.deepcopy(a.state_dict()), copy.deepcopy(b.state_dict())]
    saved_opt = copy.deepcopy(opt.state_dict())
    both(a, b, opt, data[3:])

    a2, b2 = fresh(seed=2), fresh(seed=3)
    opt2 = embcache.SparseAdaGrad([a2, b2], lr=0.1)
    a2.load_state_dict(saved[0])
    b2.load_state_dict(saved[1])
    opt2.load_state_dict(saved_opt)
    both(a2, b2, opt2, data[3:])
    assert_state_dicts_equal(a2.state_dict(), a.state_dict(), "collection a")
    assert_state_dicts_equal(b2.state_dict(), b.state_dict(), "collection b")


def test_state_of_fewer_modules_is_refused_and_changes_nothing() -> None:
    a = fresh(seed=0)
    opt = embcache.SparseAdaGrad([a], lr=0.1)
    train(a, opt, batches(11, 2))
    saved = copy.deepcopy(opt.state_dict())

    tables_b = [copy.deepcopy(t) for t in TABLES]
    for t in tables_b:
        t.name = f"b_{t.name}"
    b = embcache.CachedEmbeddingBagCollection(tables=tables_b, store=embcache.HostKV())
    both = embcache.SparseAdaGrad([a, b], lr=0.1)  # fresh state for a and b
    train(a, both, batches(12, 1))
    weights, state = a.state_dict(), both.state_dict()
    with pytest.raises(ValueError):
        both.load_state_dict(saved)  # covers a only
    assert_state_dicts_equal(a.state_dict(), weights, "weights")
    assert_optimizer_states_equal(both.state_dict(), state)
