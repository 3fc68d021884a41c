"""DLRM over the cached collection: shapes, interaction, learning, and cache-size invariance."""

from __future__ import annotations

import warnings

import pytest
import torch

import embcache
from embcache.data.synthetic import SyntheticConfig, SyntheticCriteo
from embcache.models.dlrm import DLRM, dot_interaction
from embcache.train.loop import (
    SPARSE_OPTIMIZERS,
    make_dense_optimizer,
    make_sparse_optimizer,
    train,
)

DIM = 8
# (sparse, dense) learning rates that learn visibly within 30 steps of 128 samples.
FAST_LR = {
    "sgd": (5.0, 0.5),
    "adagrad": (0.05, 0.01),
    "rowwise_adagrad": (0.05, 0.01),
    "adam": (0.02, 0.01),
    "adamw": (0.02, 0.01),
}


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one CPU thread is faster than two spin-waiting on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data() -> SyntheticCriteo:
    return SyntheticCriteo(SyntheticConfig(scale=0.001, batch_size=128, seed=1))


def _model(data: SyntheticCriteo, device: torch.device, **cache_kw) -> DLRM:
    return DLRM(
        data.tables(DIM),
        cache=embcache.CacheConfig(**cache_kw) if cache_kw else None,
        device=device,
        bottom_mlp=(16, DIM),
        top_mlp=(16,),
        seed=7,
    )


def _losses(
    data: SyntheticCriteo, device: torch.device, steps: int, optimizer: str = "adagrad", **cache_kw
) -> list[float]:
    model = _model(data, device, **cache_kw)
    sparse = make_sparse_optimizer(optimizer, model.sparse_arch, lr=0.05)
    dense = make_dense_optimizer(optimizer, model.dense_parameters(), lr=0.01)
    losses = []
    for i in range(steps):
        batch = data.batch(i).to(device)
        loss = model.loss(model(batch.dense_features, batch.sparse_features), batch.labels)
        loss.backward()
        sparse.step()
        dense.step()
        dense.zero_grad()
        losses.append(loss.item())
    return losses


def test_forward_shapes(data: SyntheticCriteo, device: torch.device) -> None:
    model = _model(data, device)
    batch = data.batch(0).to(device)
    logits = model(batch.dense_features, batch.sparse_features)
    assert logits.shape == (128,)
    assert logits.device.type == device.type
    assert bool(torch.isfinite(logits).all())
    loss = model.loss(logits, batch.labels)
    assert loss.shape == ()
    loss.backward()
    assert all(p.grad is not None for p in model.dense_parameters())
    assert model.num_sparse == 26
    # bottom: 13 -> 16 -> 8; top input: 8 + 27 * 26 / 2 = 359.
    assert model.top_mlp[0].in_features == DIM + 27 * 26 // 2


def test_dot_interaction_matches_loops() -> None:
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    sparse = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    out = dot_interaction(dense, sparse)
    assert out.shape == (3, 5 + 10)
    vectors = [dense, *sparse.unbind(1)]
    expected = [dense] + [
        (vectors[i] * vectors[j]).sum(1, keepdim=True) for i in range(5) for j in range(i + 1, 5)
    ]
    torch.testing.assert_close(out, torch.cat(expected, dim=1))


@pytest.mark.parametrize("optimizer", list(SPARSE_OPTIMIZERS))
def test_training_reduces_loss(data: SyntheticCriteo, device: torch.device, optimizer: str) -> None:
    lr, dense_lr = FAST_LR[optimizer]
    model = _model(data, device, load_factor=0.2)
    sparse = make_sparse_optimizer(optimizer, model.sparse_arch, lr=lr)
    dense = make_dense_optimizer(optimizer, model.dense_parameters(), lr=dense_lr)
    losses = []
    for i in range(30):
        batch = data.batch(i).to(device)
        loss = model.loss(model(batch.dense_features, batch.sparse_features), batch.labels)
        loss.backward()
        sparse.step()
        dense.step()
        dense.zero_grad()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.03, (optimizer, first, last)


def test_cache_size_changes_nothing(data: SyntheticCriteo, device: torch.device) -> None:
    small = _losses(data, device, 12, load_factor=0.1)
    whole = _losses(data, device, 12, load_factor=1.0)
    assert small == whole


def test_prefetch_changes_nothing(data: SyntheticCriteo, device: torch.device) -> None:
    runs = []
    for prefetch in (False, True):
        model = _model(data, device, load_factor=0.1, policy="lfu")
        sparse = make_sparse_optimizer("rowwise_adagrad", model.sparse_arch, lr=0.05)
        dense = make_dense_optimizer("rowwise_adagrad", model.dense_parameters(), lr=0.01)
        runs.append(
            train(model, data.train_batches(), sparse, dense, 8, prefetch=prefetch, progress=False)
        )
    assert runs[0].losses == runs[1].losses
    assert runs[1].io_stats is not None and runs[1].io_stats["rows_read"] > 0


