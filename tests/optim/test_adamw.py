"""Lazy AdamW (the ADAMW rule, `embcache.SparseAdamW`) against its float64 reference
(`optim_rules.RULES[ADAMW].reference`) on every backend, and every way to reach it: the fused
``optimizer_type=torch.optim.AdamW``, a torch AdamW over the parameters (refused, naming what to
use), the CLI (``--optimizer adamw``) and a RecStore backend optimizer (``{"type": "AdamW"}``).
Also the rules' table itself: every derived table agrees with it."""

from __future__ import annotations

import inspect

import pytest
import torch

import embcache
from embcache.engine.tbe_step import TbeStep, fbgemm_type
from embcache.kernels.optim import OptimRule, RowUpdate, aggregate_grads, apply_row_update
from embcache.kernels.optim_rules import RULES, by_cli, by_recstore, by_torch_class
from embcache.models.torch_optim import row_update
from tests.models.conftest import feature_rows, loss_of, random_kjt, table_configs

KeyedJaggedTensor = pytest.importorskip("torchrec.sparse.jagged_tensor").KeyedJaggedTensor

REFERENCE = RULES[OptimRule.ADAMW].reference
UPDATE = RowUpdate(OptimRule.ADAMW, lr=0.05, eps=1e-8, beta1=0.8, beta2=0.95, weight_decay=0.5)


def t2_only(gen: torch.Generator) -> KeyedJaggedTensor:
    """A batch of 6 samples that looks up t2 (feature f3) only: the other features are empty."""
    lengths = torch.randint(1, 4, (24,), generator=gen)
    lengths[:18] = 0
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=values, lengths=lengths)


def reference_step(w, m, v, ids, grads, update, step):
    """Float64 lazy AdamW on full tables ``w``, ``m``, ``v`` (in place): duplicate ids summed,
    only the touched rows change."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    g = torch.zeros(unique.numel(), w.shape[1], dtype=torch.float64)
    g.index_add_(0, inverse, grads.double())
    state = {"exp_avg": m[unique], "exp_avg_sq": v[unique]}
    w[unique], state = REFERENCE(w[unique], state, g, update, step)
    m[unique], v[unique] = state["exp_avg"], state["exp_avg_sq"]
    return unique


def test_row_update_matches_float64_over_steps(backend: str, device: torch.device) -> None:
    """Several steps with duplicate ids; rows a step does not touch keep their bits (no decay)."""
    gen = torch.Generator().manual_seed(5)
    rows, dim = 12, 5
    weights = torch.randn(rows, dim, generator=gen)
    state = torch.zeros(rows, 2 * dim)
    w, m, v = weights.double(), torch.zeros(rows, dim).double(), torch.zeros(rows, dim).double()
    weights, state = weights.to(device), state.to(device)
    for step in range(1, 5):
        ids = torch.randint(0, rows // 2 + step, (7,), generator=gen)
        ids[1] = ids[0]  # a duplicate
        grads = torch.randn(7, dim, generator=gen)
        before = torch.cat([weights, state], 1).cpu()
        unique, summed = aggregate_grads(ids.to(device), grads.to(device))
        apply_row_update(weights, state, unique, summed, UPDATE, step)
        touched = reference_step(w, m, v, ids, grads, UPDATE, step)
        after = torch.cat([weights, state], 1).cpu()
        untouched = torch.ones(rows, dtype=torch.bool)
        untouched[touched] = False
        assert torch.equal(after[untouched], before[untouched]), f"step {step}: untouched rows"
        torch.testing.assert_close(after[:, :dim].double(), w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(after[:, dim:].double(), torch.cat([m, v], 1), rtol=1e-5,
                                   atol=1e-6)  # fmt: skip


def test_decay_is_decoupled() -> None:
    """A zero gradient on a touched row still decays it by ``1 - lr * weight_decay`` (and moves
    nothing else): AdamW's decay, not L2 through the moments."""
    weights, state = torch.ones(3, 4), torch.zeros(3, 8)
    apply_row_update(weights, state, torch.tensor([1]), torch.zeros(1, 4), UPDATE, 1)
    assert torch.equal(weights[0], torch.ones(4)) and torch.equal(weights[2], torch.ones(4))
    torch.testing.assert_close(weights[1], torch.full((4,), 1 - 0.05 * 0.5))
    assert not state.any()


