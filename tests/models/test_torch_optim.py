"""Training a cached collection the torchrec way (embcache.models.torch_optim): a torch optimizer
over model.parameters(), a fused optimizer (optimizer_type=) with torchrec's KeyedOptimizer,
apply_optimizer_in_backward; each against torchrec's EmbeddingBagCollection trained by the same
torch optimizer on the same batches, or refused at its first step with what to do."""

from __future__ import annotations

import pytest
import torch
import torchrec
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.fused_embedding_modules import (
    FusedEmbeddingBagCollection,
    fuse_embedding_optimizer,
)
from torchrec.optim import RowWiseAdagrad

import embcache
from embcache import CachedEmbeddingBagCollection

from .conftest import assert_close, feature_rows, random_kjt, table_configs

CACHES = {"all": None, "partly": embcache.CacheConfig(capacity=8, ways=4)}
TORCH_OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"lr": 0.3}),
    "Adagrad": (
        torch.optim.Adagrad,
        {"lr": 0.2, "lr_decay": 0.05, "initial_accumulator_value": 0.1},
    ),
    "RowWiseAdagrad": (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8}),
    "SparseAdam": (torch.optim.SparseAdam, {"lr": 0.05}),
}


def _reference(tables, sparse=False):
    """torchrec's collection with random rows; sparse gradients for torch's SparseAdam."""
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=tables)
    for bag in ref.embedding_bags.values():
        bag.sparse = sparse
    return ref


def _ours(ref, tables, cache=None, **kwargs):
    ours = CachedEmbeddingBagCollection(tables=tables, cache=cache, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ours


class Model(torch.nn.Module):
    """A collection and a dense layer over its output: one model, one optimizer."""

    def __init__(self, ebc) -> None:
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(1)
        self.over = torch.nn.Linear(
            sum(t.embedding_dim * len(t.feature_names) for t in ebc.embedding_bag_configs()), 1
        )

    def forward(self, kjt):
        return self.over(self.ebc(kjt).values()).sin().sum()


def _train(model, opt, batches, sched=None):
    for kjt in batches:
        opt.zero_grad()
        model(kjt).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _batches(tables, n=4, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [random_kjt(gen, feature_rows(tables), batch_size=5, id_pool=30) for _ in range(n)]


def _assert_same(ours_model, ref_model, what):
    for k, v in ref_model.ebc.state_dict().items():
        assert_close(ours_model.ebc.state_dict()[k], v, f"{what}: {k}", rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(
        ref_model.over.named_parameters(), ours_model.over.parameters(), strict=True
    ):
        assert_close(q, p, f"{what}: dense {name}")


# -- a torch optimizer over model.parameters() ----------------------------------------------


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", list(TORCH_OPTIMIZERS))
def test_torch_optimizer_over_model_parameters_trains_the_rows(name: str, cache: str) -> None:
    cls, kwargs = TORCH_OPTIMIZERS[name]
    tables = table_configs()
    ref = Model(_reference(tables, sparse=cls is torch.optim.SparseAdam))
    ours = Model(_ours(ref.ebc, tables, CACHES[cache]))
    if name in ("SparseAdam", "RowWiseAdagrad"):  # for embedding tables only, not biases
        make = lambda m: [cls(m.ebc.parameters(), **kwargs),  # noqa: E731
                          torch.optim.Adam(m.over.parameters(), lr=kwargs["lr"])]  # fmt: skip
    else:
        make = lambda m: [cls(m.parameters(), **kwargs)]  # noqa: E731
    opts_ref, opts = make(ref), make(ours)
    for kjt in _batches(tables):
        for model, optimizers in ((ref, opts_ref), (ours, opts)):
            for o in optimizers:
                o.zero_grad()
            model(kjt).backward()
            for o in optimizers:
                o.step()
    _assert_same(ours, ref, name)


def test_an_lr_scheduler_drives_the_rows_lr() -> None:
    tables = table_configs()
    ref = Model(_reference(tables))
    ours = Model(_ours(ref.ebc, tables))
    runs = []
    for model in (ref, ours):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        runs.append((model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)))
    for kjt in _batches(tables):
        for model, opt, sched in runs:
            _train(model, opt, [kjt], sched)
    _assert_same(ours, ref, "StepLR")


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: torch.optim.Adam(p, lr=0.1), ["Adam", "SparseAdam"]),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), ["momentum"]),
        (lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.01), ["weight_decay"]),
        (lambda p: torch.optim.RMSprop(p, lr=0.1), ["RMSprop", "optimizer_type"]),
    ],
    ids=["Adam", "momentum", "weight-decay", "RMSprop"],
)
def test_optimizers_that_move_untouched_rows_fail_at_the_first_step(make, words) -> None:
    tables = table_configs()
    model = Model(_ours(_reference(tables), tables))
    opt = make(model.parameters())
    tables_before = model.ebc.state_dict()
    dense_before = [p.detach().clone() for p in model.over.parameters()]
    model(_batches(tables, n=1)[0]).backward()
    with pytest.raises((TypeError, ValueError)) as info:
        opt.step()
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    for k, v in tables_before.items():
        assert torch.equal(model.ebc.state_dict()[k], v), k
    for p, q in zip(model.over.parameters(), dense_before, strict=True):
        assert torch.equal(p, q)


