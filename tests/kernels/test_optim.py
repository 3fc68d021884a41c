"""Optimizer row updates and gradient aggregation, both backends.

Each rule is checked three ways: against its formula in float64 on random rows (untouched rows
poisoned with NaN must come back bit-identical), against torch's own optimizer (SGD, Adagrad,
SparseAdam) driving an ``nn.EmbeddingBag(sparse=True)`` for several steps, and, for row-wise
Adagrad, against FBGEMM's CPU table-batched embedding with EXACT_ROWWISE_ADAGRAD.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from embcache.kernels.optim import (
    OptimRule,
    RowUpdate,
    aggregate_grads,
    apply_row_update,
    state_dim,
)
from embcache.kernels.optim_rules import RULES

RTOL, ATOL = 1e-5, 1e-6  # float32 rounding of a few chained ops

UPDATES = {
    OptimRule.SGD: RowUpdate(OptimRule.SGD, lr=0.1),
    OptimRule.ADAGRAD: RowUpdate(OptimRule.ADAGRAD, lr=0.1, eps=1e-10, lr_decay=0.05),
    OptimRule.ROWWISE_ADAGRAD: RowUpdate(OptimRule.ROWWISE_ADAGRAD, lr=0.1, eps=1e-8),
    OptimRule.ADAM: RowUpdate(OptimRule.ADAM, lr=0.01, eps=1e-8, beta1=0.8, beta2=0.99),
    OptimRule.ADAMW: RowUpdate(
        OptimRule.ADAMW, lr=0.01, eps=1e-8, beta1=0.8, beta2=0.99, weight_decay=0.3
    ),
}
RULE_IDS = [r.name.lower() for r in OptimRule]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """allclose in float64, with the worst element in the message."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    err = (actual - expected).abs() - RTOL * expected.abs()
    if actual.shape != expected.shape or not bool((err <= ATOL).all()):
        i = int(err.argmax())
        raise AssertionError(
            f"{what}: {int((err > ATOL).sum())} of {err.numel()} elements differ; worst at flat "
            f"{i}: {actual.flatten()[i].item()!r} vs {expected.flatten()[i].item()!r}"
        )


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-for-bit equality of float32 tensors, NaN payloads included."""
    same = actual.cpu().view(torch.int32) == expected.cpu().view(torch.int32)
    assert bool(same.all()), f"{what}: {int((~same).sum())} elements changed"


def formula_float64(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    grads: torch.Tensor,
    update: RowUpdate,
    step: int,
) -> torch.Tensor:
    """The touched rows' first ``dim + S`` columns after an update, float64 ``[n, dim + S]``:
    the rule's float64 reference (`optim_rules.RuleSpec.reference`)."""
    spec = RULES[update.rule]
    r = rows.double()[slots]
    parts, lo = {}, dim
    for part in spec.state:
        parts[part.name] = r[:, lo : lo + part.width(dim)]
        lo += part.width(dim)
    w, parts = spec.reference(r[:, :dim], parts, grads.double(), update, step)
    return torch.cat([w, *(parts[p.name] for p in spec.state)], 1)


# ----------------------------------------------------------------------------------------------
# each rule against its formula
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.05], ids=["no_wd", "wd"])
@pytest.mark.parametrize("dim", [1, 3, 17, 130])
@pytest.mark.parametrize("rule", list(OptimRule), ids=RULE_IDS)
def test_rule_matches_formula(
    backend: str, device: torch.device, rule: OptimRule, dim: int, weight_decay: float
) -> None:
    gen = torch.Generator().manual_seed(1000 * int(rule) + dim)
    n_rows, n = 23, 9
    update = dataclasses.replace(UPDATES[rule], weight_decay=weight_decay)
    width = dim + state_dim(rule, dim)
    # One spare column past the state, NaN, that must stay so.
    rows = torch.full((n_rows, width + 1), float("nan"))
    slots = torch.cat(
        [torch.randperm(n_rows - 1, generator=gen)[: n - 1], torch.tensor([n_rows - 1])]
    )
    slots = slots[torch.randperm(n, generator=gen)]
    rows[slots, :dim] = torch.randn(n, dim, generator=gen)
    # Accumulators and second moments are non-negative; first moments any sign.
    rows[slots, dim:width] = torch.rand(n, width - dim, generator=gen) + 0.1
    if rule in (OptimRule.ADAM, OptimRule.ADAMW):
        rows[slots, dim : 2 * dim] = torch.randn(n, dim, generator=gen) * 0.1
    grads = torch.randn(dim, n, generator=gen).t()  # non-contiguous on purpose
    step = 3
    expected = formula_float64(rows, dim, slots, grads, update, step)
    before = rows.clone()

    rows, slots, grads = rows.to(device), slots.to(device), grads.to(device)
    apply_row_update(rows[:, :dim], rows[:, dim:], slots, grads, update, step)

    rows, slots = rows.cpu(), slots.cpu()
    assert_close(rows[slots, :width], expected, f"{rule.name} touched rows")
    untouched = torch.ones(n_rows, dtype=torch.bool)
    untouched[slots] = False
    assert_bits_equal(rows[untouched], before[untouched], "untouched rows")
    assert_bits_equal(rows[:, width:], before[:, width:], "columns past the state")


