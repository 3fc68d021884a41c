"""Sparse optimizers as torch LR schedulers see them, and built after a backward.

* ``param_groups`` is one group ``{"params": modules, "lr", <hyper-parameters>}``; StepLR (and
  any change to the group) drives the rows as it drives torch's optimizer on a torchrec
  reference, from the next step; a change between backward and step applies to that step.
* An optimizer built after a backward takes the pending gradients at its first step.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import StepLR

import embcache
from tests.models.conftest import (
    assert_close,
    cached_copy,
    feature_rows,
    loss_of,
    random_kjt,
    table_configs,
    torchrec_reference,
)

TABLES = table_configs()
ROWS = feature_rows(TABLES)
WIDTH = 21
STEPS = 6

RULES = {
    "sgd": (embcache.SparseSGD, torch.optim.SGD, {"lr": 0.2}),
    "adagrad": (embcache.SparseAdaGrad, torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-10}),
}


def batches(seed: int, n: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [
        (random_kjt(gen, ROWS, 6, id_pool=40), torch.randn(6, WIDTH, generator=gen))
        for _ in range(n)
    ]


def pair(cache: float = 1.0):
    ref = torchrec_reference(TABLES, weighted=False)
    m = cached_copy(ref, TABLES, weighted=False, cache=embcache.CacheConfig(load_factor=cache))
    return ref, m


def assert_rows_match(m, ref) -> None:
    m.flush()
    got, want = m.state_dict(), ref.state_dict()
    for key in want:
        assert_close(got[key], want[key], key)


@pytest.mark.parametrize("cache", [1.0, 0.05], ids=["fits", "evicts"])
@pytest.mark.parametrize("rule", list(RULES))
def test_step_lr_drives_the_rows_as_it_drives_torch(rule: str, cache: float) -> None:
    sparse, dense, kwargs = RULES[rule]
    ref, m = pair(cache)
    opt, ref_opt = sparse([m], **kwargs), dense(ref.parameters(), **kwargs)
    sched, ref_sched = StepLR(opt, step_size=2, gamma=0.5), StepLR(ref_opt, step_size=2, gamma=0.5)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[0]["params"] == [m]
    for kjt, coeff in batches(1, STEPS):
        loss_of(m(kjt).values(), coeff).backward()
        loss_of(ref(kjt).values(), coeff).backward()
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
        sched.step()
        ref_sched.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        assert opt.lr == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert opt.lr == kwargs["lr"] * 0.125
    assert_rows_match(m, ref)


def test_a_change_between_backward_and_step_applies_to_that_step() -> None:
    ref, m = pair()
    opt, ref_opt = embcache.SparseSGD([m], lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    for i, (kjt, coeff) in enumerate(batches(2, 4)):
        loss_of(m(kjt).values(), coeff).backward()
        loss_of(ref(kjt).values(), coeff).backward()
        for group in (*opt.param_groups, *ref_opt.param_groups):
            group["lr"] = 0.05 * (i + 1)
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_rows_match(m, ref)
    opt.param_groups[0]["weight_decay"] = 0.03  # every hyper-parameter of the group is read
    assert opt.update.weight_decay == 0.03
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        opt.step()


@pytest.mark.parametrize("rule", list(RULES))
def test_an_optimizer_built_after_a_backward_takes_its_gradients(rule: str) -> None:
    sparse, dense, kwargs = RULES[rule]
    ref, m = pair(cache=0.05)
    data = batches(3, 3)
    kjt, coeff = data[0]
    loss_of(m(kjt).values(), coeff).backward()  # no optimizer yet
    opt = sparse([m], **kwargs)
    ref_opt = dense(ref.parameters(), **kwargs)
    for i, (kjt, coeff) in enumerate(data):
        if i:  # the first batch's backward ran before the optimizer existed
            loss_of(m(kjt).values(), coeff).backward()
        loss_of(ref(kjt).values(), coeff).backward()
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_rows_match(m, ref)


def test_param_groups_survive_the_state_dict() -> None:
    _, m = pair()
    opt = embcache.SparseAdaGrad([m], lr=0.1)
    sched = StepLR(opt, step_size=1, gamma=0.5)
    kjt, coeff = batches(4, 1)[0]
    loss_of(m(kjt).values(), coeff).backward()
    opt.step()
    sched.step()
    state = opt.state_dict()
    again = embcache.SparseAdaGrad([m], lr=0.1)
    again.load_state_dict(state)
    assert again.param_groups[0]["lr"] == 0.05
    assert again.param_groups[0]["initial_lr"] == 0.1
    with pytest.raises(NotImplementedError, match="one parameter group"):
        again.add_param_group({"params": [], "lr": 1.0})
