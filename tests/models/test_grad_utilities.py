"""torch's gradient utilities reach the cached rows as they reach torchrec's weights
(embcache.models.row_grads): GradScaler unscales the rows' gradient and skips a step when it
holds Inf, clip_grad_norm_ counts and scales it, clip_grad_value_ clamps it, with a torch
optimizer over model.parameters() or an embcache optimizer beside one. Each is compared with
torchrec's EmbeddingBagCollection (as torchrec builds it: dense weight gradients) trained the
same way on the same batches, with every row cached and with a 10% cache whose rows pass
through eviction; an update inside backward refuses them, naming the call."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.optim import RowWiseAdagrad

import embcache
from embcache import CachedEmbeddingBagCollection, CachedEmbeddingCollection
from embcache.models.row_grads import RowGradients

from .conftest import feature_rows, random_kjt, table_configs

CACHES = {
    "whole": embcache.CacheConfig(load_factor=1.0),
    "10%": embcache.CacheConfig(load_factor=0.1),
}
TORCH_OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.3),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.2),
}
TOL = 1e-6  # largest difference from torchrec, rows and dense weights
POISON = 1e36  # a loss term whose scaled gradient overflows float32: Inf in the rows only


class Model(torch.nn.Module):
    """A collection and a dense layer over its output; ``poison`` adds a term whose gradient
    reaches the rows only (finite unscaled, Inf once GradScaler scales it)."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(1)
        width = sum(t.embedding_dim * len(t.feature_names) for t in ebc.embedding_bag_configs())
        self.over = torch.nn.Linear(width, 1)

    def forward(self, kjt: KeyedJaggedTensor, poison: bool = False) -> torch.Tensor:
        values = self.ebc(kjt).values()
        loss = self.over(values).sin().sum() + 0.5 * values.square().sum()
        return loss + POISON * values.sum() if poison else loss


def _pair(cache: str, **kwargs) -> tuple[Model, Model]:
    """torchrec's collection and ours holding its rows, each under the same dense layer."""
    tables = table_configs()
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=tables)
    ours = CachedEmbeddingBagCollection(tables=tables, cache=CACHES[cache], **kwargs)
    ours.load_state_dict(ref.state_dict())
    return Model(ref), Model(ours)


def _batches(n: int = 5, seed: int = 3) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = feature_rows(table_configs())
    return [random_kjt(gen, rows, batch_size=6) for _ in range(n)]


def _max_diff(ours: Model, ref: Model) -> float:
    """The largest difference of the rows and the dense weights."""
    got, want = ours.ebc.state_dict(), ref.ebc.state_dict()
    assert got.keys() == want.keys()
    diffs = [float((got[k] - want[k]).abs().max()) for k in want]
    diffs += [
        float((p - q).detach().abs().max())
        for p, q in zip(ours.over.parameters(), ref.over.parameters(), strict=True)
    ]
    return max(diffs)


# -- GradScaler ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", list(TORCH_OPTIMIZERS))
def test_grad_scaler_unscales_the_rows_and_skips_a_step_with_inf(name: str, cache: str) -> None:
    ref, ours = _pair(cache)
    runs = []
    for model in (ref, ours):
        runs.append(
            (
                model,
                TORCH_OPTIMIZERS[name](model.parameters()),
                torch.amp.GradScaler("cpu", init_scale=1024.0),
            )
        )
    for step, kjt in enumerate(_batches()):
        poison = step == 2  # Inf in the rows' gradient only: GradScaler must see them
        for model, opt, scaler in runs:
            rows_before = model.ebc.state_dict()
            opt.zero_grad()
            scaler.scale(model(kjt, poison)).backward()
            scaler.step(opt)
            scaler.update()
            if poison:
                assert scaler.get_scale() == 512.0, f"{type(model.ebc).__name__}: not skipped"
                for k, v in model.ebc.state_dict().items():
                    assert torch.equal(v, rows_before[k]), f"{k} moved in a skipped step"
        assert _max_diff(ours, ref) <= TOL, f"step {step}"


# -- clipping ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", list(TORCH_OPTIMIZERS))
def test_clip_grad_norm_counts_and_clips_the_rows(name: str, cache: str) -> None:
    ref, ours = _pair(cache)
    opts = [TORCH_OPTIMIZERS[name](m.parameters()) for m in (ref, ours)]
    for kjt in _batches():
        norms = []
        for model, opt in zip((ref, ours), opts, strict=True):
            opt.zero_grad()
            model(kjt).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
            opt.step()
        assert norms[1] == pytest.approx(norms[0], rel=1e-6)
        assert norms[0] > 1.0  # clipped: the rows count, and move as far as torchrec's
        assert _max_diff(ours, ref) <= TOL


