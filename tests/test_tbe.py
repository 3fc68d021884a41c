"""`embcache.tbe.CachedTBE` against FBGEMM's CPU TBE (issue 44, finding 12): the same
constructor arguments and call shape; given FBGEMM's initial weights, the same outputs and
updated rows after a few training steps, bit for bit for SUM pooling (MEAN to float32
rounding), with features in another order than their tables (feature_table_map), per-sample
weights, a cache holding part of a table, and each optimizer FBGEMM's CPU TBE has.

A table looked up by two features is checked against a float64 dense reference (torch's
embedding_bag and optimizer) instead: FBGEMM's CPU TBE (fbgemm-gpu-cpu 1.8) gets AdaGrad wrong
there (0.2 off the reference after three steps) and fails in row-wise AdaGrad's backward ("num
of rows processed by adagrad: 0 does not match c_block size")."""

from __future__ import annotations

import pytest
import torch

fbgemm = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    EmbeddingLocation,
    PoolingMode,
)

from embcache.tbe import CachedTBE  # noqa: E402

CPU = fbgemm.ComputeDevice.CPU
SPECS = [
    (97, 8, EmbeddingLocation.HOST, CPU),
    (40, 12, EmbeddingLocation.HOST, CPU),
    (23, 4, EmbeddingLocation.HOST, CPU),
]
FEATURE_TABLE_MAP = [1, 2, 0]  # each table once, not in table order
SHARED_MAP = [1, 0, 1, 2]  # table 1 looked up by features 0 and 2
B = 5


def _batch(step: int, weighted: bool, fmap: list[int] = FEATURE_TABLE_MAP):
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(fmap) * B,), generator=gen)
    lengths[0] = 0  # an empty bag
    ids = []
    for j, t in enumerate(fmap):
        n = int(lengths[j * B : (j + 1) * B].sum())
        v = torch.randint(0, SPECS[t][0], (n,), generator=gen)
        if n >= 3:
            v[1], v[2] = v[0], SPECS[t][0] - 1  # a duplicate, the last row
        ids.append(v)
    indices = torch.cat(ids)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    weights = torch.rand(indices.numel(), generator=gen) + 0.5 if weighted else None
    return indices, offsets, weights


@pytest.mark.parametrize(
    "optimizer",
    [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD],
    ids=["sgd", "adagrad", "rowwise_adagrad"],
)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("cached", [False, True], ids=["whole", "load_factor_0.3"])
def test_cached_tbe_trains_as_fbgemms_cpu_tbe(optimizer, weighted, cached):
    specs = SPECS
    if cached:  # FBGEMM caches only on a GPU; its CPU TBE holds table 0 whole
        specs = [(97, 8, EmbeddingLocation.MANAGED_CACHING, CPU), *SPECS[1:]]
    # FBGEMM's CPU row-wise AdaGrad fails in backward when features are not in table order.
    fmap = [0, 1, 2] if optimizer is EmbOptimType.EXACT_ROWWISE_ADAGRAD else FEATURE_TABLE_MAP
    kwargs = dict(
        feature_table_map=fmap,
        optimizer=optimizer,
        learning_rate=0.1,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    ref = fbgemm.SplitTableBatchedEmbeddingBagsCodegen(embedding_specs=SPECS, **kwargs)
    ours = CachedTBE(embedding_specs=specs, cache_load_factor=0.3, device="cpu", **kwargs)
    ours.load_split_embedding_weights(ref.split_embedding_weights())
    if cached:
        assert ours.collection.engines.engine_of("t0").cache.num_slots < 97
    for step in range(4):
        indices, offsets, weights = _batch(step, weighted, fmap)
        want = ref(indices, offsets, weights)
        got = ours(indices, offsets, weights)
        assert got.shape == want.shape == (B, 12 + 4 + 8)
        assert torch.equal(got, want), f"step {step} output"
        coeff = torch.randn(want.shape, generator=torch.Generator().manual_seed(100 + step))
        (want * coeff).sum().backward()
        (got * coeff).sum().backward()
    for i, (g, w) in enumerate(zip(ours.split_embedding_weights(), ref.split_embedding_weights(),
                                   strict=True)):  # fmt: skip
        assert torch.equal(g, w), f"table {i}"


@pytest.mark.parametrize(
    "optimizer, torch_class",
    [(EmbOptimType.EXACT_SGD, torch.optim.SGD), (EmbOptimType.EXACT_ADAGRAD, torch.optim.Adagrad)],
    ids=["sgd", "adagrad"],
)  # fmt: skip
def test_a_table_of_two_features_trains_as_the_dense_reference(optimizer, torch_class):
    ours = CachedTBE(embedding_specs=SPECS, feature_table_map=SHARED_MAP, optimizer=optimizer,
                     learning_rate=0.1, eps=1e-8, device="cpu")  # fmt: skip
    dense = [w.double().requires_grad_() for w in ours.split_embedding_weights()]
    extra = {"eps": 1e-8} if torch_class is torch.optim.Adagrad else {}
    opt = torch_class(dense, lr=0.1, **extra)
    for step in range(3):
        indices, offsets, _ = _batch(step, False, SHARED_MAP)
        got = ours(indices, offsets)
        outs = []
        for j, t in enumerate(SHARED_MAP):
            o = offsets[j * B : (j + 1) * B + 1]
            bags = indices[o[0] : o[-1]]
            outs.append(
                torch.nn.functional.embedding_bag(bags, dense[t], o[:-1] - o[0], mode="sum")
            )
        want = torch.cat(outs, 1)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
        coeff = torch.randn(got.shape, generator=torch.Generator().manual_seed(100 + step))
        (got * coeff).sum().backward()
        (want * coeff.double()).sum().backward()
        opt.step()
        opt.zero_grad()
    for g, w in zip(ours.split_embedding_weights(), dense, strict=True):
        torch.testing.assert_close(g.double(), w.detach(), rtol=1e-6, atol=1e-7)


def test_mean_pooling_matches_to_float32_rounding():
    kwargs = dict(feature_table_map=FEATURE_TABLE_MAP, optimizer=EmbOptimType.EXACT_SGD,
                  learning_rate=0.1, pooling_mode=PoolingMode.MEAN)  # fmt: skip
    ref = fbgemm.SplitTableBatchedEmbeddingBagsCodegen(embedding_specs=SPECS, **kwargs)
    ours = CachedTBE(embedding_specs=SPECS, device="cpu", **kwargs)
    ours.load_split_embedding_weights(ref.split_embedding_weights())
    for step in range(3):
        indices, offsets, _ = _batch(step, False)
        want, got = ref(indices, offsets), ours(indices, offsets)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        want.sum().backward()
        got.sum().backward()
    for g, w in zip(ours.split_embedding_weights(), ref.split_embedding_weights(), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"feature_table_map": [0, 3]}, ValueError, "feature_table_map entry 3"),
        ({"feature_table_map": [0]}, ValueError, "table 1 is looked up by no feature"),
        ({"pooling_mode": PoolingMode.NONE}, ValueError, "pooling_mode NONE"),
        ({"optimizer": EmbOptimType.LAMB}, ValueError, "optimizer"),
        ({"stochastic_rounding": True}, TypeError, "stochastic_rounding= is not supported"),
    ],
    ids=["map_range", "unused_table", "pooling", "optimizer", "option"],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, words):
    with pytest.raises(error, match=words):
        CachedTBE(embedding_specs=SPECS[:2], device="cpu", **kwargs)
