"""Shared helpers of the model and optimizer tests: table layouts, random KJTs, torchrec
references and a verbose float64 comparison.

The layouts mix what a collection must handle at once: two tables of one dim sharing a cache
(their fused ids differ only in the table prefix), a table of another dim (a second cache), a
table looked up by two features, non-power-of-two dims, and row counts of a few hundred so that
a 1% cache holds a handful of rows and every batch overflows it.
"""

from __future__ import annotations

import copy

import torch
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import embcache

RTOL, ATOL = 1e-5, 1e-6  # float32 rounding of a few chained ops

POOLINGS = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


def table_configs(
    poolings: tuple[str, str, str] = ("sum", "mean", "sum"),
    dims: tuple[int, int] = (6, 3),
) -> list[EmbeddingBagConfig]:
    """t0 (dims[0], 300 rows, features f0 and f1), t1 (dims[0], 250 rows, f2), t2 (dims[1], 200
    rows, f3): t0 and t1 share a cache, t2 has its own."""
    p0, p1, p2 = (POOLINGS[p] for p in poolings)
    return [
        EmbeddingBagConfig(
            name="t0",
            embedding_dim=dims[0],
            num_embeddings=300,
            feature_names=["f0", "f1"],
            pooling=p0,
        ),
        EmbeddingBagConfig(
            name="t1", embedding_dim=dims[0], num_embeddings=250, feature_names=["f2"], pooling=p1
        ),
        EmbeddingBagConfig(
            name="t2", embedding_dim=dims[1], num_embeddings=200, feature_names=["f3"], pooling=p2
        ),
    ]


def feature_rows(tables: list[EmbeddingBagConfig]) -> dict[str, int]:
    """Rows of the table each feature looks up, in torchrec's output order."""
    return {f: t.num_embeddings for t in tables for f in t.feature_names}


def random_kjt(
    gen: torch.Generator,
    rows: dict[str, int],
    batch_size: int,
    max_len: int = 6,
    weighted: bool = False,
    id_pool: int | None = None,
) -> KeyedJaggedTensor:
    """A KJT with keys ``rows`` (feature -> table rows) and ``batch_size`` bags per key.

    Every batch has an empty bag (the first feature's first bag), duplicate ids (value 1 of a
    feature repeats value 0), the table's last row (value 2 of a feature) and, with
    ``batch_size > 1``, bags of varied lengths. ``id_pool`` draws the other ids from the first
    ``id_pool`` rows (more reuse across batches).
    """
    lengths, values, weights = [], [], []
    for i, n in enumerate(rows.values()):
        ln = torch.randint(0, max_len + 1, (batch_size,), generator=gen)
        if batch_size == 1:
            ln[0] = 0 if i == 0 else max(int(ln[0]), 3)
        else:
            ln[0] = 0 if i == 0 else ln[0]
            ln[-1] = max(int(ln[-1]), 3)
        total = int(ln.sum())
        v = torch.randint(0, min(n, id_pool or n), (total,), generator=gen)
        if total >= 3:
            v[1] = v[0]
            v[2] = n - 1
        lengths.append(ln)
        values.append(v)
        weights.append(torch.rand(total, generator=gen) * 2.0 - 0.5)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(rows),
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weighted else None,
    )


def torchrec_reference(
    tables: list[EmbeddingBagConfig], weighted: bool, seed: int = 0, scale: float = 0.3
) -> torchrec.EmbeddingBagCollection:
    """A torchrec EBC with random weights (``scale * randn``) whose gradients are sparse.

    torchrec builds its ``nn.EmbeddingBag`` modules with ``sparse=False``: its gradients are
    dense tables, which ``torch.optim.SparseAdam`` refuses and on which dense Adam would move
    rows a batch never touched. The bags read ``self.sparse`` at every forward, so turning it on
    gives the sparse gradients torch's sparse optimizer paths (SGD, Adagrad, SparseAdam) expect.
    """
    ref = torchrec.EmbeddingBagCollection(
        tables=tables, is_weighted=weighted, device=torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for bag in ref.embedding_bags.values():
            bag.weight.copy_(torch.randn(bag.weight.shape, generator=gen) * scale)
            bag.sparse = True
    return ref


def cached_copy(
    ref: torchrec.EmbeddingBagCollection,
    tables: list[EmbeddingBagConfig],
    weighted: bool,
    cache: embcache.CacheConfig | None = None,
    **kwargs,
) -> embcache.CachedEmbeddingBagCollection:
    """A cached collection holding ``ref``'s weights (through ``load_state_dict``)."""
    m = embcache.CachedEmbeddingBagCollection(
        tables=copy.deepcopy(tables),
        is_weighted=weighted,
        cache=cache,
        store=embcache.HostKV(),
        **kwargs,
    )
    result = m.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    return m


def loss_of(values: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient depends on the pooled values (so on the current weights)."""
    return (values * coeff).sum() + 0.5 * values.square().sum()


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL, atol: float = ATOL
) -> None:
    """allclose in float64, with the count of mismatches and the worst element in the message."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    err = (actual - expected).abs() - rtol * expected.abs()
    if not bool((err <= atol).all()):
        i = int(torch.nan_to_num(err, nan=float("inf")).argmax())
        raise AssertionError(
            f"{what}: {int((~(err <= atol)).sum())} of {err.numel()} elements differ; worst at "
            f"flat {i}: {actual.flatten()[i].item()!r} vs {expected.flatten()[i].item()!r}"
        )


def assert_state_dicts_close(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), (
        f"{what}: keys {sorted(actual)} vs {sorted(expected)}"
    )
    for key in expected:
        assert_close(actual[key], expected[key], f"{what}: {key}")


def assert_state_dicts_equal(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), (
        f"{what}: keys {sorted(actual)} vs {sorted(expected)}"
    )
    for key in expected:
        same = torch.equal(actual[key], expected[key])
        assert same, f"{what}: {key} changed (max diff {(actual[key] - expected[key]).abs().max()})"


def locked_slots(m: embcache.CachedEmbeddingBagCollection) -> list[int]:
    return [c.locked_slots() for c in m.caches()]