@pytest.mark.parametrize("cache", list(CACHES))
def test_clip_grad_value_clamps_the_rows(cache: str) -> None:
    ref, ours = _pair(cache)
    opts = [torch.optim.Adagrad(m.parameters(), lr=0.2) for m in (ref, ours)]
    for kjt in _batches():
        for model, opt in zip((ref, ours), opts, strict=True):
            opt.zero_grad()
            model(kjt).backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
            opt.step()
        assert _max_diff(ours, ref) <= TOL


@pytest.mark.parametrize("cache", list(CACHES))
def test_accumulated_backwards_are_clipped_as_one_sum(cache: str) -> None:
    """Two backwards before a step: the norm is the summed gradient's, as torch's."""
    ref, ours = _pair(cache, accumulate_grads=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (ref, ours)]
    batches = _batches(6)
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        norms = []
        for model, opt in zip((ref, ours), opts, strict=True):
            opt.zero_grad()
            model(first).backward()
            model(second).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
            opt.step()
        assert norms[1] == pytest.approx(norms[0], rel=1e-6)
        assert _max_diff(ours, ref) <= TOL


def test_writing_the_anchors_grad_changes_what_the_step_applies() -> None:
    ref, ours = _pair("10%")
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (ref, ours)]
    for kjt in _batches(3):
        for model, opt in zip((ref, ours), opts, strict=True):
            opt.zero_grad()
            model(kjt).backward()
            for p in model.ebc.parameters():
                p.grad = p.grad * 0.5
            opt.step()
        assert _max_diff(ours, ref) <= TOL
    ours(_batches(1)[0]).backward()
    with pytest.raises(ValueError, match="shape"):
        ours.ebc.grad_anchor.grad = torch.zeros(3)


def test_a_loop_that_never_reads_grad_never_makes_the_rows_gradient() -> None:
    """The rows' gradient is made when read: a plain loop keeps the TBE step as it was."""
    ref, ours = _pair("whole")
    opts = [torch.optim.Adagrad(m.parameters(), lr=0.2) for m in (ref, ours)]
    with mock.patch.object(RowGradients, "_flat_gradient", side_effect=AssertionError("made")):
        for kjt in _batches(3):
            for model, opt in zip((ref, ours), opts, strict=True):
                opt.zero_grad()
                model(kjt).backward()
                opt.step()
    assert _max_diff(ours, ref) <= TOL


@pytest.mark.parametrize("cache", list(CACHES))
def test_the_sequence_collection_is_unscaled_and_clipped_as_torchrecs(cache: str) -> None:
    tables = [
        EmbeddingConfig(name="t0", embedding_dim=5, num_embeddings=300, feature_names=["f0"]),
        EmbeddingConfig(name="t1", embedding_dim=5, num_embeddings=250, feature_names=["f1"]),
    ]
    torch.manual_seed(0)
    ref = torchrec.EmbeddingCollection(tables=tables)
    ours = CachedEmbeddingCollection(tables, cache=CACHES[cache])
    ours.load_state_dict(ref.state_dict())
    runs = [
        (m, torch.optim.Adagrad(m.parameters(), lr=0.2), torch.amp.GradScaler("cpu"))
        for m in (ref, ours)
    ]
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        kjt = random_kjt(gen, {"f0": 300, "f1": 250}, batch_size=6)
        norms = []
        for model, opt, scaler in runs:
            opt.zero_grad()
            out = model(kjt)
            loss = sum((out[k].values() * (i + 1)).sin().sum() for i, k in enumerate(out))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
            scaler.step(opt)
            scaler.update()
        assert norms[1] == pytest.approx(norms[0], rel=1e-6)
    for k, v in ref.state_dict().items():
        assert float((ours.state_dict()[k] - v).abs().max()) <= TOL, k


# -- embcache's sparse optimizers ------------------------------------------------------------------