TABLES = table_configs()
ROWS = feature_rows(TABLES)


@pytest.mark.parametrize("cache", ["1%", "all"])
def test_sparse_adamw_on_a_collection_matches_float64(cache: str) -> None:
    """`SparseAdamW` on a cached collection (the CPU path: compiled bookkeeping when numba
    imports, the torch twin's update; the FBGEMM step does not apply to ADAMW): per table, the
    float64 reference with the table's own step count (advanced on the steps that look it up)."""
    config = embcache.CacheConfig(load_factor=0.01 if cache == "1%" else 1.0)
    mod = embcache.CachedEmbeddingBagCollection(tables=TABLES, cache=config,
                                                store=embcache.HostKV(), seed=3)  # fmt: skip
    opt = embcache.SparseAdamW([mod], lr=0.05, betas=(0.8, 0.95), weight_decay=0.5)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and opt.rule is OptimRule.ADAMW
    assert all(e.tbe_step is None for e in mod.engines.engines)
    start = {k.split(".")[1]: v.double() for k, v in mod.state_dict().items()}
    ref = {t: (w.clone(), torch.zeros_like(w), torch.zeros_like(w)) for t, w in start.items()}
    steps = dict.fromkeys(ref, 0)
    gen = torch.Generator().manual_seed(9)
    for i in range(4):
        # Step 2 looks up t2 only: t0 and t1 neither decay nor count it.
        kjt = random_kjt(gen, ROWS, 6, id_pool=40) if i != 2 else t2_only(gen)
        values = mod(kjt).values()
        loss_of(values, torch.randn(values.shape, generator=gen)).backward()
        by_table: dict[str, list] = {}
        for table, ids, grads in mod._trace:
            by_table.setdefault(table, []).append((ids, grads))
        for table, parts in by_table.items():
            steps[table] += 1
            ids = torch.cat([p[0] for p in parts])
            grads = torch.cat([p[1] for p in parts])
            reference_step(*ref[table], ids, grads, UPDATE, steps[table])
        opt.step()
    assert steps["t2"] == 4  # (the optimizer counts a table's steps as its trace has them)
    got = {k.split(".")[1]: v.double() for k, v in mod.state_dict().items()}
    state = opt.state_dict()["state"][0]
    for t, (w, m, v) in ref.items():
        torch.testing.assert_close(got[t], w, rtol=1e-5, atol=1e-6, msg=f"table {t}")
        torch.testing.assert_close(state[t]["exp_avg"].double(), m, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[t]["exp_avg_sq"].double(), v, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# reachability


def test_fused_adamw_is_the_adamw_rule() -> None:
    update, init = row_update(torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.2}, fused=True)
    assert update == RowUpdate(OptimRule.ADAMW, lr=0.1, eps=1e-8, weight_decay=0.2)
    assert init == 0.0
    adam, _ = row_update(torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.2}, fused=True)
    assert adam.rule is OptimRule.ADAM  # FBGEMM's Adam: L2 on the touched rows


def test_fused_collection_trains_with_adamw() -> None:
    mod = embcache.CachedEmbeddingBagCollection(
        tables=TABLES, store=embcache.HostKV(), seed=3,
        optimizer_type=torch.optim.AdamW, optimizer_kwargs={"lr": 0.05, "weight_decay": 0.5},
    )  # fmt: skip
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    values = mod(t2_only(gen)).values()
    loss_of(values, torch.randn(values.shape, generator=gen)).backward()
    after = mod.state_dict()
    assert torch.equal(after["embedding_bags.t0.weight"], before["embedding_bags.t0.weight"])
    assert not torch.equal(after["embedding_bags.t2.weight"], before["embedding_bags.t2.weight"])


def test_torch_adamw_over_the_parameters_is_refused_naming_sparse_adamw() -> None:
    with pytest.raises(TypeError, match=r"SparseAdamW.*optimizer_type=torch\.optim\.AdamW"):
        row_update(torch.optim.AdamW, {"lr": 0.1}, fused=False)


