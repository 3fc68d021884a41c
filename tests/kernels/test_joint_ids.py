"""The joint dedup (`ops.ids`): several caches' ids deduplicated in one sort, each share written
apart.

The Triton route (`sort_and_mark`, one read, `scatter_joint`) against the plain-torch
specification (`scatter_joint_ref`) on fresh random batches, and the specification against
what each group's share must be: the dedup of the group's values taken in its own feature
order. Outputs are allocated uninitialised and every compared element is inside a share, so a
position the kernel never wrote shows as garbage that differs.
"""

from __future__ import annotations

import pytest
import torch

from embcache.ops.ids.shared import ALIGN, JointPlan, JointShares
from embcache.ops.ids.shared import joint_plan as plan
from embcache.ops.ids.spec import scatter_joint_ref
from embcache.ops.ids.triton import scatter_joint, sort_and_mark

FUSION_K = 12
TABLE_BITS = 3


def _batch(
    gen: torch.Generator,
    per_key: list[int],
    key_group: list[int],
    rows: int,
    hot: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tagged keys ``(group << shift) | (table << FUSION_K) | id`` in batch order (key k on
    table k) and per-sample weights. ``hot``: one id takes most of each key's values."""
    parts = []
    for k, n in enumerate(per_key):
        ids = torch.randint(0, rows, (n,), generator=gen)
        if hot:
            ids[torch.rand(n, generator=gen) < 0.9] = rows - 1  # the table's last row
        tag = (key_group[k] << TABLE_BITS) | k
        parts.append(ids | (tag << FUSION_K))
    keys = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return keys, torch.rand(keys.numel(), generator=gen) + 0.5


def _plan(keys: torch.Tensor, per_key: list[int], group_keys: list[list[int]]) -> JointPlan:
    shift = FUSION_K + TABLE_BITS
    starts = torch.tensor([g << shift for g in range(1, len(group_keys))], dtype=torch.int64)
    ordered = torch.sort(keys)[0]
    runs = torch.unique_consecutive(ordered)
    below = torch.searchsorted(runs, starts).tolist()
    return plan(per_key, group_keys, below, runs.numel(), BAGS)


BAGS = 3  # bags a key: its values split in three (short keys leave some empty)


def _lengths(per_key: list[int]) -> torch.Tensor:
    return torch.tensor([[n // 3, n // 3, n - 2 * (n // 3)] for n in per_key]).reshape(-1)


def _triton(
    keys: torch.Tensor, per_key: list[int], group_keys: list[list[int]], weights, device
) -> tuple[JointPlan, JointShares]:
    shift = FUSION_K + TABLE_BITS
    starts = torch.tensor([g << shift for g in range(1, len(group_keys))], dtype=torch.int64)
    marked = sort_and_mark(keys.to(device), starts.to(device), None)
    read = marked.read.tolist()
    where = plan(per_key, group_keys, read[1:], read[0], BAGS)
    w = None if weights is None else weights.to(device)
    ends = torch.cumsum(_lengths(per_key), 0).to(device)
    return where, scatter_joint(
        marked.ordered, marked.order, marked.is_start, marked.seen, where, shift, w, ends
    )


CASES = {
    # per_key, each group's keys in its feature order
    "two-groups-in-order": ([7, 5, 9], [[0, 1], [2]]),
    "groups-interleaved": ([6, 0, 11, 4, 8], [[3, 0], [4, 2, 1]]),
    "three-groups-one-empty": ([5, 0, 9, 3], [[2], [1], [3, 0]]),
    "one-group-reordered": ([4, 10, 3], [[2, 0, 1]]),
    "long-key": ([1500, 2, 30], [[1], [0, 2]]),
}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("hot", [False, True], ids=["uniform", "hot-id"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_triton_route_matches_the_spec(device, case: str, hot: bool, weighted: bool) -> None:
    per_key, group_keys = CASES[case]
    key_group = [0] * len(per_key)
    for g, ks in enumerate(group_keys):
        for k in ks:
            key_group[k] = g
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    keys, weights = _batch(gen, per_key, key_group, rows=50, hot=hot)
    w = weights if weighted else None
    where, got = _triton(keys, per_key, group_keys, w, device)
    assert where == _plan(keys, per_key, group_keys)  # the read's counts are the host's
    want = scatter_joint_ref(keys, where, FUSION_K + TABLE_BITS, w, _lengths(per_key))
    names = ("unique", "inverse", "order", "starts", "weights", "offsets")
    for g in range(len(group_keys)):
        assert where.ubase[g] % ALIGN == 0 and where.vbase[g] % ALIGN == 0
        assert where.obase[g] % ALIGN == 0
        mine, spec = got.group(where, g), want.group(where, g)
        for name in names:
            a, b = getattr(mine, name), getattr(spec, name)
            if b is None:
                assert a is None, name
                continue
            assert torch.equal(a.cpu(), b), f"group {g} {name}: {a.cpu()} vs {b}"


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_spec_is_each_groups_own_dedup(case: str) -> None:
    """Group g's share is the dedup of its values in its feature order: ``unique`` ascending
    and distinct, ``unique[inverse]`` its values, ``starts`` the runs of ``order`` (each id's
    positions, ascending within an id), its weights moved with its values, its bags' offsets
    those of its keys' bags in its order."""
    per_key, group_keys = CASES[case]
    key_group = [0] * len(per_key)
    for g, ks in enumerate(group_keys):
        for k in ks:
            key_group[k] = g
    gen = torch.Generator().manual_seed(7)
    keys, weights = _batch(gen, per_key, key_group, rows=20)
    where = _plan(keys, per_key, group_keys)
    lengths = _lengths(per_key)
    shares = scatter_joint_ref(keys, where, FUSION_K + TABLE_BITS, weights, lengths)
    bounds = [0]
    for n in per_key:
        bounds.append(bounds[-1] + n)
    mask = (1 << (FUSION_K + TABLE_BITS)) - 1
    for g, ks in enumerate(group_keys):
        picked = [torch.arange(bounds[k], bounds[k + 1]) for k in ks]
        positions = torch.cat(picked) if picked else torch.empty(0, dtype=torch.int64)
        values = keys[positions] & mask  # the group's values, in its feature order
        share = shares.group(where, g)
        unique, inverse, order, starts, w = (
            share.unique,
            share.inverse,
            share.order,
            share.starts,
            share.weights,
        )
        assert torch.equal(unique, torch.unique(values))
        assert torch.equal(unique[inverse], values)
        assert torch.equal(values[order], torch.sort(values, stable=True)[0])
        assert torch.equal(order, torch.sort(values, stable=True)[1])  # one key per table
        counts = torch.bincount(inverse, minlength=unique.numel())
        assert torch.equal(starts.diff(), counts) and int(starts[0]) == 0
        assert w is not None and torch.equal(w, weights[positions])
        bags = lengths.view(len(per_key), BAGS)[ks].reshape(-1)
        assert torch.equal(share.offsets, torch.cat([bags.new_zeros(1), bags.cumsum(0)]))


def test_plan_places_each_key_in_its_groups_feature_order() -> None:
    """The docstring's example: keys a, b, c with 2, 3, 1 values; group 0 takes c then a."""
    where = plan([2, 3, 1], [[2, 0], [1]], [3], 5)
    assert where.key_ends == [2, 5, 6]
    assert where.shift == [1, -2, -5]  # a: 0 -> 1; b: 2 -> 0; c: 5 -> 0
    assert where.num_values == [3, 3] and where.v_lo == [0, 3]
    assert where.u_lo == [0, 3] and where.num_unique == [3, 2]
    assert where.ubase == [0, 4] and where.vbase == [0, 4]