def test_zero_grad_between_backward_and_step_drops_the_rows_gradients() -> None:
    tables = table_configs()
    ref = Model(_reference(tables))
    ours = Model(_ours(ref.ebc, tables))
    opts = [torch.optim.Adagrad(m.parameters(), lr=0.2) for m in (ref, ours)]
    batches = _batches(tables)
    for i, kjt in enumerate(batches):
        for model, opt in zip((ref, ours), opts, strict=True):
            model(kjt).backward()
            if i == 1:
                opt.zero_grad()  # this batch's gradients are dropped, embeddings included
            opt.step()
            opt.zero_grad()
    _assert_same(ours, ref, "zero_grad before step")


def test_a_loop_that_never_trains_the_tables_fails_at_the_next_forward() -> None:
    tables = table_configs()
    model = Model(_ours(_reference(tables), tables))
    opt = torch.optim.SGD(model.over.parameters(), lr=0.1)  # the tables left out
    batches = _batches(tables, n=2)
    _train(model, opt, batches[:1])
    with pytest.raises(RuntimeError, match=r"nothing trains its tables.*model.parameters"):
        model(batches[1])


def test_an_embcache_optimizer_keeps_the_rows_when_the_torch_one_holds_them_too() -> None:
    tables = table_configs()
    ref = Model(_reference(tables))
    ours = Model(_ours(ref.ebc, tables))
    sparse = embcache.SparseSGD([ours.ebc], lr=0.3)
    dense = torch.optim.SGD(ours.parameters(), lr=0.3)  # holds the anchor as well
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    for kjt in _batches(tables):
        _train(ref, ref_opt, [kjt])
        dense.zero_grad()
        ours(kjt).backward()
        dense.step()
        sparse.step()
    _assert_same(ours, ref, "SparseSGD beside torch SGD")


def test_apply_optimizer_in_backward_updates_the_rows_in_backward() -> None:
    tables = table_configs()
    ref = Model(_reference(tables))
    ours = Model(_ours(ref.ebc, tables))
    for model in (ref, ours):
        _apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.4})
    opts = [torch.optim.SGD(m.over.parameters(), lr=0.4) for m in (ref, ours)]
    for kjt in _batches(tables):
        for model, opt in zip((ref, ours), opts, strict=True):
            before = model.ebc.state_dict()
            _train(model, opt, [kjt])
            assert model.ebc.state_dict().keys() == before.keys()
    _assert_same(ours, ref, "in backward")


def test_torchrecs_fuse_embedding_optimizer_leaves_the_collection_trainable() -> None:
    tables = table_configs()
    ref = Model(_reference(tables))
    ours = Model(_ours(ref.ebc, tables))
    ebc = ours.ebc
    assert fuse_embedding_optimizer(ours, torch.optim.SGD, {"lr": 0.3}, torch.device("cpu")) is ours
    assert ours.ebc is ebc  # not a torchrec EmbeddingBagCollection: left in place
    ref_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.3) for m in (ref, ours))
    for kjt in _batches(tables):
        _train(ref, ref_opt, [kjt])
        _train(ours, opt, [kjt])
    _assert_same(ours, ref, "after fuse_embedding_optimizer")


# -- a fused collection (optimizer_type=) -------------------------------------------------------


FUSED = {
    "SGD": (torch.optim.SGD, {"lr": 0.3}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-8}),
    "RowWiseAdagrad": (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8}),
}