def test_cli_and_training_loop_know_adamw() -> None:
    import embcache.cli as cli
    from embcache.cli import settings
    from embcache.train.loop import make_dense_optimizer, make_sparse_optimizer

    assert "adamw" in cli.SPARSE_OPTIMIZERS and settings.DEFAULT_LR["adamw"] == by_cli("adamw").lr
    mod = embcache.CachedEmbeddingBagCollection(tables=TABLES, store=embcache.HostKV())
    assert type(make_sparse_optimizer("adamw", mod, lr=0.01)) is embcache.SparseAdamW
    dense = make_dense_optimizer("adamw", torch.nn.Linear(2, 2).parameters(), lr=0.01)
    assert type(dense) is torch.optim.AdamW
    assert cli.build_parser().parse_args(["train", "--optimizer", "adamw"]).optimizer == "adamw"


def test_recstore_backend_adamw_matches_float64() -> None:
    from embcache.recstore import KVClient, KVOptimizer

    opt = KVOptimizer.from_config({"type": "AdamW", "learning_rate": 0.05, "epsilon": 1e-8,
                                   "beta1": 0.8, "beta2": 0.95, "weight_decay": 0.5})  # fmt: skip
    assert opt.update == UPDATE and opt.state_dim(4) == 8
    assert KVOptimizer("AdamW").update.weight_decay == 1e-2  # the rule's default
    rows, dim = 9, 4
    kv = KVClient(embcache.HostKV())
    kv.init_data("t", (rows, dim), torch.float32, optimizer=opt)
    w = kv.pull("t", torch.arange(rows)).double()
    m, v = torch.zeros(rows, dim).double(), torch.zeros(rows, dim).double()
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 4):
        ids = torch.randint(0, rows - 2, (6,), generator=gen)
        ids[1] = ids[0]
        grads = torch.randn(6, dim, generator=gen)
        kv.update_async("t", ids, grads)
        reference_step(w, m, v, ids, grads, UPDATE, step)
    kv.flush()
    torch.testing.assert_close(kv.pull("t", torch.arange(rows)).double(), w, rtol=1e-5, atol=1e-6)
    kv.close()


# ----------------------------------------------------------------------------------------------
# the rules' table


def test_every_table_derives_from_the_rules() -> None:
    from embcache.train.loop import SPARSE_OPTIMIZERS

    for rule, spec in RULES.items():
        assert spec.rule is rule and by_cli(spec.cli) is spec
        assert by_recstore(spec.recstore.upper()) is spec
        assert SPARSE_OPTIMIZERS[spec.cli] is getattr(embcache, spec.sparse_class)
        cls = getattr(embcache, spec.sparse_class)
        params = inspect.signature(cls.__init__).parameters
        for key, default in spec.hyper.items():
            if key in params:  # the constructor's defaults are the spec's
                assert params[key].default == default, (cls.__name__, key)
        if spec.torch_class.startswith("torch.optim."):
            torch_cls = getattr(torch.optim, spec.torch_class.rpartition(".")[2])
            assert by_torch_class(torch_cls, fused=True) is spec
            assert (by_torch_class(torch_cls) is spec) is True
    assert by_torch_class(torch.optim.Adam) is None
    assert by_torch_class(torch.optim.Adam, fused=True) is RULES[OptimRule.ADAM]


@pytest.mark.parametrize(
    ("update", "expected"),
    [
        (RowUpdate(OptimRule.SGD, lr=0.1), "EXACT_SGD"),
        (RowUpdate(OptimRule.ADAGRAD, lr=0.1), "EXACT_ADAGRAD"),
        (RowUpdate(OptimRule.ADAGRAD, lr=0.1, lr_decay=0.1), None),
        (RowUpdate(OptimRule.ROWWISE_ADAGRAD, lr=0.1, weight_decay=0.1), None),
        (RowUpdate(OptimRule.ADAM, lr=0.1), None),
        (RowUpdate(OptimRule.ADAMW, lr=0.1, weight_decay=0.0), None),
    ],
)
def test_one_predicate_decides_the_fbgemm_path(update: RowUpdate, expected) -> None:
    """`TbeStep.for_engine` and `can_apply` both ask `fbgemm_type`."""
    assert fbgemm_type(update) == expected
    assert "fbgemm_type" in inspect.getsource(TbeStep.for_engine)
    assert "fbgemm_type" in inspect.getsource(TbeStep.can_apply)
