"""Cache index ops (set_index, cache_lookup, assign_ways) against plain-Python references.

Every test runs twice through the `backend` fixture: the torch twins and the Triton kernels (on
CPU tensors through Triton's interpreter when there is no GPU). The references below use Python
ints, dicts and sorted lists, sharing no code with either backend.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embcache.kernels.cache_index import assign_ways, cache_lookup, set_index
from embcache.ops.plan.spec import set_index_ref

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
U64 = (1 << 64) - 1

WAYS = [1, 3, 4, 32]
NUM_SETS = [1, 5, 64]


# ----------------------------------------------------------------------------------------------
# plain-Python references
# ----------------------------------------------------------------------------------------------


def py_set_index(x: int, num_sets: int) -> int:
    """splitmix64's finaliser on the id's 64-bit pattern, low 63 bits, modulo num_sets."""
    z = (x + 0x9E3779B97F4A7C15) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    z ^= z >> 31
    return (z & INT64_MAX) % num_sets


def py_cache_lookup(keys: list[list[int]], ids: list[int], sets: list[int]) -> list[int]:
    """One dict per set, id -> way."""
    where = [{k: w for w, k in enumerate(row) if k != -1} for row in keys]
    return [where[s].get(i, -1) for i, s in zip(ids, sets, strict=True)]


def py_assign_ways(
    scores: list[list[int]], blocked: list[list[bool]], miss_sets: list[int]
) -> list[int]:
    """Per set, the unblocked ways sorted by (score, way); the k-th miss takes the k-th."""
    free = {
        s: [w for _, w in sorted((sc, w) for w, sc in enumerate(row) if not blocked[s][w])]
        for s, row in enumerate(scores)
    }
    taken: dict[int, int] = {}
    out = []
    for s in miss_sets:
        k = taken.get(s, 0)
        taken[s] = k + 1
        out.append(free[s][k] if k < len(free[s]) else -1)
    return out


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def assert_equal_verbose(got: torch.Tensor, want: list[int], what: str) -> None:
    """Exact equality, naming the first few mismatching positions."""
    want_t = torch.tensor(want, dtype=torch.int64)
    got_c = got.cpu()
    assert got_c.dtype == torch.int64, f"{what}: dtype {got_c.dtype}"
    assert got_c.shape == want_t.shape, f"{what}: shape {tuple(got_c.shape)} != {len(want)}"
    bad = (got_c != want_t).nonzero().flatten()
    if bad.numel():
        rows = ", ".join(f"[{i}] got {got_c[i].item()} want {want_t[i].item()}" for i in bad[:8])
        raise AssertionError(f"{what}: {bad.numel()} of {len(want)} differ: {rows}")


def random_keys(S: int, W: int, gen: torch.Generator, fill: float = 0.7) -> torch.Tensor:
    """``[S, W]`` keys: each set holds distinct ids that hash to it, about ``fill`` of its ways.

    Ids come from a pool hashed by `py_set_index`, so the table looks like a real cache.
    """
    pool = torch.randint(INT64_MIN, INT64_MAX, (S * W * 4 + 64,), generator=gen).tolist()
    by_set: dict[int, list[int]] = {s: [] for s in range(S)}
    for x in dict.fromkeys(pool):  # distinct, order kept
        if x != -1:
            by_set[py_set_index(x, S)].append(x)
    keys = torch.full((S, W), -1, dtype=torch.int64)
    occupied = torch.rand(S, W, generator=gen) < fill
    for s in range(S):
        for w in range(W):
            if occupied[s, w] and by_set[s]:
                keys[s, w] = by_set[s].pop()
    return keys


def random_assign_inputs(
    S: int, W: int, m: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores with many ties and empty ways (-1), some sets fully blocked, sorted miss sets."""
    scores = torch.randint(-1, 6, (S, W), generator=gen)
    blocked = torch.rand(S, W, generator=gen) < 0.3
    blocked[torch.rand(S, generator=gen) < 0.2] = True
    miss_sets = torch.sort(torch.randint(0, S, (m,), generator=gen)).values
    return scores, blocked, miss_sets


# ----------------------------------------------------------------------------------------------
# set_index
# ----------------------------------------------------------------------------------------------

EDGE_IDS = [0, 1, -1, 2, -2, 12345, INT64_MAX, INT64_MIN, INT64_MAX - 1, INT64_MIN + 1, 2**32]