SPARSE = {
    "SparseSGD": (
        lambda m: embcache.SparseSGD([m], lr=0.3),
        lambda params: torch.optim.SGD(params, lr=0.3),
    ),
    "SparseAdaGrad": (
        lambda m: embcache.SparseAdaGrad([m], lr=0.2, eps=1e-10),
        lambda params: torch.optim.Adagrad(params, lr=0.2, eps=1e-10),
    ),
    "SparseRowWiseAdaGrad": (
        lambda m: embcache.SparseRowWiseAdaGrad([m], lr=0.2, eps=1e-8),
        lambda params: RowWiseAdagrad(params, lr=0.2, eps=1e-8),
    ),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", list(SPARSE))
def test_an_embcache_optimizer_steps_the_rows_clip_grad_norm_clipped(name: str, cache: str) -> None:
    sparse_of, torch_of = SPARSE[name]
    ref, ours = _pair(cache)
    ref_opts = [torch_of(ref.ebc.parameters()), torch.optim.SGD(ref.over.parameters(), lr=0.1)]
    opts = [sparse_of(ours.ebc), torch.optim.SGD(ours.over.parameters(), lr=0.1)]
    for kjt in _batches():
        norms = []
        for model, optimizers in ((ref, ref_opts), (ours, opts)):
            for opt in optimizers:
                opt.zero_grad()
            model(kjt).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
            for opt in optimizers:
                opt.step()
        assert norms[1] == pytest.approx(norms[0], rel=1e-6)
        assert _max_diff(ours, ref) <= TOL


# -- an update inside backward -------------------------------------------------------------------


IN_BACKWARD = {
    "optimizer_type": lambda cache: CachedEmbeddingBagCollection(
        table_configs(), cache=cache, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}
    ),
    "update_in_backward": lambda cache: CachedEmbeddingBagCollection(
        table_configs(), cache=cache, update_in_backward=True
    ),
}
CALLS = {
    "clip_grad_norm_": lambda model, opt, scaler: torch.nn.utils.clip_grad_norm_(
        model.parameters(), 0.1
    ),
    "clip_grad_value_": lambda model, opt, scaler: torch.nn.utils.clip_grad_value_(
        model.parameters(), 0.1
    ),
    "GradScaler": lambda model, opt, scaler: scaler.step(opt),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", list(IN_BACKWARD))
def test_an_update_inside_backward_refuses_unscaling_and_clipping(kind: str, call: str) -> None:
    ebc = IN_BACKWARD[kind](CACHES["10%"])
    if kind == "update_in_backward":
        embcache.SparseSGD([ebc], lr=0.1)
    model = Model(ebc)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    kjt = _batches(1)[0]
    scaler.scale(model(kjt)).backward()
    with pytest.raises(RuntimeError, match=re.escape(call) + ".*inside backward"):
        CALLS[call](model, opt, scaler)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_and_steps_still_run_after_an_update_inside_backward(set_to_none: bool) -> None:
    model = Model(IN_BACKWARD["optimizer_type"](CACHES["10%"]))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    for kjt in _batches(3):
        opt.zero_grad(set_to_none=set_to_none)
        model(kjt).backward()
        opt.step()
        model.zero_grad(set_to_none=set_to_none)
    assert model.ebc.grad_anchor.grad is None


# -- torchrec's DLRM ----------------------------------------------------------------------------


DENSE_IN, DIM = 5, 6


def _dlrm_pair(cache: str) -> tuple[DLRM, DLRM]:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"]
        )
        for i, rows in enumerate((120, 90, 61))
    ]
    torch.manual_seed(0)
    ref = DLRM(torchrec.EmbeddingBagCollection(tables=tables), DENSE_IN, [8, DIM], [8, 1])
    ebc = CachedEmbeddingBagCollection(tables=tables, cache=CACHES[cache])
    ours = DLRM(ebc, DENSE_IN, [8, DIM], [8, 1])
    ours.load_state_dict(ref.state_dict())  # the MLPs and the rows
    return ref, ours


@pytest.mark.parametrize("cache", list(CACHES))
def test_torchrecs_dlrm_with_grad_scaler_and_clipping_trains_as_torchrecs(cache: str) -> None:
    ref, ours = _dlrm_pair(cache)
    runs = [
        (
            m,
            torch.optim.Adagrad(m.parameters(), lr=0.1),
            torch.amp.GradScaler("cpu", init_scale=256.0),
        )
        for m in (ref, ours)
    ]
    gen = torch.Generator().manual_seed(4)
    for step in range(10):
        kjt = random_kjt(gen, {"f0": 120, "f1": 90, "f2": 61}, batch_size=16)
        dense = torch.randn(16, DENSE_IN, generator=gen)
        if step == 4:
            dense[0, 0] = float("inf")  # a NaN loss: both scalers skip the step
        labels = torch.randint(0, 2, (16,), generator=gen).float()
        norms = []
        for model, opt, scaler in runs:
            opt.zero_grad()
            logits = model(dense, kjt).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            scaler.step(opt)
            scaler.update()
        if step != 4:
            assert norms[1] == pytest.approx(norms[0], rel=1e-5), f"step {step}"
    got, want = ours.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-5, worst
    assert runs[0][2].get_scale() == runs[1][2].get_scale() < 256.0  # the skipped step


# -- the README ---------------------------------------------------------------------------------


def test_the_readmes_torchrec_examples_run_unchanged() -> None:
    """The python blocks of the README's "TorchRec" section, run in order."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    section = readme.read_text().split("\n## TorchRec\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) >= 3, "the TorchRec section lost its GradScaler example"
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(readme), "exec"), ns)
    assert ns["scaler"].get_scale() > 0 and float(ns["norm"]) > 0