@pytest.mark.parametrize("rule", list(OptimRule), ids=RULE_IDS)
def test_no_slots_is_a_no_op(backend: str, device: torch.device, rule: OptimRule) -> None:
    dim = 4
    rows = torch.randn(5, dim + state_dim(rule, dim), device=device)
    before = rows.clone()
    empty = torch.empty(0, dtype=torch.int64, device=device)
    grads = torch.empty(0, dim, device=device)
    apply_row_update(rows[:, :dim], rows[:, dim:], empty, grads, UPDATES[rule], 1)
    assert_bits_equal(rows, before, "rows")


def test_state_dim() -> None:
    assert [state_dim(r, 5) for r in OptimRule] == [0, 5, 1, 10, 10]
    assert UPDATES[OptimRule.ADAM].state_dim(3) == 6


# ----------------------------------------------------------------------------------------------
# against torch's optimizers on an nn.EmbeddingBag(sparse=True)
# ----------------------------------------------------------------------------------------------

TORCH_CASES = {
    "sgd": (
        RowUpdate(OptimRule.SGD, lr=0.1),
        lambda p: torch.optim.SGD(p, lr=0.1),
        [],
        0.0,
    ),
    "adagrad": (
        RowUpdate(OptimRule.ADAGRAD, lr=0.1, eps=1e-10, lr_decay=0.1),
        lambda p: torch.optim.Adagrad(
            p, lr=0.1, lr_decay=0.1, eps=1e-10, initial_accumulator_value=0.1
        ),
        ["sum"],
        0.1,
    ),
    "adam": (
        RowUpdate(OptimRule.ADAM, lr=0.05, eps=1e-8, beta1=0.9, beta2=0.999),
        lambda p: torch.optim.SparseAdam(p, lr=0.05, betas=(0.9, 0.999), eps=1e-8),
        ["exp_avg", "exp_avg_sq"],
        0.0,
    ),
}