def _two_tables():
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=12, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=9, feature_names=["f1"]),
    ]


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_collection_matches_torchrecs_fused_collection(name: str, cache: str) -> None:
    cls, kwargs = FUSED[name]
    tables = _two_tables()
    theirs = FusedEmbeddingBagCollection(tables=tables, optimizer_type=cls, optimizer_kwargs=kwargs)
    ours = CachedEmbeddingBagCollection(
        tables=tables, optimizer_type=cls, optimizer_kwargs=kwargs, cache=CACHES[cache]
    )
    ours.load_state_dict(theirs.state_dict())
    for kjt in _batches(tables, n=4):
        for m in (theirs, ours):
            m(kjt).values().sin().sum().backward()  # updated in backward: no step
    for k, v in theirs.state_dict().items():
        assert_close(ours.state_dict()[k], v, f"{name}: {k}", rtol=1e-5, atol=1e-6)


def test_fused_optimizer_is_a_keyed_optimizer_whose_state_round_trips() -> None:
    tables = _two_tables()
    ours = CachedEmbeddingBagCollection(
        tables=tables, optimizer_type=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.2}
    )
    for kjt in _batches(tables, n=2):
        ours(kjt).values().sum().backward()
    fused = ours.fused_optimizer()
    assert isinstance(fused, torchrec.optim.KeyedOptimizer)
    state = fused.state_dict()["state"]
    key = "t0.weight"  # torchrec FusedEmbeddingBagCollection's key
    acc = state[key][f"{key}.momentum_1"]
    assert acc.shape == (12, 4) and bool((acc > 0).any())  # Adagrad's sum of squares
    assert torch.equal(acc, ours.table_rows("t0")[:, 4:])
    zeroed = {k: {n: torch.zeros_like(t) for n, t in s.items()} for k, s in state.items()}
    fused.load_state_dict({"state": zeroed})
    assert not bool(ours.table_rows("t0")[:, 4:].any())
    fused.load_state_dict({"state": state})
    assert torch.equal(ours.table_rows("t0")[:, 4:], acc)


def test_an_lr_scheduler_drives_the_fused_optimizer() -> None:
    tables = _two_tables()
    ref = Model(_reference(tables))
    ours = Model(
        _ours(ref.ebc, tables, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.5})
    )
    fused = ours.ebc.fused_optimizer()
    sched = torch.optim.lr_scheduler.StepLR(fused, step_size=1, gamma=0.3)
    ref_opt = torch.optim.SGD(ref.ebc.parameters(), lr=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.3)
    for kjt in _batches(tables):
        _train(ref, ref_opt, [kjt], ref_sched)
        ours(kjt).backward()  # updated in backward
        fused.step()  # nothing left to do, as torchrec's fused optimizers
        sched.step()
    for k, v in ref.ebc.state_dict().items():
        assert_close(ours.ebc.state_dict()[k], v, k)


def test_fused_adam_is_sparse_adam_on_the_touched_rows() -> None:
    tables = _two_tables()
    ref = Model(_reference(tables, sparse=True))
    ours = Model(
        _ours(ref.ebc, tables, optimizer_type=torch.optim.Adam, optimizer_kwargs={"lr": 0.05})
    )
    ref_opt = torch.optim.SparseAdam(list(ref.ebc.parameters()), lr=0.05)
    for kjt in _batches(tables):
        _train(ref, ref_opt, [kjt])
        ours(kjt).backward()
    for k, v in ref.ebc.state_dict().items():
        assert_close(ours.ebc.state_dict()[k], v, k)


def test_bad_fused_arguments_are_refused() -> None:
    tables = _two_tables()
    with pytest.raises(ValueError, match="optimizer_kwargs needs an optimizer_type"):
        CachedEmbeddingBagCollection(tables=tables, optimizer_kwargs={"lr": 0.1})
    with pytest.raises(TypeError, match="RMSprop"):
        CachedEmbeddingBagCollection(
            tables=tables, optimizer_type=torch.optim.RMSprop, optimizer_kwargs={"lr": 0.1}
        )
    with pytest.raises(RuntimeError, match="no fused optimizer"):
        CachedEmbeddingBagCollection(tables=tables).fused_optimizer()
    with pytest.raises(TypeError, match="pass device="):
        CachedEmbeddingBagCollection(tables, False, torch.device("cpu"))


def test_torchrecs_kjt_is_what_the_tests_feed() -> None:
    kjt = _batches(_two_tables(), n=1)[0]
    assert isinstance(kjt, KeyedJaggedTensor)