@pytest.mark.parametrize("num_sets", [1, 5, 64, 1_000_003, 2**62 + 7], ids=lambda s: f"S{s}")
def test_set_index_matches_python(backend: str, device: torch.device, num_sets: int) -> None:
    gen = torch.Generator().manual_seed(num_sets % 1000)
    rand = torch.randint(INT64_MIN, INT64_MAX, (300,), generator=gen).tolist()
    ids = EDGE_IDS + rand
    got = set_index(torch.tensor(ids, device=device), num_sets)
    assert_equal_verbose(got, [py_set_index(x, num_sets) for x in ids], "set_index")


def test_set_index_bit_identical_to_twin(backend: str, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(INT64_MIN, INT64_MAX, (5000,), generator=gen).to(device)
    for num_sets in (3, 64, 4097):
        assert torch.equal(set_index(ids, num_sets), set_index_ref(ids, num_sets))


def test_set_index_keeps_shape_and_strides(backend: str, device: torch.device) -> None:
    ids = torch.arange(-30, 30, device=device).reshape(6, 10).t()  # non-contiguous [10, 6]
    got = set_index(ids, 7)
    assert got.shape == (10, 6)
    assert torch.equal(got, set_index_ref(ids.contiguous(), 7))


@pytest.mark.parametrize("kind", ["sequential", "strided", "random"])
def test_set_index_uniform(backend: str, device: torch.device, kind: str) -> None:
    n, num_sets = 32768, 64
    if kind == "sequential":
        ids = torch.arange(n)
    elif kind == "strided":  # fused ids of one table: high bits fixed, low bits counting by 64
        ids = (3 << 30) + 64 * torch.arange(n)
    else:
        ids = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=torch.Generator().manual_seed(2))
    counts = torch.bincount(set_index(ids.to(device), num_sets).cpu(), minlength=num_sets)
    expected = n / num_sets
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # 63 degrees of freedom: mean 63, sd ~11; 130 is about six sd out, a loose sanity bound.
    assert chi2 < 130, f"{kind}: chi-square {chi2:.1f} over {num_sets} sets"


def test_set_index_empty(backend: str, device: torch.device) -> None:
    got = set_index(torch.empty(0, dtype=torch.int64, device=device), 8)
    assert got.shape == (0,) and got.dtype == torch.int64