def random_bags(
    gen: torch.Generator, num_embeddings: int, bags: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids with duplicates (always the last row) and bag offsets, one bag empty."""
    lengths = torch.randint(1, 6, (bags,), generator=gen)
    lengths[1] = 0
    ids = torch.randint(0, num_embeddings // 2, (int(lengths.sum()),), generator=gen)
    ids[0] = num_embeddings - 1
    offsets = torch.cumsum(lengths, 0) - lengths
    return ids, offsets


# torch's Adagrad builds its sparse tensors without invariant checks and says so each time.
@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_matches_torch_optimizer(backend: str, device: torch.device, case: str) -> None:
    update, make_optimizer, state_names, state_init = TORCH_CASES[case]
    gen = torch.Generator().manual_seed(7)
    num_embeddings, dim, bags = 20, 5, 6
    bag = torch.nn.EmbeddingBag(num_embeddings, dim, mode="sum", sparse=True).to(device)
    optimizer = make_optimizer(bag.parameters())
    state = torch.full((num_embeddings, state_dim(update.rule, dim)), state_init, device=device)
    rows = torch.cat([bag.weight.detach().clone(), state], 1)

    for step in range(1, 6):
        ids, offsets = random_bags(gen, num_embeddings, bags)
        ids, offsets = ids.to(device), offsets.to(device)
        target = torch.randn(bags, dim, generator=gen).to(device)
        optimizer.zero_grad()
        (bag(ids, offsets) * target).sum().backward()
        grad = bag.weight.grad  # sparse, one row per occurrence of an id
        unique_ids, summed = aggregate_grads(grad._indices()[0], grad._values())
        assert torch.equal(unique_ids, torch.unique(ids))
        coalesced = grad.coalesce()
        assert_close(summed, coalesced._values(), f"step {step} aggregated grads")
        optimizer.step()

        apply_row_update(rows[:, :dim], rows[:, dim:], unique_ids, summed, update, step)
        assert_close(rows[:, :dim], bag.weight.detach(), f"{case} step {step} weights")
        torch_state = optimizer.state[bag.weight]
        for k, name in enumerate(state_names):
            ours = rows[:, dim * (k + 1) : dim * (k + 2)]
            assert_close(ours, torch_state[name], f"{case} step {step} {name}")


# ----------------------------------------------------------------------------------------------
# row-wise Adagrad against FBGEMM's CPU table-batched embedding
# ----------------------------------------------------------------------------------------------


def test_rowwise_adagrad_matches_fbgemm(backend: str, device: torch.device) -> None:
    # No weight decay here: FBGEMM's CPU TBE (fbgemm-gpu-cpu 1.8.0) ignores weight_decay with
    # WeightDecayMode.L2 (its update equals the undecayed one), so it cannot be the reference
    # for that; test_rule_matches_formula checks L2 against the formula of FBGEMM's GPU kernel.
    pytest.importorskip("fbgemm_gpu")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    gen = torch.Generator().manual_seed(11)
    num_embeddings, dim, bags = 20, 8, 6  # FBGEMM wants dim % 4 == 0
    lr, eps = 0.1, 1e-8
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(num_embeddings, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=lr,
        eps=eps,
    )
    initial = torch.randn(num_embeddings, dim, generator=gen) * 0.1
    tbe.split_embedding_weights()[0].copy_(initial)
    update = RowUpdate(OptimRule.ROWWISE_ADAGRAD, lr=lr, eps=eps)
    rows = torch.cat([initial, torch.zeros(num_embeddings, 1)], 1).to(device)
    bag = torch.nn.EmbeddingBag(num_embeddings, dim, mode="sum", sparse=True).to(device)

    for step in range(1, 5):
        ids, offsets = random_bags(gen, num_embeddings, bags)
        grad_out = torch.randn(bags, dim, generator=gen)
        tbe(ids, torch.cat([offsets, torch.tensor([ids.numel()])])).backward(grad_out)

        with torch.no_grad():
            bag.weight.copy_(rows[:, :dim])
        bag.weight.grad = None
        bag(ids.to(device), offsets.to(device)).backward(grad_out.to(device))
        grad = bag.weight.grad
        unique_ids, summed = aggregate_grads(grad._indices()[0], grad._values())
        apply_row_update(rows[:, :dim], rows[:, dim:], unique_ids, summed, update, step)

        assert_close(rows[:, :dim], tbe.split_embedding_weights()[0], f"step {step} weights")
        momentum = tbe.split_optimizer_states()[0][0]
        assert_close(rows[:, dim], momentum, f"step {step} row accumulators")


# ----------------------------------------------------------------------------------------------
# aggregate_grads
# ----------------------------------------------------------------------------------------------


def float64_segment_sums(ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Each unique id's gradient rows summed in float64, ids ascending."""
    unique_ids = torch.unique(ids)
    expected = torch.zeros(unique_ids.numel(), grads.shape[1], dtype=torch.float64)
    return expected.index_add_(0, torch.searchsorted(unique_ids, ids), grads.double())


def twin_uses_atomics(backend: str, device: torch.device) -> bool:
    """The torch twin's ``index_add_`` adds with float atomics on CUDA: not deterministic."""
    return backend == "torch" and device.type == "cuda"


@pytest.mark.parametrize("dim", [1, 17])
def test_aggregate_grads_sums_duplicates(backend: str, device: torch.device, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    ids = torch.randint(-3, 9, (40,), generator=gen)
    ids[5] = 2**40  # fused ids are large
    grads = torch.randn(40, dim, generator=gen)
    unique_ids, summed = aggregate_grads(ids.to(device), grads.to(device))
    assert torch.equal(unique_ids.cpu(), torch.unique(ids))
    assert_close(summed, float64_segment_sums(ids, grads), "summed grads")


def test_aggregate_grads_empty(backend: str, device: torch.device) -> None:
    ids = torch.empty(0, dtype=torch.int64, device=device)
    unique_ids, summed = aggregate_grads(ids, torch.empty(0, 3, device=device))
    assert unique_ids.shape == (0,) and summed.shape == (0, 3)


def test_aggregate_grads_hot_id(backend: str, device: torch.device) -> None:
    """One id holding thousands of rows among many cold ones (a Zipf head): the sums match
    float64, and two runs give the same bits."""
    gen = torch.Generator().manual_seed(5)
    n_hot, n_cold, dim = 2000, 200, 33
    ids = torch.cat([torch.full((n_hot,), 7), torch.randint(8, 2000, (n_cold,), generator=gen)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    grads = torch.randn(ids.numel(), dim, generator=gen)
    expected = float64_segment_sums(ids, grads)
    runs = [aggregate_grads(ids.to(device), grads.to(device)) for _ in range(2)]
    unique_ids, summed = runs[0]
    assert torch.equal(unique_ids.cpu(), torch.unique(ids))
    # A sum of 2000 unit-variance terms: float32 rounding of the order, scaled by its size.
    torch.testing.assert_close(summed.double().cpu(), expected, rtol=1e-5, atol=5e-4)
    if not twin_uses_atomics(backend, device):
        assert_bits_equal(runs[1][1], summed, "second run")


def test_aggregate_grads_is_deterministic(backend: str, device: torch.device) -> None:
    if twin_uses_atomics(backend, device):
        pytest.skip("the torch twin's index_add_ uses float atomics on CUDA")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (200,), generator=gen)
    # Magnitudes far apart, so any change in the order of the additions shows.
    grads = torch.randn(200, 5, generator=gen) * torch.logspace(-4, 4, 200).unsqueeze(1)
    ids, grads = ids.to(device), grads.to(device)
    first = aggregate_grads(ids, grads)
    for _ in range(2):
        unique_ids, summed = aggregate_grads(ids, grads)
        assert torch.equal(unique_ids, first[0])
        assert_bits_equal(summed, first[1], "summed grads")
    assert_close(first[1], float64_segment_sums(ids.cpu(), grads.cpu()), "summed grads")


@pytest.mark.parametrize("dim", [17, 130])
@pytest.mark.parametrize("share", [0.5, 0.9], ids=["hot50", "hot90"])
def test_aggregate_grads_splits_a_hot_id_and_stays_exact(
    backend: str, device: torch.device, share: float, dim: int
) -> None:
    """One id holding half or nine tenths of 1,300 rows (several of the segment sum's chunks,
    of 256 rows at dim 17 and 64 at dim 130, on a GPU and under the interpreter alike): its
    sum, taken by several programs then in chunk order, matches the float64 sum, and two runs
    give the same bits."""
    n = 1300
    gen = torch.Generator().manual_seed(int(share * 100) + dim)
    hot = torch.rand(n, generator=gen) < share
    ids = torch.where(hot, 2**40 + 7, torch.randint(-5, 60, (n,), generator=gen))
    assert int(hot.sum()) > 2 * 256, "the hot id must span several chunks"
    grads = torch.randn(n, dim, generator=gen)
    expected = float64_segment_sums(ids, grads)
    ids, grads = ids.to(device), grads.to(device)
    (unique_ids, summed), (_, again) = (aggregate_grads(ids, grads) for _ in range(2))
    assert torch.equal(unique_ids.cpu(), torch.unique(ids.cpu()))
    torch.testing.assert_close(summed.double().cpu(), expected, rtol=1e-5, atol=1e-4)
    if not twin_uses_atomics(backend, device):
        assert_bits_equal(again, summed, "second run")


# ----------------------------------------------------------------------------------------------
# bad input: raise, name the problem, change nothing
# ----------------------------------------------------------------------------------------------


def _good_call(device: torch.device) -> dict:
    dim = 4
    return {
        "weights": torch.randn(6, dim, device=device),
        "state": torch.randn(6, 2 * dim, device=device),
        "slots": torch.tensor([5, 0, 2], device=device),
        "grads": torch.randn(3, dim, device=device),
        "update": UPDATES[OptimRule.ADAM],
        "step": 1,
    }


BAD_CALLS = {
    "weights_float64": (
        lambda c: {"weights": c["weights"].double()},
        TypeError,
        "weights must be float32",
    ),
    "weights_1d": (lambda c: {"weights": c["weights"][0]}, ValueError, "weights must be 2-D"),
    "state_too_narrow": (lambda c: {"state": c["state"][:, :7]}, ValueError, "needs 8"),
    "state_rows": (lambda c: {"state": c["state"][:5]}, ValueError, "state has 5 rows"),
    "slots_int32": (lambda c: {"slots": c["slots"].int()}, TypeError, "slots must be int64"),
    "slots_2d": (lambda c: {"slots": c["slots"][None]}, ValueError, "slots must be 1-D"),
    "slot_too_big": (lambda c: {"slots": c["slots"] + 1}, ValueError, "[0, 6)"),
    "slot_negative": (lambda c: {"slots": c["slots"] - 2}, ValueError, "min -2"),
    "slots_repeated": (
        lambda c: {"slots": c["slots"].clone().fill_(2)},
        ValueError,
        "row 2 appears more than once",
    ),
    "grads_float64": (lambda c: {"grads": c["grads"].double()}, TypeError, "grads must be float32"),
    "grads_wrong_dim": (lambda c: {"grads": c["grads"][:, :3]}, ValueError, "[3, 4]"),
    "grads_wrong_n": (lambda c: {"grads": c["grads"][:2]}, ValueError, "[3, 4]"),
    "step_zero": (lambda c: {"step": 0}, ValueError, "step must be >= 1"),
    "step_float": (lambda c: {"step": 1.5}, TypeError, "step must be an int"),
    "update_dict": (lambda c: {"update": {"rule": 3}}, TypeError, "RowUpdate"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_raises_and_changes_nothing(
    backend: str, device: torch.device, case: str
) -> None:
    make_bad, error, message = BAD_CALLS[case]
    good = _good_call(device)
    before = {k: good[k].clone() for k in ("weights", "state")}
    with pytest.raises(error, match=re.escape(message)):
        apply_row_update(**{**good, **make_bad(good)})
    for k, t in before.items():  # bad views share the good tensors' storage
        assert torch.equal(good[k], t), k


BAD_UPDATES = {
    "rule_str": (dict(rule="adam", lr=0.1), TypeError, "OptimRule"),
    "rule_unknown": (dict(rule=7, lr=0.1), ValueError, "not one of"),
    "lr_negative": (dict(rule=OptimRule.SGD, lr=-0.1), ValueError, "lr must be"),
    "lr_nan": (dict(rule=OptimRule.SGD, lr=float("nan")), ValueError, "lr must be"),
    "lr_str": (dict(rule=OptimRule.SGD, lr="0.1"), TypeError, "lr must be a float"),
    "beta1_one": (dict(rule=OptimRule.ADAM, lr=0.1, beta1=1.0), ValueError, "beta1"),
    "lr_decay_adam": (dict(rule=OptimRule.ADAM, lr=0.1, lr_decay=0.1), ValueError, "ADAGRAD"),
}


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_bad_row_update_raises(case: str) -> None:
    kwargs, error, message = BAD_UPDATES[case]
    with pytest.raises(error, match=message):
        RowUpdate(**kwargs)


def test_row_update_accepts_int_rule() -> None:
    assert RowUpdate(2, lr=1).rule is OptimRule.ROWWISE_ADAGRAD


@pytest.mark.parametrize(
    ("ids", "grads", "error"),
    [
        (torch.zeros(3, dtype=torch.int32), torch.zeros(3, 2), TypeError),
        (torch.zeros(3, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.float64), TypeError),
        (torch.zeros(3, dtype=torch.int64), torch.zeros(4, 2), ValueError),
        (torch.zeros(3, 1, dtype=torch.int64), torch.zeros(3, 2), ValueError),
    ],
    ids=["ids_int32", "grads_float64", "n_mismatch", "ids_2d"],
)
def test_aggregate_grads_bad_input(
    backend: str, ids: torch.Tensor, grads: torch.Tensor, error: type
) -> None:
    with pytest.raises(error):
        aggregate_grads(ids, grads)


# ----------------------------------------------------------------------------------------------
# half-precision weights: float32 math, stochastic rounding, skipped rows
# ----------------------------------------------------------------------------------------------

HALF = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # relative gap between neighbours


@pytest.mark.parametrize("dtype", list(HALF), ids=["fp16", "bf16"])
@pytest.mark.parametrize("dim", [3, 17])
@pytest.mark.parametrize("rule", list(OptimRule), ids=RULE_IDS)
def test_half_weights_update_in_float32_and_round_to_a_neighbour(
    backend: str,
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    rule: OptimRule,
    dim: int,
    dtype: torch.dtype,
) -> None:
    """Half weights, float32 state: the state matches the float64 formula, each weight lands
    within one gap of the float64 result, untouched rows and rows of slot -1 (not admitted: the
    gradient is dropped) keep their bits, and the other backend agrees (the same draws; its
    float32 update may differ by an ulp, as it may for float32 weights, which can move a
    weight to its other neighbour)."""
    gen = torch.Generator().manual_seed(77 * int(rule) + dim)
    n_rows, n = 29, 11
    update = dataclasses.replace(UPDATES[rule], weight_decay=0.02)
    sdim = state_dim(rule, dim)
    weights = torch.randn(n_rows, dim, generator=gen).to(dtype)
    state = torch.rand(n_rows, sdim, generator=gen) + 0.1
    if rule == OptimRule.ADAM:
        state[:, :dim] = torch.randn(n_rows, dim, generator=gen) * 0.1
    slots = torch.randperm(n_rows, generator=gen)[:n]
    slots[::5] = -1
    grads = torch.randn(n, dim, generator=gen)
    ids = torch.randint(0, 2**62, (n,), generator=gen)
    kept = slots >= 0
    rows64 = torch.cat([weights.double(), state.double()], dim=1)
    expected = formula_float64(rows64, dim, slots[kept], grads[kept], update, 4)
    before_w, before_s = weights.clone(), state.clone()

    w, s = weights.clone().to(device), state.clone().to(device)
    apply_row_update(w, s, slots.to(device), grads.to(device), update, 4, ids=ids.to(device),
                     seed=9)  # fmt: skip
    w, s = w.cpu(), s.cpu()

    assert w.dtype == dtype and s.dtype == torch.float32
    assert_close(s[slots[kept]], expected[:, dim:], f"{rule.name} state")
    target = expected[:, :dim]
    gap = HALF[dtype] * target.abs().clamp(min=2.0**-14)
    assert bool(((w[slots[kept]].double() - target).abs() <= gap).all()), "not a neighbour"
    untouched = torch.ones(n_rows, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.equal(w[untouched].view(torch.int16), before_w[untouched].view(torch.int16))
    assert_bits_equal(s[untouched], before_s[untouched], "untouched state")

    monkeypatch.setenv("EMBCACHE_BACKEND", "torch" if backend == "triton" else "triton")
    w2, s2 = weights.clone().to(device), state.clone().to(device)
    apply_row_update(w2, s2, slots.to(device), grads.to(device), update, 4, ids=ids.to(device),
                     seed=9)  # fmt: skip
    w2, s2 = w2.cpu(), s2.cpu()
    same = w2.view(torch.int16) == w.view(torch.int16)
    assert int((~same).sum()) <= 1, f"backends differ in {int((~same).sum())} weights"
    assert bool(((w2.double() - w.double()).abs() <= 2 * HALF[dtype] * w.double().abs()).all())
    assert_close(s2, s, "state across backends")


@pytest.mark.parametrize("dtype", list(HALF), ids=["fp16", "bf16"])
def test_stochastic_rounding_keeps_updates_below_half_a_gap(
    backend: str, device: torch.device, dtype: torch.dtype
) -> None:
    """SGD steps far below half the gap between neighbours: rounded to nearest the weights never
    move; rounded stochastically they move by the step on average (unbiased)."""
    n, dim, steps = 4096, 2, 10
    gap = HALF[dtype] / 2  # between neighbours just below 1.0
    lr = 0.2 * gap  # each step moves a weight by a fifth of the gap
    update = RowUpdate(OptimRule.SGD, lr=lr)
    grads = torch.ones(n, dim, device=device)
    slots = torch.arange(n, device=device)
    ids = torch.arange(n, device=device) * 31 + 5
    nearest = torch.ones(n, dim, dtype=dtype, device=device)
    stochastic = nearest.clone()
    state = torch.empty(n, 0, device=device)
    for step in range(1, steps + 1):
        apply_row_update(nearest, state, slots, grads, update, step)
        apply_row_update(stochastic, state, slots, grads, update, step, ids=ids, seed=1)
    assert bool((nearest == 1.0).all()), "to nearest, steps below half a gap vanish"
    moved = 1.0 - stochastic.double().mean().item()
    sigma = gap * math.sqrt(steps / (n * dim))
    assert abs(moved - steps * lr) <= 5 * sigma, f"moved {moved}, expected {steps * lr}"


def test_half_weights_bad_ids() -> None:
    good = _good_call(torch.device("cpu"))
    good["weights"] = good["weights"].to(torch.bfloat16)
    with pytest.raises(ValueError, match="ids has 2 entries"):
        apply_row_update(**good, ids=torch.arange(2))
    with pytest.raises(TypeError, match="ids must be int64"):
        apply_row_update(**good, ids=torch.arange(3, dtype=torch.int32))
