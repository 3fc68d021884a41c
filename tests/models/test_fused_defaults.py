"""A fused collection (``optimizer_type=``) stands in for torchrec's FusedEmbeddingBagCollection:
FBGEMM's defaults for what ``optimizer_kwargs`` leaves out (eps 1e-8, not torch's 1e-10), and
``fused_optimizer().state_dict()`` keyed as torchrec keys it, so optimizer checkpoints load
either way. The reference is torchrec's FusedEmbeddingBagCollection itself, on FBGEMM's CPU
TBE (fbgemm-gpu-cpu), trained on the same batches."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagConfig
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad

from embcache import CacheConfig, CachedEmbeddingBagCollection
from embcache.models.torch_optim import row_update

from .conftest import assert_close, feature_rows, random_kjt

# FBGEMM's CPU TBE takes only dims that are multiples of 4; 12 is no power of two.
CACHES = {"all": None, "partly": CacheConfig(capacity=8, ways=4)}
# Default kwargs but lr: the defaults are what is tested (Adam has no CPU TBE to compare to).
FUSED = {
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "RowWiseAdagrad": (RowWiseAdagrad, {"lr": 0.05}),
    "SGD": (torch.optim.SGD, {}),  # FBGEMM's lr 0.01, not torch's 1e-3
}
STEPS = 8


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=12, num_embeddings=30, feature_names=["f0"]),
        EmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=17, feature_names=["f1", "f2"]
        ),
    ]


def _batches(tables, n=STEPS, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [random_kjt(gen, feature_rows(tables), batch_size=6, id_pool=12) for _ in range(n)]


def _pair(name: str, cache: str = "all"):
    """torchrec's fused collection and ours, rows loaded equal."""
    cls, kwargs = FUSED[name]
    tables = _tables()
    torch.manual_seed(0)
    theirs = FusedEmbeddingBagCollection(
        tables=tables, optimizer_type=cls, optimizer_kwargs=kwargs, device=torch.device("cpu")
    )
    ours = CachedEmbeddingBagCollection(
        tables=tables, optimizer_type=cls, optimizer_kwargs=kwargs, cache=CACHES[cache]
    )
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _train(models, batches) -> None:
    for kjt in batches:
        for m in models:
            m(kjt).values().sin().sum().backward()  # updated in backward: no step


def _assert_same_tables(ours, theirs, what: str) -> None:
    for k, v in theirs.state_dict().items():
        assert_close(ours.state_dict()[k], v, f"{what}: {k}", rtol=0.0, atol=1e-6)


def _assert_same_state(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: {actual.keys()} vs {expected.keys()}"
    assert actual["state"].keys() == expected["state"].keys(), what
    for key, parts in expected["state"].items():
        assert parts.keys() == actual["state"][key].keys(), f"{what}: {key}"
        for name, value in parts.items():
            # sums of squares grow to ~1e2: float32's rounding there is relative
            assert_close(actual["state"][key][name], value, f"{what}: {name}", 1e-6, 1e-6)


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", list(FUSED))
def test_default_kwargs_train_as_torchrecs_fused_collection(name: str, cache: str) -> None:
    theirs, ours = _pair(name, cache)
    _train((theirs, ours), _batches(_tables()))
    _assert_same_tables(ours, theirs, f"{name} after {STEPS} steps")
    _assert_same_state(
        ours.fused_optimizer().state_dict(), theirs.fused_optimizer().state_dict(), name
    )


def test_fused_takes_fbgemms_defaults_and_a_torch_optimizer_keeps_torchs() -> None:
    _, ours = _pair("Adagrad")
    group = ours.fused_optimizer().param_groups[0]
    assert group["eps"] == 1e-8 and group["lr"] == 0.05
    assert row_update(torch.optim.Adagrad, {"lr": 0.05}, fused=True)[0].eps == 1e-8
    assert row_update(RowWiseAdagrad, {"lr": 0.05}, fused=True)[0].eps == 1e-8
    assert row_update(torch.optim.SGD, {}, fused=True)[0].lr == 0.01
    # A torch optimizer over model.parameters() is torch's optimizer: torch's defaults.
    assert row_update(torch.optim.Adagrad, {"lr": 0.05}, fused=False)[0].eps == 1e-10
    assert row_update(RowWiseAdagrad, {"lr": 0.05}, fused=False)[0].eps == 1e-10
    # Given values win; FBGEMM's own names (as torchrec passes them to its TBE) are taken.
    assert row_update(torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-3}, fused=True)[0].eps == 1e-3
    adam = row_update(torch.optim.Adam, {"learning_rate": 0.2, "beta2": 0.9}, fused=True)[0]
    assert (adam.lr, adam.beta1, adam.beta2, adam.eps) == (0.2, 0.9, 0.9, 1e-8)


@pytest.mark.parametrize("name", list(FUSED))
def test_torchrecs_optimizer_checkpoint_loads_into_ours(name: str) -> None:
    theirs, ours = _pair(name)
    batches = _batches(_tables())
    _train((theirs,), batches[:4])
    ours.load_state_dict(theirs.state_dict())
    ours.fused_optimizer().load_state_dict(theirs.fused_optimizer().state_dict())
    _assert_same_state(
        ours.fused_optimizer().state_dict(), theirs.fused_optimizer().state_dict(), name
    )
    _train((theirs, ours), batches[4:])  # the loaded state drives the next steps
    _assert_same_tables(ours, theirs, f"{name} resumed from torchrec's checkpoint")


@pytest.mark.parametrize("name", list(FUSED))
def test_our_optimizer_checkpoint_loads_into_torchrecs(name: str) -> None:
    theirs, ours = _pair(name)
    batches = _batches(_tables())
    _train((ours,), batches[:4])
    theirs.load_state_dict(ours.state_dict())
    theirs.fused_optimizer().load_state_dict(ours.fused_optimizer().state_dict())
    _assert_same_state(
        theirs.fused_optimizer().state_dict(), ours.fused_optimizer().state_dict(), name
    )
    _train((theirs, ours), batches[4:])
    _assert_same_tables(ours, theirs, f"{name} resumed by torchrec from our checkpoint")


def test_a_wrong_state_shape_is_refused_and_changes_nothing() -> None:
    _, ours = _pair("RowWiseAdagrad")
    _train((ours,), _batches(_tables(), n=2))
    fused = ours.fused_optimizer()
    before = fused.state_dict()
    bad = {"state": {k: {n: torch.zeros(3) for n in s} for k, s in before["state"].items()}}
    with pytest.raises(ValueError, match=r"table 't0'.*expected \(30,\)"):
        fused.load_state_dict(bad)
    _assert_same_state(fused.state_dict(), before, "after a refused load")
