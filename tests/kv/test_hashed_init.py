"""The hashed initialisers (`kv.base.hashed_init`): every row a function of (seed, table, id,
column) alone, the same bits from the torch ops and from the compiled pass that stands in for
the uniform one on a CPU (`RowsOps.hashed_uniform`, where numba imports), checked against a
plain-Python reference."""

from __future__ import annotations

import random

import pytest
import torch

import embcache.native as native
from embcache.kv.base import hashed_init

MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser on Python ints (the reference of `embcache.hashing.mix64`)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _reference(ids: list[int], dim: int, salt: int, low: float, high: float) -> torch.Tensor:
    mid, half = (high + low) / 2.0, (high - low) / 2.0
    rows = []
    for i in ids:
        h = _mix64(i ^ salt)
        unit = [((_mix64((h + j) & MASK) >> 40) & 0xFFFFFF) * (1.0 / (1 << 24)) for j in range(dim)]
        rows.append([(2.0 * u - 1.0) * half + mid for u in unit])  # float64, as torch's ops
    return torch.tensor(rows, dtype=torch.float64).to(torch.float32).reshape(len(ids), dim)


def _salt(name: str, seed: int) -> int:
    from embcache.kv.base import table_hash

    return (seed * 1_000_003 + table_hash(name)) & 0x7FFFFFFFFFFF


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["compiled", "torch ops"])
@pytest.mark.parametrize("dim", [1, 5, 64, 129])
def test_the_uniform_init_is_the_reference_bit_for_bit(monkeypatch, backend: str, dim: int) -> None:
    """Fresh random ids (small, up to 2**62 as unbounded tables hash them, and the largest
    int64 a table takes), a random seed and bounds: each backend gives exactly the
    plain-Python reference's float32 bits."""
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    rng = random.Random()
    seed = rng.randrange(1 << 20)
    low = -rng.uniform(0.001, 1.0)
    high = rng.uniform(0.001, 1.0)
    ids = [0, 1, (1 << 62) - 1, (1 << 63) - 1] + [rng.randrange(1 << 62) for _ in range(20)]
    ids += [rng.randrange(1000) for _ in range(20)]
    init = hashed_init("table_x", seed, "uniform", low=low, high=high)
    got = init(torch.tensor(ids), dim)
    expected = _reference(ids, dim, _salt("table_x", seed), low, high)
    assert got.dtype == torch.float32 and got.shape == (len(ids), dim)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert bool(((got >= low) & (got < high)).all())


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_the_compiled_uniform_init_matches_the_torch_ops_on_many_rows(monkeypatch) -> None:
    """A few thousand fresh rows of int32 and int64 ids, each in its own order: the compiled
    pass and the torch ops agree bit for bit, and a row does not depend on its batch."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    ids = torch.randint(0, 1 << 31, (3000,), generator=gen)
    init = hashed_init("t", 7, "uniform", low=-0.05, high=0.05)
    monkeypatch.setenv("EMBCACHE_BACKEND", "torch")
    ops = init(ids, 16)
    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    for batch in (ids, ids.to(torch.int32)):
        assert torch.equal(init(batch, 16).view(torch.int32), ops.view(torch.int32))
    perm = torch.randperm(ids.numel(), generator=gen)
    assert torch.equal(init(ids[perm], 16), ops[perm])
    assert init(ids[:0], 16).shape == (0, 16)
