"""The `Backend` objects (`embcache.backend`): which family runs where, and the host operations
each family's bound implementations run (`bind(backend).ids`, ``.rows``: the torch
specification, the compiled passes, the Triton family's), on fresh random inputs, against one
plain Python reference written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embcache
import embcache.native as native
from embcache.backend import NATIVE, TORCH_CPU, TRITON, Backend, for_device
from embcache.hashing import mix64
from embcache.ops.registry import bind

FUSION_K = 12
FAMILIES = [
    pytest.param(TORCH_CPU, id="torch"),
    pytest.param(TRITON, id="triton"),
    pytest.param(
        NATIVE,
        id="native",
        marks=pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here"),
    ),
]


@pytest.mark.parametrize(
    ("env", "device", "name", "device_path", "compiled", "tbe"),
    [
        ("auto", "cpu", "native", False, None, True),  # compiled where numba imports
        ("auto", "cuda", "triton", True, False, False),
        ("torch", "cpu", "torch", False, False, False),
        ("torch", "cuda", "torch", True, False, False),
        ("triton", "cpu", "triton", True, False, False),
        ("triton", "cuda", "triton", True, False, False),
    ],
)
def test_each_choice_gives_one_family(
    monkeypatch, env: str, device: str, name: str, device_path: bool, compiled: bool | None,
    tbe: bool,
) -> None:  # fmt: skip
    monkeypatch.setenv("EMBCACHE_BACKEND", env)
    backend = for_device(torch.device(device))
    assert backend.name == name
    assert backend.device_path is device_path
    assert backend.compiled is (native.importable() if compiled is None else compiled)
    assert backend.tbe is tbe
    assert backend.triton is (name == "triton")


def test_a_cache_keeps_the_backend_it_was_built_with(monkeypatch) -> None:
    """A collection built under one choice runs it to the end: a later change of the variable
    changes none of its caches' structures (the torch plan keeps its map, the compiled one its
    bitmap), and both train to the same rows."""
    tables = [embcache.TableConfig(name="t", embedding_dim=4, num_embeddings=500,
                                   feature_names=["f"])]  # fmt: skip
    built = {}
    for name in ("auto", "torch"):
        monkeypatch.setenv("EMBCACHE_BACKEND", name)
        cfg = embcache.CacheConfig(capacity=64, ways=4)
        ebc = embcache.CachedEmbeddingBagCollection(tables=tables, cache=cfg, seed=3)
        built[name] = (ebc, embcache.SparseSGD([ebc], lr=0.5))
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        monkeypatch.setenv("EMBCACHE_BACKEND", ("torch", "auto")[step % 2])  # flipped each step
        values = torch.randint(0, 500, (300,), generator=gen)
        batch = embcache.JaggedBatch.from_lengths(["f"], values, torch.full((30,), 10))
        for ebc, opt in built.values():
            ebc(batch).values().square().sum().backward()
            opt.step()
    caches = {name: ebc.engines.engines[0].cache for name, (ebc, _) in built.items()}
    assert caches["torch"].backend.name == "torch"
    assert caches["auto"].backend.name == "native"  # FBGEMM's family, numba or not
    assert caches["auto"].backend.compiled is native.importable()
    assert caches["torch"].dedup.row_bits is None  # never the compiled bitmap
    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    rows = {name: ebc.state_dict()["embedding_bags.t.weight"] for name, (ebc, _) in built.items()}
    torch.testing.assert_close(rows["auto"], rows["torch"], rtol=1e-6, atol=1e-6)


# -- operations ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", FAMILIES)
@pytest.mark.parametrize("seed", range(4))
def test_first_bad_key(backend: Backend, seed: int) -> None:
    gen = np.random.default_rng(seed)
    limits = [int(x) for x in gen.integers(0, 40, 4)]  # a table of 0 rows among them
    n = int(gen.integers(1, 60))
    tables = gen.integers(0, 5, n)  # table 4: no such table
    raw = gen.integers(0, 45, n)
    keys = [(int(r) | (int(t) << FUSION_K)) for r, t in zip(raw, tables, strict=True)]
    if seed == 3:
        keys = [k if i % 9 else -k - 1 for i, k in enumerate(keys)]  # negative ids
    if seed == 0:
        keys = [k for k in keys if (k >> FUSION_K) < 4 and (k & 4095) < limits[k >> FUSION_K]]
        keys = keys or [0 | (int(np.argmax(limits)) << FUSION_K)]
    want = next(
        (i for i, k in enumerate(keys)
         if k < 0 or (k >> FUSION_K) >= 4 or (k & 4095) >= limits[k >> FUSION_K]),
        -1,
    )  # fmt: skip
    # The ids family's check (`IdsOps.first_bad_key`), as each backend binds it.
    got = bind(backend).ids.first_bad_key(torch.tensor(keys), FUSION_K, torch.tensor(limits))
    assert got == want


@pytest.mark.parametrize("backend", FAMILIES)
@pytest.mark.parametrize("mark_dirty", [False, True])
def test_unlock(backend: Backend, mark_dirty: bool) -> None:
    gen = torch.Generator().manual_seed(int(mark_dirty))
    locks = torch.randint(1, 4, (64,), generator=gen, dtype=torch.int32)
    dirty = torch.rand(64, generator=gen) < 0.3
    slots = torch.randperm(64, generator=gen)[:20]
    want_locks, want_dirty = locks.tolist(), dirty.tolist()
    for s in slots.tolist():
        want_locks[s] -= 1
        want_dirty[s] = want_dirty[s] or mark_dirty
    bind(backend).rows.unlock_slots(locks, slots, dirty if mark_dirty else None)
    assert locks.tolist() == want_locks
    assert dirty.tolist() == want_dirty


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_the_compiled_unlock_checks_every_lock_before_dropping_any() -> None:
    locks = torch.tensor([1, 2, 0, 1], dtype=torch.int32)
    dirty = torch.zeros(4, dtype=torch.bool)
    rows = bind(NATIVE).rows
    assert rows.unlocks_checked(torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="not locked"):
        rows.unlock_slots(locks, torch.tensor([0, 1, 2]), dirty)
    assert locks.tolist() == [1, 2, 0, 1] and not dirty.any()
    assert not bind(TORCH_CPU).rows.unlocks_checked(torch.tensor([0, 2]))  # the caller checks


@pytest.mark.parametrize("backend", FAMILIES)
@pytest.mark.parametrize("dim", [1, 5, 16])
def test_hashed_uniform(backend: Backend, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    ids = torch.randint(0, 1 << 40, (37,), generator=gen)
    salt, low, high = 987654321, -0.25, 0.75
    rows = bind(backend).rows
    got = rows.hashed_uniform(ids, salt, (low + high) / 2, (high - low) / 2, dim)
    assert got.dtype == torch.float32 and got.shape == (37, dim)
    for i, key in enumerate(ids.tolist()):
        base = int(mix64(torch.tensor([key ^ salt])))
        for c in range(dim):
            bits = (int(mix64(torch.tensor([base + c]))) >> 40) & 0xFFFFFF
            want = np.float32(low + (high - low) * (bits / (1 << 24)))
            assert got[i, c].item() == pytest.approx(float(want), abs=1e-7)
    assert rows.hashed_uniform(ids[:0], salt, 0.0, 1.0, dim).shape == (0, dim)


@pytest.mark.parametrize("backend", FAMILIES)
@pytest.mark.parametrize("ascending", [True, False])
@pytest.mark.parametrize("sorted_ids", [True, False])
def test_group_by_table(backend: Backend, ascending: bool, sorted_ids: bool) -> None:
    """Where a family groups in one pass, its groups hold each table's ids (raw, ascending when
    asked, else in their order in the batch); None leaves the caller to sort."""
    gen = torch.Generator().manual_seed(int(ascending) * 2 + int(sorted_ids))
    tables = torch.randint(0, 5, (200,), generator=gen)
    fused = torch.randint(0, 1 << FUSION_K, (200,), generator=gen) | (tables << FUSION_K)
    if sorted_ids:
        fused = fused.sort().values
    got = bind(backend).rows.group_by_table(fused, FUSION_K, ascending, 5)
    if got is None:
        assert not backend.compiled or (ascending and not sorted_ids)  # a sort is needed
        return
    counts, order, raw = got
    ordered = fused if order is None else fused[order]
    assert counts.tolist() == [int((tables == t).sum()) for t in range(5)]
    assert torch.equal(raw, ordered & ((1 << FUSION_K) - 1))
    start = 0
    for t in range(5):
        group = ordered[start : start + int(counts[t])]
        start += int(counts[t])
        assert bool(((group >> FUSION_K) == t).all())
        expected = fused[(fused >> FUSION_K) == t]  # in batch order
        assert torch.equal(group, expected.sort().values if ascending else expected)