def test_set_index_rejects_bad_input(backend: str) -> None:
    with pytest.raises(TypeError, match="int64"):
        set_index(torch.zeros(3, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="num_sets"):
        set_index(torch.zeros(3, dtype=torch.int64), 0)


# ----------------------------------------------------------------------------------------------
# cache_lookup
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("W", [*WAYS, 100], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("S", NUM_SETS, ids=lambda s: f"S{s}")
def test_cache_lookup(backend: str, device: torch.device, S: int, W: int) -> None:
    gen = torch.Generator().manual_seed(100 * S + W)
    keys = random_keys(S, W, gen)
    present = keys[keys != -1]
    absent = torch.randint(INT64_MIN, INT64_MAX, (60,), generator=gen)
    absent = absent[~torch.isin(absent, present) & (absent != -1)]
    # present ids, some repeated, absent ids, and the edge values.
    pick = present[torch.randint(0, max(present.numel(), 1), (120,), generator=gen)]
    edge = torch.tensor([x for x in EDGE_IDS if x != -1])  # -1 marks empty ways, never an id
    ids = torch.cat([pick if present.numel() else pick[:0], absent, edge])
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    sets = torch.tensor([py_set_index(x, S) for x in ids.tolist()])
    got = cache_lookup(keys.to(device), ids.to(device), sets.to(device))
    want = py_cache_lookup(keys.tolist(), ids.tolist(), sets.tolist())
    assert_equal_verbose(got, want, f"cache_lookup S={S} W={W}")
    assert (got >= 0).any() or present.numel() == 0


def test_cache_lookup_strided_keys(backend: str, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(7)
    keys = random_keys(5, 6, gen, fill=1.0)
    keys_t = keys.t().contiguous().t()  # same values, column-major strides
    assert not keys_t.is_contiguous()
    ids = keys.flatten()[keys.flatten() != -1]
    sets = torch.tensor([py_set_index(x, 5) for x in ids.tolist()])
    got = cache_lookup(keys_t.to(device), ids.to(device), sets.to(device))
    assert_equal_verbose(got, py_cache_lookup(keys.tolist(), ids.tolist(), sets.tolist()), "lookup")


def test_cache_lookup_empty(backend: str, device: torch.device) -> None:
    keys = torch.full((4, 3), -1, dtype=torch.int64, device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    got = cache_lookup(keys, empty, empty)
    assert got.shape == (0,) and got.dtype == torch.int64


def test_cache_lookup_all_empty_ways(backend: str, device: torch.device) -> None:
    keys = torch.full((5, 4), -1, dtype=torch.int64, device=device)
    ids = torch.arange(10, device=device)
    got = cache_lookup(keys, ids, set_index(ids, 5))
    assert_equal_verbose(got, [-1] * 10, "lookup in an empty cache")


# ----------------------------------------------------------------------------------------------
# assign_ways
# ----------------------------------------------------------------------------------------------


def check_assignment(got: torch.Tensor, blocked: torch.Tensor, miss_sets: torch.Tensor) -> None:
    """Properties that hold whatever the scores: distinct, unblocked ways within a set."""
    got_l, sets_l = got.cpu().tolist(), miss_sets.tolist()
    seen: dict[int, set[int]] = {}
    for way, s in zip(got_l, sets_l, strict=True):
        if way == -1:
            continue
        assert not blocked[s, way], f"set {s}: blocked way {way} assigned"
        assert way not in seen.setdefault(s, set()), f"set {s}: way {way} assigned twice"
        seen[s].add(way)


@pytest.mark.parametrize("W", WAYS, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("S", NUM_SETS, ids=lambda s: f"S{s}")
def test_assign_ways(backend: str, device: torch.device, S: int, W: int) -> None:
    gen = torch.Generator().manual_seed(1000 * S + W)
    # Enough misses that some sets overflow, few enough that others keep free ways.
    m = max(2, S * W // 2 + 3)
    scores, blocked, miss_sets = random_assign_inputs(S, W, m, gen)
    got = assign_ways(scores.to(device), blocked.to(device), miss_sets.to(device))
    want = py_assign_ways(scores.tolist(), blocked.tolist(), miss_sets.tolist())
    assert_equal_verbose(got, want, f"assign_ways S={S} W={W}")
    check_assignment(got, blocked, miss_sets)


def test_assign_ways_ordering_rules(backend: str, device: torch.device) -> None:
    # set 0: empty ways (-1) first, then lowest score, ties by way index; blocked ways never.
    # set 1: every way blocked. set 2: more misses than unblocked ways.
    scores = torch.tensor([[5, -1, 2, 2, -1, 0], [0, 0, 0, 0, 0, 0], [9, 1, 9, 1, 3, 3]])
    blocked = torch.tensor(
        [
            [False, False, False, False, True, False],
            [True] * 6,
            [False, True, False, True, True, False],
        ]
    )
    miss_sets = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2])
    want = [1, 5, 2, 3, 0, -1, -1, -1, 5, 0, 2, -1]
    got = assign_ways(scores.to(device), blocked.to(device), miss_sets.to(device))
    assert_equal_verbose(got, want, "assign_ways ordering")
    assert want == py_assign_ways(scores.tolist(), blocked.tolist(), miss_sets.tolist())


def test_assign_ways_wide_set(backend: str, device: torch.device) -> None:
    # W above the kernel's comparison chunk and not a power of two; one set, overflowing.
    gen = torch.Generator().manual_seed(5)
    scores = torch.randint(-1, 4, (2, 40), generator=gen)
    blocked = torch.rand(2, 40, generator=gen) < 0.25
    miss_sets = torch.tensor([0] * 45 + [1] * 3)
    got = assign_ways(scores.to(device), blocked.to(device), miss_sets.to(device))
    want = py_assign_ways(scores.tolist(), blocked.tolist(), miss_sets.tolist())
    assert_equal_verbose(got, want, "assign_ways W=40")


def test_assign_ways_empty(backend: str, device: torch.device) -> None:
    scores = torch.zeros(3, 4, dtype=torch.int64, device=device)
    blocked = torch.zeros(3, 4, dtype=torch.bool, device=device)
    got = assign_ways(scores, blocked, torch.empty(0, dtype=torch.int64, device=device))
    assert got.shape == (0,) and got.dtype == torch.int64


def test_assign_ways_rejects_bad_input(backend: str) -> None:
    scores = torch.zeros(3, 4, dtype=torch.int64)
    with pytest.raises(TypeError, match="bool"):
        assign_ways(scores, torch.zeros(3, 4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        assign_ways(scores, torch.zeros(3, 5, dtype=torch.bool), torch.zeros(1, dtype=torch.int64))


@st.composite
def assign_cases(draw: st.DrawFn) -> tuple[list[list[int]], list[list[bool]], list[int]]:
    S = draw(st.integers(1, 4))
    W = draw(st.integers(1, 6))
    scores = draw(
        st.lists(st.lists(st.integers(-1, 3), min_size=W, max_size=W), min_size=S, max_size=S)
    )
    blocked = draw(
        st.lists(st.lists(st.booleans(), min_size=W, max_size=W), min_size=S, max_size=S)
    )
    miss_sets = sorted(draw(st.lists(st.integers(0, S - 1), max_size=2 * W + 2)))
    return scores, blocked, miss_sets


@settings(
    max_examples=25,
    deadline=None,
    # The fixture only sets EMBCACHE_BACKEND, which every example wants unchanged.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=assign_cases())
def test_assign_ways_hypothesis(
    backend: str, device: torch.device, case: tuple[list[list[int]], list[list[bool]], list[int]]
) -> None:
    scores, blocked, miss_sets = case
    got = assign_ways(
        torch.tensor(scores, dtype=torch.int64, device=device),
        torch.tensor(blocked, dtype=torch.bool, device=device),
        torch.tensor(miss_sets, dtype=torch.int64, device=device),
    )
    assert_equal_verbose(got, py_assign_ways(scores, blocked, miss_sets), "assign_ways")


@pytest.mark.parametrize("salt", [0, 7, 2**40, -3, 2**63 + 5], ids=lambda s: f"salt{s}")
def test_salted_mix64_matches_reference(backend: str, device: torch.device, salt: int) -> None:
    """The misses' shuffle (`SetPlanner._choose_ways`): one kernel on the device path, equal to
    `hashing.mix64` of the ids xor the salt (wrapped to int64) on fresh random ids, negative
    ones and a 2-D shape included."""
    from embcache.hashing import mix64
    from embcache.kernels.cache_index import salted_mix64

    gen = torch.Generator().manual_seed(salt % 1000)
    ids = torch.randint(-(2**62), 2**62, (3, 700), generator=gen)
    wrapped = ((salt + 2**63) % 2**64) - 2**63
    got = salted_mix64(ids.to(device), salt)
    assert got.shape == ids.shape and got.dtype == torch.int64
    assert torch.equal(got.cpu(), mix64(ids ^ wrapped))
    with pytest.raises(TypeError, match="salt must be an int"):
        salted_mix64(ids.to(device), 1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("salt", [0, 2**40, -3, 2**63 + 5], ids=lambda s: f"salt{s}")
@pytest.mark.parametrize("num_sets", [1, 37, 2**42 + 3])
def test_miss_keys_match_plain_python(
    backend: str, device: torch.device, salt: int, num_sets: int
) -> None:
    """`miss_keys` (an LRU plan's padded misses: id, set, sort key) on fresh random ids,
    negative ones included, and positions with padding (-1) among them, against plain Python
    over `hashing.mix64` of one id at a time."""
    from embcache.hashing import mix64
    from embcache.kernels.cache_index import miss_keys

    gen = torch.Generator().manual_seed(num_sets % 1000 + salt % 7)
    ids = torch.randint(-(2**62), 2**62, (1500,), generator=gen)
    pos = torch.randint(0, 1500, (1300,), generator=gen)
    pos[torch.rand(1300, generator=gen) < 0.3] = -1
    wrapped = ((salt + 2**63) % 2**64) - 2**63
    got = [t.cpu().tolist() for t in miss_keys(ids.to(device), pos.to(device), salt, num_sets)]
    want: list[list[int]] = [[], [], []]
    for p in pos.tolist():
        x = int(ids[max(p, 0)])
        h = int(mix64(torch.tensor([x]))[0])
        the_set = num_sets if p < 0 else (h & (2**63 - 1)) % num_sets
        shuffle = int(mix64(torch.tensor([x ^ wrapped]))[0])
        for out, v in zip(want, (x, the_set, (shuffle & 0xFFFFF) + (the_set << 20)), strict=True):
            out.append(v)
    assert got == want
    with pytest.raises(ValueError, match="num_sets"):
        miss_keys(ids.to(device), pos.to(device), salt, 0)
    with pytest.raises(TypeError, match="miss_pos"):
        miss_keys(ids.to(device), pos.to(device, torch.int32), salt, num_sets)


@pytest.mark.parametrize("ways", [4, 6, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_assign_misses_matches_the_plans_torch_ops(
    device: torch.device, ways: int, seed: int
) -> None:
    """`assign_misses_triton` (the device path's ways for misses sorted by set, placed and
    counted in one kernel) against what `SetPlanner._choose_ways` computes with `assign_ways`'
    twin and torch ops: fresh random scores (empty ways -1), locks, last-batch guards, keys and
    dirty flags, runs of 1 to more misses than ways."""
    from embcache.ops.plan.spec import assign_ways_ref
    from embcache.ops.plan.triton import assign_misses_triton

    gen = torch.Generator().manual_seed(seed)
    num_sets, batch_seq = 37, 5
    slots = num_sets * ways
    scores = torch.randint(-1, 40, (slots,), generator=gen)
    locks = (torch.rand(slots, generator=gen) < 0.2).to(torch.int32)
    batch_of = torch.where(torch.rand(slots, generator=gen) < 0.15, batch_seq, 3)
    keys = torch.where(scores < 0, -1, torch.randint(0, 10**6, (slots,), generator=gen))
    dirty = torch.rand(slots, generator=gen) < 0.5
    miss_sets = torch.sort(torch.randint(0, num_sets, (150,), generator=gen)).values

    # The torch ops of `_choose_ways` (their specification).
    first = torch.ones_like(miss_sets, dtype=torch.bool)
    first[1:] = miss_sets[1:] != miss_sets[:-1]
    owner = torch.cumsum(first, 0) - 1
    touched = miss_sets[first]
    guarded = locks.view(num_sets, ways)[touched] > 0
    guarded |= batch_of.view(num_sets, ways)[touched] == batch_seq
    assigned = assign_ways_ref(scores.view(num_sets, ways)[touched], guarded, owner)
    want = torch.where(assigned >= 0, touched[owner] * ways + assigned, assigned)
    placed = want >= 0
    held = placed & (keys[want.clamp(min=0)] >= 0)
    want_counts = [int(placed.sum()), int(held.sum()), int((held & dirty[want.clamp(min=0)]).sum())]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBCACHE_BACKEND", "triton")
        on = [t.to(device) for t in (miss_sets, scores, locks, batch_of, keys, dirty)]
        place, counts = assign_misses_triton(*on, ways, batch_seq)
        # A plan's padded list (`SetPlanner._choose_ways_ahead`): the misses first, then entries
        # past every set; their number on the device. The misses' places and counts are the
        # same, the padding's places -1.
        pad = 61
        padded = torch.cat([on[0], torch.full((pad,), num_sets, device=device)])
        num = torch.tensor(miss_sets.numel(), device=device)
        place_p, counts_p = assign_misses_triton(padded, *on[1:], ways, batch_seq, num)
    assert place.tolist() == want.tolist()
    assert counts.tolist() == want_counts
    assert 0 < want_counts[0] < miss_sets.numel()  # some placed, some overflow: both checked
    assert place_p.tolist() == want.tolist() + [-1] * pad
    assert counts_p.tolist() == want_counts


@pytest.mark.parametrize("ways", [1, 4, 6])
def test_cache_slots_are_the_lookups_ways_as_slots(
    backend: str, device: torch.device, ways: int
) -> None:
    """`cache_slots` (the device plan's lookup, slots straight from the kernel) equals
    ``set * W + way`` of `cache_lookup`'s way where it finds the id, else -1."""
    from embcache.kernels.cache_index import cache_slots

    gen = torch.Generator().manual_seed(ways)
    num_sets = 23
    keys = torch.full((num_sets, ways), -1, dtype=torch.int64)
    held = torch.randperm(5000, generator=gen)[: num_sets * ways].view(num_sets, ways)
    keep = torch.rand(num_sets, ways, generator=gen) < 0.7
    keys[keep] = held[keep]
    n_held = num_sets * ways
    absent = torch.randint(5000, 9000, (40,), generator=gen)
    ids = torch.cat([held.reshape(-1), absent])  # each held id in its own set, kept or emptied
    sets = torch.cat(
        [torch.arange(n_held) // ways, torch.randint(0, num_sets, (40,), generator=gen)]
    )
    ways_found = cache_lookup(keys.to(device), ids.to(device), sets.to(device)).cpu()
    got = cache_slots(keys.to(device), ids.to(device), sets.to(device)).cpu()
    want = torch.where(ways_found >= 0, sets * ways + ways_found, -1)
    assert torch.equal(got, want)
    assert int((got >= 0).sum()) == int(keep.sum())  # every kept id found, no absent one


@pytest.mark.parametrize("with_admitted", [False, True], ids=["all-admitted", "admitted"])
def test_lookup_counts_match_the_plans_reads(
    backend: str, device: torch.device, with_admitted: bool
) -> None:
    """`lookup_counts` (what a plan reads before its sort): the missing mask and the counts of
    missing, held, held in scratch and refused ids, against plain Python over fresh slots."""
    from embcache.kernels.cache_index import lookup_counts

    gen = torch.Generator().manual_seed(int(with_admitted))
    num_slots = 50
    slots = torch.randint(-1, 70, (3000,), generator=gen)  # >= 50: scratch rows
    slots[torch.rand(3000, generator=gen) < 0.3] = -1
    admitted = torch.rand(3000, generator=gen) < 0.8 if with_admitted else None
    missing, counts = lookup_counts(
        slots.to(device), num_slots, None if admitted is None else admitted.to(device)
    )
    s, a = slots.tolist(), admitted.tolist() if admitted is not None else [True] * 3000
    want_missing = [x < 0 and ok for x, ok in zip(s, a, strict=True)]
    want = [sum(want_missing), sum(x >= 0 for x in s), sum(x >= num_slots for x in s)]
    if with_admitted:
        want.append(sum(not ok for ok in a))
    assert missing.cpu().tolist() == want_missing
    assert [int(c) for c in counts] == want


@pytest.mark.parametrize("delta", [1, -1, 3])
def test_add_at_held_adds_to_every_held_slot(
    backend: str, device: torch.device, delta: int
) -> None:
    """`add_at_held` (a plan's locks of its hits): ``delta`` added once per occurrence of each
    slot that is not -1, repeats included, nothing anywhere else (slot 0 too, which a -1
    clamps to in the twin)."""
    from embcache.kernels.cache_index import add_at_held

    gen = torch.Generator().manual_seed(delta + 5)
    locks = torch.randint(0, 4, (300,), generator=gen, dtype=torch.int32)
    slots = torch.randint(-1, 300, (2500,), generator=gen)
    slots[::7] = -1
    want = locks.clone()
    for s in slots.tolist():
        if s >= 0:
            want[s] += delta
    got = locks.to(device)
    add_at_held(got, slots.to(device), delta)
    assert torch.equal(got.cpu(), want)


# ----------------------------------------------------------------------------------------------
# reserve_placed: a device plan's placed misses reserved in one operation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["spec", "triton"])
@pytest.mark.parametrize("m", [0, 1, 37, 1500])
def test_reserve_placed_matches_a_python_loop(impl: str, m: int, device: torch.device) -> None:
    """Every implementation against a loop over the misses in plain Python: the slots, keys,
    dirty flags and locks it leaves, and what it returns (old keys, scores, dirty flags, and
    which ways held a row and which of those were dirty)."""
    from embcache.ops.registry import implementations

    gen = torch.Generator().manual_seed(m)
    n_slots, n = 4096, 2000
    ids = torch.randint(0, 1 << 40, (n,), generator=gen)
    slots = torch.randint(-1, n_slots, (n,), generator=gen)
    order_pos = torch.randperm(n, generator=gen)[:m]
    place = torch.randperm(n_slots, generator=gen)[:m]
    keys = torch.where(torch.rand(n_slots, generator=gen) < 0.6, 11, -1)
    dirty = torch.rand(n_slots, generator=gen) < 0.5
    scores = torch.randint(0, 1000, (n_slots,), generator=gen)
    locks = torch.randint(0, 3, (n_slots,), generator=gen, dtype=torch.int32)
    want = [t.tolist() for t in (slots, keys, dirty, locks)]
    old = []
    for pos, slot in zip(order_pos.tolist(), place.tolist(), strict=True):
        k, d = want[1][slot], want[2][slot]
        old.append((k, scores[slot].item(), d, k >= 0, k >= 0 and d))
        want[0][pos] = slot
        want[1][slot] = ids[pos].item()
        want[2][slot] = False
        want[3][slot] += 1
    state = [t.to(device, copy=True) for t in (ids, slots, order_pos, place, keys, dirty,
                                                scores, locks)]  # fmt: skip
    got = implementations("plan")[impl].reserve_placed(*state)
    slots, keys, dirty, locks = (state[k].cpu() for k in (1, 4, 5, 7))
    assert [t.tolist() for t in (slots, keys, dirty, locks)] == want
    assert list(zip(*(t.tolist() for t in got), strict=True)) == old