def test_bottom_mlp_must_end_in_dim(data: SyntheticCriteo) -> None:
    with pytest.raises(ValueError, match="bottom MLP must end in the embedding dim 8"):
        DLRM(data.tables(DIM), bottom_mlp=(16, 4))


def test_unknown_optimizer(data: SyntheticCriteo) -> None:
    model = _model(data, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown sparse optimizer 'lamb'"):
        make_sparse_optimizer("lamb", model.sparse_arch, lr=0.1)


# -- the model API: exported, built collections, any number of dense features ------------------


def _kjt_tables(n_tables: int = 3, rows: int = 50) -> list:
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"]
        )
        for i in range(n_tables)
    ]


def _kjt(gen: torch.Generator, n_tables: int = 3, batch: int = 6, rows: int = 50):
    from torchrec import KeyedJaggedTensor

    lengths = torch.randint(0, 4, (n_tables * batch,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(n_tables)], values=values, lengths=lengths
    )


def test_dlrm_is_public() -> None:
    assert embcache.DLRM is DLRM
    assert "DLRM" in embcache.__all__


def test_a_built_collection_ours_or_torchrecs_gives_the_same_model() -> None:
    """DLRM over a collection built beforehand: ours, and torchrec's EmbeddingBagCollection
    holding the same weights, give the same logits and gradients as DLRM built from configs."""
    from torchrec import EmbeddingBagCollection

    tables = _kjt_tables()
    from_configs = DLRM(tables, dense_in_features=3, bottom_mlp=(8, DIM), top_mlp=(8,), seed=3)
    ours = embcache.CachedEmbeddingBagCollection(tables=tables, seed=3)
    theirs = EmbeddingBagCollection(tables=tables)
    theirs.load_state_dict(ours.state_dict())
    models = [
        from_configs,
        DLRM(ours, dense_in_features=3, bottom_mlp=(8, DIM), top_mlp=(8,), seed=3),
        DLRM(theirs, dense_in_features=3, bottom_mlp=(8, DIM), top_mlp=(8,), seed=3),
    ]
    gen = torch.Generator().manual_seed(0)
    kjt, dense = _kjt(gen), torch.randn(6, 3, generator=gen)
    logits = [m(dense, kjt) for m in models]
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0])
    grads = []
    for m, out in zip(models, logits, strict=True):
        out.sum().backward()
        grads.append([p.grad for p in m.dense_parameters()])
    for other in grads[1:]:
        for a, b in zip(other, grads[0], strict=True):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match=r"built collection and \['cache'\]"):
        DLRM(ours, cache=embcache.CacheConfig(), dense_in_features=3, bottom_mlp=(8, DIM))
    with pytest.raises(TypeError, match="cannot tell the output features"):
        DLRM(torch.nn.Linear(2, 2), dense_in_features=3, bottom_mlp=(8, DIM))


@pytest.mark.parametrize("dense_features", [0, 1, 13], ids=lambda n: f"dense{n}")
def test_any_number_of_dense_features_without_warnings(dense_features: int) -> None:
    tables = _kjt_tables()
    bottom = (8, DIM) if dense_features else ()
    gen = torch.Generator().manual_seed(dense_features)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. nn.Linear(0, ...): "Initializing zero-element"
        model = DLRM(tables, dense_in_features=dense_features, bottom_mlp=bottom, top_mlp=(8,))
        kjt = _kjt(gen)
        dense = torch.randn(6, dense_features, generator=gen)
        logits = model(dense, kjt)
        model.loss(logits, torch.ones(6)).backward()
    assert logits.shape == (6,)
    assert all(p.grad is not None for p in model.dense_parameters())
    pairs = 3 * 2 // 2 if not dense_features else DIM + 4 * 3 // 2
    assert model.top_mlp[0].in_features == pairs
    assert (model.bottom_mlp is None) == (dense_features == 0)
    if not dense_features:
        with torch.no_grad():
            torch.testing.assert_close(model(None, kjt), logits.detach())


def test_bad_model_options_are_refused() -> None:
    tables = _kjt_tables()
    with pytest.raises(ValueError, match="no dense features: there is no bottom MLP"):
        DLRM(tables, dense_in_features=0, bottom_mlp=(8, DIM))
    with pytest.raises(ValueError, match="dense_in_features must be >= 0"):
        DLRM(tables, dense_in_features=-1)
    with pytest.raises(ValueError, match="two vectors per sample"):
        DLRM(tables[:1], dense_in_features=0, bottom_mlp=())
    mixed = [
        {"name": f"t{i}", "embedding_dim": dim, "num_embeddings": 50, "feature_names": [f"f{i}"]}
        for i, dim in enumerate((DIM, DIM, DIM + 1))
    ]
    with pytest.raises(ValueError, match="one embedding dim across tables"):
        DLRM(mixed, bottom_mlp=(8, DIM))
