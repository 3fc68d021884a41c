"""Host syncs of a training step on the device path, exact, and the refusals the step's one
read still makes before anything changes (issue 42).

The device path is counted on the CPU (``EMBCACHE_BACKEND=triton``, Triton's interpreter, which
takes the GPU's branches: no CPU-only check in `fuse_ids`, no grouped dedup for the twins'
backward), with `tests.sync_count.SyncCounter`. A step reads once: the gradients' finite check
and the unlocks' lock check together (`EngineGroup.apply`); the backward reads nothing (each
cache's table bounds came with the forward's dedup read, `dedup_together`); the forward reads,
in one read, every cache's number of unique ids, their table bounds and the id checks of
`fuse_ids_deferred`, with the batch's length checks folded in (`checked_batch` with
``read_lengths=False``). Several caches (distinct dims) are deduplicated together
(`engine.joint`): the same read brings the batch's per-key counts, which cut the values between
them. A resolve with misses adds its own reads (`cache.lockstep`), the same for any number of
caches.
"""

from __future__ import annotations

import pytest
import torch

import embcache
from tests.launch_count import counted_collection
from tests.sync_count import SyncCounter

WHOLE_TABLE = {"forward": 1, "backward": 0, "step": 1}
# A tenth of 10,000-row tables: the batch's misses take free or evicted ways. The resolve reads
# twice: the numbers of misses and victims together (an LRU plan places its misses before it
# reads, `SetPlanner._choose_ways_ahead`), then the ids the tier must read and write.
TENTH = {"forward": 3, "backward": 0, "step": 1}
# A tenth of 1,000-row tables: sets overflow into the scratch area, which the next resolve
# releases first (one read more: its counts and the ids to write in one copy,
# `ScratchArea._release_read`).
TENTH_OVERFLOW = {"forward": 4, "backward": 0, "step": 1}


def _counts(num_tables: int, num_dims: int, load_factor: float, rows: int = 1000) -> dict[str, int]:
    """Syncs of the 4th step of `counted_collection`, as `benchmarks/device_counts.py` runs
    it: the cache filled, with hits, misses and victims at 10%."""
    ebc, opt, batch = counted_collection(num_tables, num_dims, load_factor, rows)
    gen = torch.Generator().manual_seed(0)
    for samples in (1, 16, 7):
        ebc(batch(samples, gen)).values().sum().backward()
        opt.step()
    counted = batch(33, gen)
    with SyncCounter() as forward:
        out = ebc(counted).values()
    with SyncCounter() as backward:
        out.sum().backward()
    with SyncCounter() as step:
        opt.step()
    return {"forward": forward.total, "backward": backward.total, "step": step.total}


@pytest.mark.filterwarnings("ignore::embcache.CacheOverflowWarning")
@pytest.mark.parametrize(
    ("num_tables", "num_dims", "load_factor", "rows", "expected"),
    [
        pytest.param(2, 1, 1.0, 1000, WHOLE_TABLE, id="2x1-whole"),
        pytest.param(8, 1, 1.0, 1000, WHOLE_TABLE, id="8x1-whole"),
        pytest.param(6, 3, 1.0, 1000, WHOLE_TABLE, id="6x3-whole"),
        pytest.param(2, 1, 0.1, 10_000, TENTH, id="2x1-10pct"),
        pytest.param(8, 1, 0.1, 10_000, TENTH, id="8x1-10pct"),
        pytest.param(6, 3, 0.1, 10_000, TENTH, id="6x3-10pct"),
        pytest.param(2, 1, 0.1, 1000, TENTH_OVERFLOW, id="2x1-10pct-overflow"),
    ],
)
def test_device_path_syncs_per_step(
    monkeypatch: pytest.MonkeyPatch,
    num_tables: int,
    num_dims: int,
    load_factor: float,
    rows: int,
    expected: dict[str, int],
) -> None:
    """Exact counts, flat in the tables and the dims."""
    monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    assert _counts(num_tables, num_dims, load_factor, rows) == expected


