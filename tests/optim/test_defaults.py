"""The sparse optimizers' defaults are what their docstrings say (issue 44, finding 11):
`SparseRowWiseAdaGrad` is FBGEMM's EXACT_ROWWISE_ADAGRAD with FBGEMM's default eps, bit-equal
to FBGEMM's CPU TBE over 30 steps when neither is given an eps; ``flush()`` (RecStore's call)
writes the updated rows to the tier."""

from __future__ import annotations

import inspect

import pytest
import torch
import torchrec

import embcache
from embcache.kernels.optim_rules import RULES, OptimRule
from tests.models.conftest import feature_rows, loss_of, random_kjt, table_configs

SMALL = 1e-6  # the loss's scale

fbgemm_training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")


def _fbgemm_default_eps() -> float:
    init = fbgemm_training.SplitTableBatchedEmbeddingBagsCodegen.__init__
    return inspect.signature(init).parameters["eps"].default


def test_rowwise_adagrad_defaults_to_fbgemm_eps() -> None:
    fbgemm_eps = _fbgemm_default_eps()
    signature = inspect.signature(embcache.SparseRowWiseAdaGrad.__init__)
    assert signature.parameters["eps"].default == fbgemm_eps
    assert RULES[OptimRule.ROWWISE_ADAGRAD].hyper["eps"] == fbgemm_eps


def test_rowwise_adagrad_at_defaults_is_bit_equal_to_fbgemm_over_30_steps() -> None:
    """The whole table cached (the TBE step on the CPU), lr given, eps left to each side.
    Gradients of 1e-6 or so, where eps is not lost in the root of the accumulator."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    lr = 0.1
    tables = table_configs(("sum",) * 3, dims=(8, 4))  # FBGEMM wants dims % 4 == 0
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=tables)
    tbe = fbgemm_training.SplitTableBatchedEmbeddingBagsCodegen(
        [
            (
                t.num_embeddings,
                t.embedding_dim,
                fbgemm_training.EmbeddingLocation.HOST,
                fbgemm_training.ComputeDevice.CPU,
            )
            for t in tables
        ],
        feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=lr,
        pooling_mode=PoolingMode.SUM,
    )
    initial = ref.state_dict()
    for i, t in enumerate(tables):
        tbe.split_embedding_weights()[i].copy_(initial[f"embedding_bags.{t.name}.weight"])
    m = embcache.CachedEmbeddingBagCollection(
        tables=tables, cache=embcache.CacheConfig(load_factor=1.0)
    )
    m.load_state_dict(initial)
    opt = embcache.SparseRowWiseAdaGrad([m], lr=lr)
    gen = torch.Generator().manual_seed(17)
    for _ in range(30):
        kjt = random_kjt(gen, feature_rows(tables), 8, id_pool=60)
        coeff = torch.randn(8, 28, generator=gen)
        (SMALL * loss_of(tbe(kjt.values(), kjt.offsets()), coeff)).backward()
        (SMALL * loss_of(m(kjt).values(), coeff)).backward()
        opt.step()
    weights = m.state_dict()
    for i, t in enumerate(tables):
        got = weights[f"embedding_bags.{t.name}.weight"]
        want = tbe.split_embedding_weights()[i]
        assert torch.equal(got, want), f"{t.name}: {float((got - want).abs().max())} apart"


def test_flush_writes_the_updated_rows_to_the_tier() -> None:
    """``opt.flush()``: the rows a step updated in the cache reach the tier."""
    tables = table_configs()
    store = embcache.kv.HostKV()
    m = embcache.CachedEmbeddingBagCollection(
        tables=tables, cache=embcache.CacheConfig(load_factor=0.1), store=store
    )
    opt = embcache.SparseSGD([m], lr=0.5)
    kjt = random_kjt(torch.Generator().manual_seed(2), feature_rows(tables), 4, id_pool=10)
    m(kjt).values().sum().backward()
    opt.step()
    ids = torch.unique(kjt["f3"].values())
    in_tier = store.read("t2", ids)[:, :3].clone()
    opt.flush()
    after = store.read("t2", ids)[:, :3]
    assert not torch.equal(after, in_tier), "the updated rows were still only in the cache"
    assert torch.equal(after, m.state_dict()["embedding_bags.t2.weight"][ids])
