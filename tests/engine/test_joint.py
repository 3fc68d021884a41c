"""`engine.joint`: a collection's caches deduplicated together on the device path.

A collection of three dims (three caches) whose batches list their keys in another order than
the caches' features, with a table shared by two features, a cache of two tables and two
pooling modes (its values cut between lookups), per-sample weights or none: the device path
(Triton under the interpreter) trains as the torch twins do, step by step, reading the host
once in its forward; a bad id or length raises before any cache changes.
"""

from __future__ import annotations

import pytest
import torch

import embcache
from tests.sync_count import SyncCounter

KEYS = ["fe", "fc", "fa", "fd", "fb"]  # the batch's order; the caches group them by dim
ROWS = 40


def _collection(
    weighted: bool, load_factor: float = 0.5
) -> tuple[embcache.CachedEmbeddingBagCollection, object]:
    # Pooling modes that take weights when weighted; MAX beside SUM in the dim-8 cache when not.
    second = "mean" if weighted else "max"
    tables = [
        embcache.TableConfig(name="t0", embedding_dim=8, num_embeddings=ROWS,
                             feature_names=["fa", "fb"]),
        embcache.TableConfig(name="t1", embedding_dim=16, num_embeddings=ROWS,
                             feature_names=["fc"], pooling="mean"),
        embcache.TableConfig(name="t2", embedding_dim=8, num_embeddings=ROWS,
                             feature_names=["fd"], pooling=second),
        embcache.TableConfig(name="t3", embedding_dim=24, num_embeddings=ROWS,
                             feature_names=["fe"]),
    ]  # fmt: skip
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=tables,
        is_weighted=weighted,
        cache=embcache.CacheConfig(load_factor=load_factor, ways=4),
        seed=0,
    )
    return ebc, embcache.SparseAdaGrad([ebc], lr=0.1)


def _batch(gen: torch.Generator, weighted: bool, keys: list[str] = KEYS) -> embcache.JaggedBatch:
    lengths = torch.randint(0, 5, (len(keys) * 6,), generator=gen)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return embcache.JaggedBatch.from_lengths(keys, values, lengths, weights)


def _run(monkeypatch, backend: str, weighted: bool, steps: int = 4) -> list[torch.Tensor]:
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    ebc, opt = _collection(weighted)
    gen = torch.Generator().manual_seed(3)
    outs = []
    for _ in range(steps):
        out = ebc(_batch(gen, weighted)).values()
        (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
        opt.step()
        outs.append(out.detach())
    with torch.no_grad():  # every row after the steps
        every = torch.arange(ROWS).repeat(len(KEYS))
        ones = torch.ones_like(every, dtype=torch.float32) if weighted else None
        last = embcache.JaggedBatch.from_lengths(KEYS, every, torch.ones_like(every), ones)
        outs.append(ebc(last).values())
    return outs


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_the_joint_dedup_trains_as_the_twins(monkeypatch, weighted: bool) -> None:
    want = _run(monkeypatch, "torch", weighted)
    got = _run(monkeypatch, "triton", weighted)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=f"step {step}")


def test_the_forward_reads_the_host_once(monkeypatch) -> None:
    """Three caches holding their whole tables, keys in another order: one read (without the
    joint dedup, the per-key counts are read first to cut the batch)."""
    monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    ebc, opt = _collection(weighted=False, load_factor=1.0)
    gen = torch.Generator().manual_seed(0)
    ebc(_batch(gen, False)).values().sum().backward()
    opt.step()
    batch = _batch(gen, False)
    with SyncCounter() as forward:
        out = ebc(batch).values()
    assert forward.total == 1
    out.sum().backward()
    opt.step()


def _snapshot(ebc) -> list[torch.Tensor]:
    return [t.clone() for c in ebc.caches() for t in (c.weights, c.slot_keys, c.locks, c.dirty)]


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        ("id", r"feature 'fd' \(table 't2'\): id 40 out of range \[0, 40\)"),
        ("negative", "lengths must be >= 0"),
        ("sum", "lengths sum to"),
    ],
)
def test_a_bad_batch_changes_nothing(monkeypatch, spoil: str, message: str) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    ebc, opt = _collection(weighted=False)
    gen = torch.Generator().manual_seed(1)
    ebc(_batch(gen, False)).values().sum().backward()
    opt.step()
    lengths = torch.full((len(KEYS) * 3,), 2)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    if spoil == "id":
        values[3 * 3 * 2 + 1] = ROWS  # a value of "fd", the batch's fourth key
    elif spoil == "negative":
        lengths[4], lengths[5] = -1, 5  # same total
    else:
        values = values[:-1]
    before = _snapshot(ebc)
    with pytest.raises(ValueError, match=message):
        ebc(embcache.JaggedBatch.from_lengths(KEYS, values, lengths))
    after = _snapshot(ebc)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    ebc(_batch(gen, False)).values().sum().backward()  # training goes on
    opt.step()


def test_a_batch_with_other_keys_takes_the_cutting_path(monkeypatch) -> None:
    """A key no table reads: the joint dedup does not apply (the values are cut on the host,
    the extra key's left out), and the output is the one without it."""
    monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    ebc, _ = _collection(weighted=False)
    gen = torch.Generator().manual_seed(2)
    batch = _batch(gen, False)
    with torch.no_grad():
        want = ebc(batch).values()
        extra = torch.tensor([1, 2, 3])
        lengths = torch.cat([batch.lengths(), torch.tensor([1, 0, 2, 0, 0, 0])])
        wider = embcache.JaggedBatch.from_lengths(
            [*KEYS, "unused"], torch.cat([batch.values(), extra]), lengths
        )
        got = ebc(wider).values()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_empty_bags_and_an_empty_batch(monkeypatch) -> None:
    """Every bag empty (no values at all), then a batch of no samples: zero rows out, as the
    twins give, and training goes on."""
    monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    ebc, opt = _collection(weighted=False)
    for samples in (3, 0):
        lengths = torch.zeros(len(KEYS) * samples, dtype=torch.int64)
        batch = embcache.JaggedBatch.from_lengths(KEYS, torch.empty(0, dtype=torch.int64), lengths)
        out = ebc(batch).values()
        assert out.shape == (samples, 8 * 3 + 16 + 24)
        assert torch.equal(out, torch.zeros_like(out))
    gen = torch.Generator().manual_seed(4)
    ebc(_batch(gen, False)).values().sum().backward()
    opt.step()