@pytest.mark.filterwarnings("ignore::embcache.CacheOverflowWarning")
@pytest.mark.parametrize("load_factor", [1.0, 0.1], ids=["whole", "10pct"])
def test_step_and_backward_syncs_on_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, load_factor: float
) -> None:
    """The torch twins on a CPU (the compiled CPU kernels read their arrays through
    ``numpy()``, which syncs nothing): one read a step, and one in the backward, for 1 and
    3 dims. (The backward's read is the CPU's: its grouped dedup, for the twins' one-pass
    backward, sizes its outputs by data-dependent ops, one cache at a time, that no read of
    the table bounds can ride along.)"""
    monkeypatch.setenv("EMBCACHE_BACKEND", "torch")
    for num_dims in (1, 3):
        counts = _counts(6, num_dims, load_factor)
        assert (counts["backward"], counts["step"]) == (1, 1), (num_dims, counts)


# -- refusals made by the step's one read, before anything changes --------------------------


def _snapshot(ebc: embcache.CachedEmbeddingBagCollection) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for cache in ebc.caches():
        state = cache.state
        out.append(
            (
                cache.weights.clone(),
                state.clone() if isinstance(state, torch.Tensor) else torch.empty(0),
                cache.locks.clone(),
                cache.dirty.clone(),
            )
        )
    return out


def _assert_same(before: list, after: list) -> None:
    for b, a in zip(before, after, strict=True):
        for x, y in zip(b, a, strict=True):
            assert torch.equal(x, y)


def _collection(num_dims: int, accumulate_grads: bool = False):
    tables = [
        embcache.TableConfig(
            name=f"t{i}",
            embedding_dim=8 * (1 + i % num_dims),
            num_embeddings=100,
            feature_names=[f"f{i}"],
        )
        for i in range(2 * num_dims)
    ]
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=tables,
        cache=embcache.CacheConfig(load_factor=0.5, ways=4),
        accumulate_grads=accumulate_grads,
    )
    keys = [f"f{i}" for i in range(len(tables))]
    gen = torch.Generator().manual_seed(1)

    def batch() -> embcache.JaggedBatch:
        lengths = torch.randint(1, 4, (len(keys) * 8,), generator=gen)
        values = torch.randint(0, 100, (int(lengths.sum()),), generator=gen)
        return embcache.JaggedBatch.from_lengths(keys, values, lengths)

    return ebc, batch


def _backward(ebc, features, bad: float | None = None) -> None:
    out = ebc(features).values()
    grad = torch.ones_like(out)
    if bad is not None:
        grad[-1, -1] = bad
    out.backward(grad)


BACKENDS = pytest.mark.parametrize("backend", ["default", "triton"])


@BACKENDS
@pytest.mark.parametrize("num_dims", [1, 2])
@pytest.mark.parametrize("accumulate", [False, True], ids=["one-backward", "accumulated"])
def test_a_nan_gradient_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, backend: str, num_dims: int, accumulate: bool
) -> None:
    """A NaN gradient read with the lock check: ValueError naming a table, rows, state, locks
    and dirty flags as they were (an accumulated trace's rows, locked by the step's own
    resolve, are given back); the next good step applies."""
    if backend == "triton":
        monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    ebc, batch = _collection(num_dims, accumulate_grads=accumulate)
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    _backward(ebc, batch())
    opt.step()
    if accumulate:  # two forwards' rows: the step resolves them again
        _backward(ebc, batch())
    _backward(ebc, batch(), bad=float("nan"))
    before = _snapshot(ebc)
    with pytest.raises(ValueError, match="NaN or Inf"):
        opt.step()
    _assert_same(before, _snapshot(ebc))
    opt.zero_grad()
    assert [c.locked_slots() for c in ebc.caches()] == [0] * num_dims
    _backward(ebc, batch())
    opt.step()  # training goes on
    assert [c.locked_slots() for c in ebc.caches()] == [0] * num_dims


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_step_over_a_slot_not_locked_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """A step whose rows lost a lock (a bug elsewhere): RuntimeError from the one read, before
    any row changes or any lock drops. (The TBE step of the default CPU backend checks the
    locks in its compiled unlock pass, after its update.)"""
    monkeypatch.setenv("EMBCACHE_BACKEND", backend)
    ebc, batch = _collection(2)
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    _backward(ebc, batch())
    cache = ebc.caches()[1]
    slot = int(torch.nonzero(cache.locks > 0)[0])
    cache.unlock(torch.tensor([slot]))  # its batch's lock, taken from under it
    before = _snapshot(ebc)
    with pytest.raises(RuntimeError, match="not locked"):
        opt.step()
    _assert_same(before, _snapshot(ebc))


