"""torch's loop idioms around a cached collection, against torchrec's EmbeddingBagCollection
trained the same way (issue 44, findings 5 and 6):

* a forward that is never backpropagated (a validation pass in ``eval()`` without
  ``torch.no_grad()``, a training-mode forward whose output is dropped) keeps no slot locked
  past the next training forward or a flush, so ``embcache.save`` after it works, and the rows
  train on as torchrec's do; a backward that comes after its slots were given back is still
  exact;
* ``opt.zero_grad(); loss.backward(); if bad: continue; opt.step()`` (a skipped batch) with a
  torch optimizer over ``model.parameters()`` (``set_to_none`` either way) and with embcache's
  sparse optimizers;
* two backwards before one step without ``accumulate_grads=True`` are refused with advice
  that names it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torchrec
from torchrec import KeyedJaggedTensor

import embcache
from embcache import CachedEmbeddingBagCollection

from .conftest import assert_close, feature_rows, locked_slots, random_kjt, table_configs

CACHES = {
    "whole": embcache.CacheConfig(load_factor=1.0),  # on the CPU: the TBE step
    "10%": embcache.CacheConfig(load_factor=0.1),  # evictions, locks, re-resolves
}
STEPS = 5


class Model(torch.nn.Module):
    """A collection under a dense layer: the loss of a batch."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(1)
        width = sum(t.embedding_dim * len(t.feature_names) for t in ebc.embedding_bag_configs())
        self.over = torch.nn.Linear(width, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        values = self.ebc(kjt).values()
        return self.over(values).sin().sum() + 0.5 * values.square().sum()


def _pair(cache: str, **kwargs) -> tuple[Model, Model]:
    """torchrec's collection and ours holding its rows, each under the same dense layer."""
    tables = table_configs()
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=tables)
    ours = CachedEmbeddingBagCollection(tables=tables, cache=CACHES[cache], **kwargs)
    ours.load_state_dict(ref.state_dict())
    return Model(ref), Model(ours)


def _batches(n: int = STEPS, seed: int = 3) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = feature_rows(table_configs())
    return [random_kjt(gen, rows, batch_size=6, id_pool=40) for _ in range(n)]


def _assert_same(ours: Model, ref: Model, what: str) -> None:
    got = ours.ebc.state_dict()
    for k, v in ref.ebc.state_dict().items():
        assert_close(got[k], v, f"{what}: {k}", rtol=1e-5, atol=1e-6)
    for p, q in zip(ref.over.parameters(), ours.over.parameters(), strict=True):
        assert_close(q, p, f"{what}: dense")


def _no_slot_locked(model: Model) -> bool:
    return not any(locked_slots(model.ebc))


# -- finding 5: forward-only passes --------------------------------------------------------------


def _eval_with_grad(model: Model, kjt: KeyedJaggedTensor) -> None:
    model.eval()  # torch.no_grad() forgotten: the output records a graph
    model(kjt)
    model.train()


def _train_mode_dropped(model: Model, kjt: KeyedJaggedTensor) -> None:
    out = model(kjt)
    del out


def _no_grad(model: Model, kjt: KeyedJaggedTensor) -> None:
    model.eval()
    with torch.no_grad():
        model(kjt)
    model.train()


