"""The plan family's group operations (`PlanOps.probe_group`, `assign_group`, `reserve_group`):
every cache of a `PlanTable` planned in one launch each, the Triton kernels (under the
interpreter on a CPU) against the plain-torch specification, cache by cache, on fresh random
indexes.

Each case builds several caches of different sets and ways (one with no ids, one with more
misses than free ways, so that both a cache whose misses all get a way and one left with
misses are reserved or left alone), runs the three steps on copies, and compares every
output and every slot key, score, lock, dirty flag and batch number afterwards.
"""

from __future__ import annotations

import copy

import pytest
import torch

from embcache.ops.plan import KEY_SHIFT, MISSES, PLACED, SCRATCH_HELD, PlanCache, PlanTable
from embcache.ops.plan.spec import set_index_ref
from embcache.ops.registry import implementations

KERNELS = implementations("plan")["triton"]
SPEC = implementations("plan")["spec"]
FIELDS = ("slot_keys", "scores", "locks", "batch_of", "dirty")


def _cache(gen: torch.Generator, c: int, sets: int, ways: int, n: int, fill: float,
           locked: float) -> PlanCache:  # fmt: skip
    """A cache of ``sets`` x ``ways`` slots (and 64 scratch rows), about ``fill`` of its ways
    holding ids, ``locked`` of its slots locked, and a batch of ``n`` distinct ids, about half
    of them held."""
    slots = sets * ways
    keys = torch.full((slots + 64,), -1, dtype=torch.int64)
    pool = torch.randperm(4 * slots + 8, generator=gen) + 100_000 * c
    for key, s in zip(pool.tolist(), set_index_ref(pool, sets).tolist(), strict=True):
        free = (keys[s * ways : (s + 1) * ways] < 0).nonzero().flatten()
        if free.numel() and torch.rand(1, generator=gen) < fill:
            keys[s * ways + free[0]] = key
    held = keys[keys >= 0]
    held = held[torch.randperm(held.numel(), generator=gen)][: n // 2]
    fresh = torch.randperm(10_000, generator=gen)[: n - held.numel()] + 50_000 + 100_000 * c
    ids = torch.cat([held, fresh])[torch.randperm(n, generator=gen)]
    # Two of the fresh ids held in scratch rows, found there before the plan (every other
    # cache): hits, counted apart and not scored.
    found = None
    if c % 2 == 0 and fresh.numel() >= 2:
        keys[slots : slots + 2] = fresh[:2]
        found = torch.full_like(ids, -1)
        for j in range(2):
            found[ids == fresh[j]] = slots + j
    return PlanCache(
        ids=ids.contiguous(),
        slot_keys=keys,
        scores=torch.where(keys[:slots] >= 0, torch.randint(0, 40, (slots,), generator=gen), -1),
        locks=(torch.rand(slots + 64, generator=gen) < locked).to(torch.int32),
        batch_of=torch.randint(0, 4, (slots + 64,), generator=gen),
        dirty=torch.rand(slots + 64, generator=gen) < 0.5,
        num_sets=sets,
        ways=ways,
        batch_seq=3,
        tick=17 + c,
        num_slots=slots,
        found=found,
    )


def _on(parts: list[PlanCache], device: torch.device | str) -> list[PlanCache]:
    moved = copy.deepcopy(parts)
    for part in moved:
        part.ids = part.ids.to(device)
        part.found = None if part.found is None else part.found.to(device)
        for name in FIELDS:
            setattr(part, name, getattr(part, name).to(device))
    return moved


# Caches of (sets, ways, ids, fill, locked): a roomy one, one with no ids, a crowded one whose
# sets run out of free ways, one way a set, and one of 16 ways.
LAYOUTS = [
    [(32, 4, 40, 0.5, 0.1), (8, 2, 0, 0.5, 0.1), (4, 4, 60, 0.9, 0.3)],
    [(16, 1, 9, 0.5, 0.0), (64, 16, 300, 0.6, 0.05)],
    [(50, 8, 120, 0.3, 0.0), (7, 4, 5, 0.2, 0.0), (128, 2, 200, 0.7, 0.1), (3, 4, 30, 1.0, 0.5)],
]


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("seed", [0, 1])
def test_group_plan_matches_the_specification(layout: int, seed: int, device) -> None:
    gen = torch.Generator().manual_seed(10 * layout + seed)
    parts = [_cache(gen, c, *shape) for c, shape in enumerate(LAYOUTS[layout])]
    mine, spec = _on(parts, device), _on(parts, "cpu")
    table, ref = PlanTable.of(mine), PlanTable.of(spec)
    assert table is not None and ref is not None

    probe, want = KERNELS.probe_group(table), SPEC.probe_group(ref)
    for name, got, expected in zip(want._fields, probe, want, strict=True):
        assert torch.equal(got.cpu(), expected), name
    m = int(want.counts[:, MISSES].sum())
    assert int(want.counts[:, SCRATCH_HELD].sum()) > 0, "no id was found in a scratch row"
    # The hits sort last; every cache's misses come cache by cache.
    assert int((want.keys >= ref.total_sets << KEY_SHIFT).sum()) == ref.total - m

    keys, order = torch.sort(probe.keys, stable=True)
    want_keys, want_order = torch.sort(want.keys, stable=True)
    place = KERNELS.assign_group(table, keys, probe.counts)
    want_place = SPEC.assign_group(ref, want_keys, want.counts)
    assert torch.equal(place[:m].cpu(), want_place[:m])
    assert torch.equal(probe.counts.cpu(), want.counts)
    left = (want.counts[:, MISSES] - want.counts[:, PLACED]).tolist()
    assert 0 in left, "no cache had every miss placed"
    assert any(left), "no cache had a miss left without a way"

    # Misses left without a way take free scratch rows (rows 2 and up, past the found ones),
    # in every other such cache; the others are left alone (`PlanOps.reserve_group`).
    given = [n > 0 and c % 2 == 0 for c, n in enumerate(left)]
    for parts_now, t in ((mine, table), (spec, ref)):
        for c, part in enumerate(parts_now):
            if given[c]:
                first = part.num_slots + 2
                part.free = torch.arange(first, first + left[c], device=part.ids.device)
        t.table = PlanTable.of(parts_now).table  # type: ignore[union-attr]
    missed = (place[:m] < 0).long()
    unplaced = torch.cumsum(missed, 0) - missed
    got, expected = (KERNELS.reserve_group(table, probe, order, place, unplaced),
                     SPEC.reserve_group(ref, want, want_order, want_place))  # fmt: skip
    lo = 0
    for c, n_left in enumerate(left):
        at = slice(lo, lo + int(want.counts[c, MISSES]))
        lo = at.stop
        if n_left == 0 or given[c]:
            for name, g, e in zip(expected._fields, got, expected, strict=True):
                assert torch.equal(g[at].cpu(), e[at]), (c, name)
        else:  # left alone: planned again by its caller
            assert not got.resident[at].any() and not got.write_back[at].any()
    assert any(given), "no cache took scratch rows"
    assert torch.equal(probe.slots.cpu(), want.slots)
    for c, (a, b) in enumerate(zip(mine, spec, strict=True)):
        for name in FIELDS:
            assert torch.equal(getattr(a, name).cpu(), getattr(b, name)), (c, name)


def test_a_table_refuses_what_its_kernels_cannot_read() -> None:
    gen = torch.Generator().manual_seed(5)
    part = _cache(gen, 0, 8, 2, 6, 0.5, 0.0)
    assert PlanTable.of([]) is None
    for name, bad in [("locks", part.locks.long()), ("dirty", part.dirty.to(torch.uint8)),
                      ("scores", part.scores[:4]), ("found", part.ids[:2])]:  # fmt: skip
        broken = copy.copy(part)
        setattr(broken, name, bad)
        assert PlanTable.of([broken]) is None, name
    table = PlanTable.of([part, part])
    assert table is not None
    assert table.starts == [0, 6] and table.set_bases == [0, 8] and table.total_sets == 16