def test_several_modules_are_all_checked_before_any_is_applied() -> None:
    """The step of an optimizer over two collections keeps the check of every module first:
    a NaN in the second leaves the first as it was."""
    first, batch_a = _collection(1)
    second, batch_b = _collection(1)
    opt = embcache.SparseAdaGrad([first, second], lr=0.1)
    _backward(first, batch_a())
    _backward(second, batch_b(), bad=float("inf"))
    before = _snapshot(first) + _snapshot(second)
    with pytest.raises(ValueError, match="NaN or Inf"):
        opt.step()
    _assert_same(before, _snapshot(first) + _snapshot(second))


def _bad_lengths(keys: list[str], case: str) -> embcache.JaggedBatch:
    """Eight bags a feature, 2 ids each; one bag's length broken by ``case``."""
    lengths = torch.full((len(keys) * 8,), 2, dtype=torch.int64)
    if case == "negative":  # its feature's total stays positive: only a per-bag check sees it
        lengths[3], lengths[4] = -1, 5
    else:  # "short": one value more than the lengths cover
        lengths[5] = 1
    values = torch.randint(0, 100, (len(keys) * 16,), generator=torch.Generator().manual_seed(2))
    return embcache.JaggedBatch.from_lengths(keys, values, lengths)


@BACKENDS
@pytest.mark.parametrize("num_dims", [1, 2], ids=["one-cache", "two-caches"])
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("negative", "lengths must be >= 0"),
        ("short", r"lengths sum to \d+ but there are \d+ values"),
    ],
)
def test_bad_lengths_are_refused_before_anything_changes(
    monkeypatch: pytest.MonkeyPatch, backend: str, num_dims: int, case: str, message: str
) -> None:
    """A batch whose lengths are wrong: the collection's own message, nothing locked or
    changed, training goes on. On the device path with one cache the check rides the dedup's
    read (`checked_batch(read_lengths=False)`); with two, or on the CPU, it reads at once."""
    if backend == "triton":
        monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    ebc, batch = _collection(num_dims)
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    _backward(ebc, batch())
    opt.step()
    keys = [f"f{i}" for i in range(2 * num_dims)]
    before = _snapshot(ebc)
    with pytest.raises(ValueError, match=message):
        ebc(_bad_lengths(keys, case))
    _assert_same(before, _snapshot(ebc))
    assert [c.locked_slots() for c in ebc.caches()] == [0] * num_dims
    _backward(ebc, batch())
    opt.step()
    assert [c.locked_slots() for c in ebc.caches()] == [0] * num_dims


def test_a_pending_batch_checks_its_lengths_when_counts_are_read() -> None:
    """A batch checked without reading its lengths reads and checks them on the first
    `length_per_key` (so code that needs the counts never sees unchecked ones)."""
    from embcache.engine.inputs import checked_batch

    keys = ["f0", "f1"]
    pending = checked_batch(_bad_lengths(keys, "negative"), keys, False, read_lengths=False)
    assert pending.lengths_pending
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        pending.length_per_key()
    lengths = torch.tensor([1, 2, 0, 3])
    ok = checked_batch(
        embcache.JaggedBatch.from_lengths(keys, torch.arange(6), lengths), keys, False, False
    )
    with SyncCounter() as reads:
        assert ok.length_per_key() == [3, 3]
        assert ok.length_per_key() == [3, 3]  # read once
    assert reads.total == 1 and not ok.lengths_pending
