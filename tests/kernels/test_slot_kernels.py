"""The rows family (`embcache.ops.rows`): the device path's per-step slot work, one launch for
every cache (the lock check and the unlock) or one a cache (direct mapping's slots and locks),
its Triton implementation against its plain-torch specification on fresh random inputs.

Each case runs the Triton kernel (under the interpreter on a CPU) and the specification on
copies of the same locks and flags, and compares every element: a slot the kernel skipped or
wrote twice, a lock dropped from a slot of -1, or a flag set outside the slots shows.
"""

from __future__ import annotations

import pytest
import torch

from embcache.ops.registry import implementations
from embcache.ops.rows import INT32_MAX, SlotTable

KERNELS = implementations("rows")["triton"]
SPEC = implementations("rows")["spec"]


def _caches(gen: torch.Generator, sizes: list[tuple[int, int]], refused: float = 0.0):
    """Per cache ``(slots, locks, dirty)``: ``n`` distinct slots of a cache of ``rows`` slots,
    each locked 1 to 3 times, a fraction ``refused`` of them -1 (ids not admitted)."""
    parts = []
    for rows, n in sizes:
        slots = torch.randperm(rows, generator=gen)[:n]
        locks = torch.randint(0, 2, (rows,), generator=gen, dtype=torch.int32)
        locks[slots] += torch.randint(1, 4, (n,), generator=gen, dtype=torch.int32)
        dirty = torch.rand(rows, generator=gen) < 0.3
        if refused:
            slots[torch.rand(n, generator=gen) < refused] = -1
        parts.append((slots, locks, dirty))
    return parts


def _copies(parts, device: torch.device | str = "cpu"):
    return [(s.to(device, copy=True), lk.to(device, copy=True), d.to(device, copy=True))
            for s, lk, d in parts]  # fmt: skip


@pytest.mark.parametrize("refused", [0.0, 0.25], ids=["all-admitted", "some-refused"])
@pytest.mark.parametrize("dirty", [True, False], ids=["dirty", "clean"])
def test_unlock_matches_the_specification(
    refused: float, dirty: bool, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(int(refused * 100) + dirty)
    # Three caches: one past a block of slots, one empty, one small.
    parts = _caches(gen, [(3000, 1500), (40, 0), (64, 17)], refused)
    mine, spec = _copies(parts, device), _copies(parts)
    table, ref = SlotTable.of(mine), SlotTable.of(spec)
    assert table is not None and ref is not None
    KERNELS.unlock(table, dirty)
    SPEC.unlock(ref, dirty)
    for (_, locks, flags), (_, want_locks, want_flags), (slots, before, _) in zip(
        mine, spec, parts, strict=True
    ):
        locks, flags = locks.cpu(), flags.cpu()
        assert torch.equal(locks, want_locks)
        assert torch.equal(flags, want_flags)
        live = slots[slots >= 0]
        assert torch.equal(before[live] - locks[live], torch.ones_like(live, dtype=torch.int32))


def test_lock_floors_match_the_specification(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(7)
    parts = _caches(gen, [(5000, 2100), (30, 0), (128, 77)], refused=0.2)
    # A slot that lost its lock in cache 2: its floor is 0.
    slots2, locks2, _ = parts[2]
    locks2[slots2[slots2 >= 0][3]] = 0
    table, ref = SlotTable.of(_copies(parts, device)), SlotTable.of(parts)
    assert table is not None and ref is not None
    floors = KERNELS.lock_floors(table).cpu()
    assert torch.equal(floors, SPEC.lock_floors(ref))
    assert int(floors[1]) == INT32_MAX and int(floors[2]) == 0 and int(floors[0]) >= 1


def test_a_table_refuses_what_the_kernels_cannot_read() -> None:
    """Slots of int32, or a strided view, give no table (the caller takes the per-cache
    path) rather than a kernel reading the wrong bytes."""
    locks, dirty = torch.zeros(10, dtype=torch.int32), torch.zeros(10, dtype=torch.bool)
    assert SlotTable.of([(torch.arange(5, dtype=torch.int32), locks, dirty)]) is None
    assert SlotTable.of([(torch.arange(10)[::2], locks, dirty)]) is None
    assert SlotTable.of([]) is None
    assert SlotTable.of([(torch.arange(5), locks, dirty)]) is not None


@pytest.mark.parametrize("n", [0, 1, 1500])
def test_direct_slots_match_the_specification(n: int, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(n)
    fusion_k = 11
    rows = [300, 2000, 700]
    row_offset = torch.tensor([0, 300, 2300], dtype=torch.int64)
    tables = torch.randint(0, 3, (n,), generator=gen)
    raw = (torch.rand(n, generator=gen) * torch.tensor(rows)[tables]).long()
    keys = torch.unique((tables << fusion_k) | raw)  # distinct, as a dedup gives them
    locks = torch.randint(0, 3, (3000,), generator=gen, dtype=torch.int32)
    want_locks, on_device = locks.clone(), locks.to(device, copy=True)
    got = KERNELS.direct_slots(row_offset.to(device), keys.to(device), fusion_k, on_device).cpu()
    locks = on_device.cpu()
    want = SPEC.direct_slots(row_offset, keys, fusion_k, want_locks)
    assert torch.equal(got, want)
    assert torch.equal(locks, want_locks)
    assert torch.equal(got, row_offset[keys >> fusion_k] + (keys & ((1 << fusion_k) - 1)))