PASSES: dict[str, Callable[[Model, KeyedJaggedTensor], None]] = {
    "eval-with-grad": _eval_with_grad,
    "train-mode-dropped": _train_mode_dropped,
    "no-grad": _no_grad,
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("kind", list(PASSES))
def test_a_validation_pass_then_save_and_training_goes_on(
    kind: str, cache: str, tmp_path: Path
) -> None:
    """A validation pass after each step, then ``embcache.save``: no slot stays locked, the
    save works, and the rows and dense weights train as torchrec's (whose validation pass
    changes nothing)."""
    ref, ours = _pair(cache)
    opts = [torch.optim.Adagrad(m.parameters(), lr=0.2) for m in (ref, ours)]
    held_out = _batches(2, seed=11)
    for step, kjt in enumerate(_batches()):
        for model, opt in zip((ref, ours), opts, strict=True):
            opt.zero_grad()
            model(kjt).backward()
            opt.step()
            for v in held_out:
                PASSES[kind](model, v)
        embcache.save(tmp_path / f"step{step}", ours)
        assert _no_slot_locked(ours), f"step {step}: a validation pass left slots locked"
        _assert_same(ours, ref, f"step {step}")


@pytest.mark.parametrize("cache", list(CACHES))
def test_flush_releases_a_forward_without_backward(cache: str) -> None:
    """A training-mode forward with no backward locks its slots; a flush gives them back (the
    optimizer's zero_grad has no gradient to drop: torch never calls into the collection
    then), and so does the next training forward, which then holds its own only."""
    _, ours = _pair(cache)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    first, second = _batches(2)
    ours(first).backward()
    opt.step()
    out = ours(first)
    if cache == "10%":
        assert not _no_slot_locked(ours), "a training forward locks its slots"
    ours.ebc.flush()
    assert _no_slot_locked(ours)
    del out
    ours(second)
    held = locked_slots(ours.ebc)
    ours(first)  # the previous forward's slots given back at this one
    ours.ebc.flush()
    assert _no_slot_locked(ours), held


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("between", ["flush", "save", "no-grad"])
def test_a_backward_after_its_forward_was_released_is_exact(
    between: str, cache: str, tmp_path: Path
) -> None:
    """forward, then a flush / save / no_grad forward (which release its slots), then its
    backward and the step: the same rows as torchrec's (they are located again)."""
    ref, ours = _pair(cache)
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (ref, ours)]
    other = _batches(1, seed=5)[0]
    for step, kjt in enumerate(_batches()):
        for model, opt in zip((ref, ours), opts, strict=True):
            opt.zero_grad()
            loss = model(kjt)
            if model is ours:
                if between == "flush":
                    ours.ebc.flush()
                elif between == "save":
                    embcache.save(tmp_path / f"s{step}", ours)
                else:
                    _no_grad(ours, other)
            loss.backward()
            opt.step()
        _assert_same(ours, ref, f"step {step}")
    assert _no_slot_locked(ours)


# -- finding 6: a skipped batch, accumulation ----------------------------------------------------


def _torch_sgd(model: Model) -> list:
    return [torch.optim.SGD(model.parameters(), lr=0.3)]


def _torch_adagrad(model: Model) -> list:
    return [torch.optim.Adagrad(model.parameters(), lr=0.2)]


def _ref_sgd(model: Model) -> list:
    return [torch.optim.SGD(model.parameters(), lr=0.3)]


def _ref_rowwise(model: Model) -> list:
    from torchrec.optim import RowWiseAdagrad

    return [
        RowWiseAdagrad(model.ebc.parameters(), lr=0.2, eps=1e-8),
        torch.optim.SGD(model.over.parameters(), lr=0.3),
    ]


def _sparse_sgd(model: Model) -> list:
    return [
        embcache.SparseSGD([model.ebc], lr=0.3),
        torch.optim.SGD(model.over.parameters(), lr=0.3),
    ]


def _sparse_rowwise(model: Model) -> list:
    return [
        embcache.SparseRowWiseAdaGrad([model.ebc], lr=0.2, eps=1e-8),
        torch.optim.SGD(model.over.parameters(), lr=0.3),
    ]


# name -> (torchrec's optimizers, ours)
SKIPPERS = {
    "torch-SGD": (_ref_sgd, _torch_sgd),
    "torch-Adagrad": (_torch_adagrad, _torch_adagrad),
    "SparseSGD": (_ref_sgd, _sparse_sgd),
    "SparseRowWiseAdaGrad": (_ref_rowwise, _sparse_rowwise),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("set_to_none", [True, False], ids=["to-none", "to-zero"])
@pytest.mark.parametrize("name", list(SKIPPERS))
def test_skipping_a_bad_batch(name: str, set_to_none: bool, cache: str) -> None:
    """``zero_grad(); backward(); if bad: continue; step()``: the skipped batch's gradient is
    dropped by the next zero_grad, and training matches torchrec's."""
    ref, ours = _pair(cache)
    make_ref, make_ours = SKIPPERS[name]
    runs = [(ref, make_ref(ref)), (ours, make_ours(ours))]
    for step, kjt in enumerate(_batches()):
        for model, opts in runs:
            for opt in opts:
                opt.zero_grad(set_to_none=set_to_none)
            model(kjt).backward()
            if step in (1, 2):  # a bad batch, twice running
                continue
            for opt in opts:
                opt.step()
        _assert_same(ours, ref, f"step {step}")


@pytest.mark.parametrize(
    "make",
    [
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        lambda m: embcache.SparseSGD([m.ebc], lr=0.1),
    ],
    ids=["torch-optimizer", "embcache-optimizer"],
)
def test_accumulating_without_accumulate_grads_names_it(make: Callable) -> None:
    """Two backwards before one step: refused at the second forward, advising
    accumulate_grads=True (and how to drop the gradient), whoever holds the rows."""
    _, ours = _pair("10%")
    make(ours)
    first, second = _batches(2)
    ours(first).backward()
    with pytest.raises(RuntimeError, match=r"accumulate_grads=True") as e:
        ours(second)
    assert "zero_grad()" in str(e.value)
