"""BucketIndex, the index and policy core the bounded tables and TieredKV's held rows share,
against a plain-Python model: a dict id -> [score, pins, dirty, value] with buckets computed by
a pure-Python splitmix64, a clock, and the documented rules (a bounded bucket evicts the
unpinned, unguarded ids of lowest (score, id); a growable index doubles its buckets until the
new ids fit; `lowest` takes the first k of (score, id, index order)). Random calls, drawn
afresh by hypothesis on every run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embcache.kv.bucket_index as core
from embcache.kv.base import ScorePolicy
from embcache.kv.bounded import BoundedIndex
from embcache.kv.bucket_index import BucketIndex, Clock, TierCapacityError, lowest

M64 = (1 << 64) - 1


def py_mix64(x: int) -> int:
    """splitmix64's finaliser on Python ints (uint64), written independently of the core."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class Model:
    """What a `BucketIndex` promises, one Python step per id."""

    def __init__(
        self, policy: ScorePolicy, ways: int, capacity: int | None, clock: list[int]
    ) -> None:
        self.policy, self.bounded = policy, capacity is not None
        self.ways = ways if capacity is None else min(ways, capacity)
        self.num_sets = 2 if capacity is None else capacity // self.ways
        self.clock = clock  # [now], shared between models whose indices share a Clock
        self.held: dict[int, list[int]] = {}  # id -> [score, pins, dirty, value]

    def bucket(self, i: int) -> int:
        return (py_mix64(i ^ core._SALT) & ((1 << 63) - 1)) % self.num_sets

    def tick(self) -> int:
        self.clock[0] += 1
        return self.clock[0]

    def insert(self, ids: list[int], guard: set[int], dirty: bool, values: list[int]) -> list[int]:
        """The ids evicted, or TierCapacityError with nothing changed."""
        if not ids:
            return []
        by_bucket: dict[int, list[int]] = {}
        if not self.bounded:  # double until every bucket's new ids fit in its free ways
            while True:
                room = {b: self.ways for b in range(self.num_sets)}
                for i in self.held:
                    room[self.bucket(i)] -= 1
                for i in ids:
                    room[self.bucket(i)] -= 1
                if min(room.values()) >= 0:
                    break
                self.num_sets *= 2
        for i in ids:
            by_bucket.setdefault(self.bucket(i), []).append(i)
        evicted = []
        for b, new in by_bucket.items():
            mine = [i for i in self.held if self.bucket(i) == b]
            free = self.ways - len(mine)
            candidates = sorted(
                (self.held[i][0], i) for i in mine if self.held[i][1] == 0 and i not in guard
            )
            if len(new) > free + len(candidates):
                raise TierCapacityError(f"bucket {b}")
            evicted += [i for _, i in candidates[: max(0, len(new) - free)]]
        for i in evicted:
            del self.held[i]
        score = self.tick() if self.policy is ScorePolicy.LRU else 0
        for i, v in zip(ids, values, strict=True):
            self.held[i] = [score, 0, int(dirty), v]
        return evicted

    def touch(self, ids: list[int]) -> None:
        if not ids:
            return
        if self.policy is ScorePolicy.LRU:
            now = self.tick()
            for i in ids:
                self.held[i][0] = now
        else:
            for i in set(ids):
                self.held[i][0] += 1


def check(index: BucketIndex, model: Model, probe: list[int]) -> None:
    """The index holds exactly the model's ids, in their buckets, with their bookkeeping."""
    assert (index.num_sets, index.ways) == (model.num_sets, model.ways)
    assert len(index) == len(model.held) == int((index.keys >= 0).sum()) <= index.capacity
    ids, positions = index.items()
    assert ids.tolist() == sorted(model.held)
    assert torch.equal(index.find(ids), positions)
    assert (positions // index.ways).tolist() == [model.bucket(i) for i in ids.tolist()]
    want = [model.held[i] for i in ids.tolist()]
    got = torch.stack(
        [index.scores[positions], index.pins[positions].long(), index.dirty[positions].long()]
        + ([index.values[positions]] if index.values is not None else []),
        dim=1,
    ).tolist()
    assert got == [w[: len(g)] for w, g in zip(want, got, strict=True)]
    absent = [i for i in probe if i not in model.held]
    assert index.find(torch.tensor(absent, dtype=torch.int64)).tolist() == [-1] * len(absent)
    free = index.keys < 0
    assert bool((index.scores[free] == core.FREE_SCORE).all())
    assert not bool(index.pins[free].any() or index.dirty[free].any())


UNIVERSE = [0, 1, 2, 3, 5, 8, 13, 2**31, 2**40 + 7, 2**62 + 1, 2**63 - 1, *range(100, 160)]


def tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(list(ScorePolicy)),
    geometry=st.sampled_from([(4, 24), (4, 10), (8, 8), (3, None), (4, None), (32, None)]),
    data=st.data(),
)
def test_bucket_index_matches_its_model(
    policy: ScorePolicy, geometry: tuple[int, int | None], data: st.DataObject
) -> None:
    """Random inserts (with guards, dirty flags and values), touches, pins, unpins, removals,
    dirty marks and restored scores: after every call the index holds what the model holds,
    evicts what it evicts, refuses what it refuses (changing nothing) and grows as it grows."""
    ways, capacity = geometry
    index = BucketIndex(policy, ways, capacity, values=capacity is None)
    model = Model(policy, ways, capacity, [0])
    draw_ids = st.lists(st.sampled_from(UNIVERSE), max_size=14, unique=True)
    for _ in range(data.draw(st.integers(1, 30), label="calls")):
        held = sorted(model.held)
        action = data.draw(st.sampled_from(["insert", "insert", "touch", "pin", "unpin",
                                            "remove", "dirty", "scores"]))  # fmt: skip
        if action == "insert":
            new = [i for i in data.draw(draw_ids, label="ids") if i not in model.held]
            used = (
                data.draw(st.lists(st.sampled_from(held), unique=True), label="guard")
                if held
                else []
            )
            dirty = data.draw(st.booleans(), label="dirty")
            values = [i % 1000 + 7 for i in new]
            before = (index.keys.clone(), index.scores.clone(), index.pins.clone())
            try:
                evicted = model.insert(new, set(used), dirty, values)
            except TierCapacityError:
                with pytest.raises(TierCapacityError, match="no room for the"):
                    index.insert(tensor(new), index.find(tensor(used)), dirty=dirty)
                after = (index.keys, index.scores, index.pins)
                assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                continue
            positions, got = index.insert(
                tensor(new),
                index.find(tensor(used)),
                dirty=dirty,
                values=tensor(values) if index.values is not None else None,
            )
            assert sorted(got.tolist()) == sorted(evicted)
            assert index.keys[positions].tolist() == new
        elif held:
            some = data.draw(st.lists(st.sampled_from(held), unique=True), label="held ids")
            positions = index.find(tensor(some))
            if action == "touch":
                index.touch(positions)
                model.touch(some)
            elif action == "pin":
                index.pin(positions)
                for i in some:
                    model.held[i][1] += 1
            elif action == "unpin":
                index.unpin(positions)
                for i in some:
                    model.held[i][1] = max(model.held[i][1] - 1, 0)
                model.touch(some)
            elif action == "remove":
                index.remove(positions)
                for i in some:
                    del model.held[i]
            elif action == "dirty":
                index.dirty[positions] = True
                for i in some:
                    model.held[i][2] = 1
            else:
                scores = data.draw(st.lists(st.integers(0, 2**40), min_size=len(some),
                                            max_size=len(some)), label="scores")  # fmt: skip
                index.set_scores(positions, tensor(scores))
                for i, s in zip(some, scores, strict=True):
                    model.held[i][0] = s
                model.clock[0] = max([model.clock[0], *scores])
        check(index, model, UNIVERSE)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), tables=st.integers(1, 3), pinned=st.booleans())
def test_lowest_takes_the_victim_order_across_indices(
    data: st.DataObject, tables: int, pinned: bool
) -> None:
    """Growable indices on one clock, filled and used at random (ties on purpose: one tick per
    call): `lowest(k)` takes the first k of (score, id, index order) among held unpinned ids,
    for every k from 0 past the number held."""
    clock = Clock()
    indices = [BucketIndex("lru", 4, clock=clock) for _ in range(tables)]
    models = [Model(ScorePolicy.LRU, 4, None, [0]) for _ in range(tables)]
    shared = [0]
    for model in models:
        model.clock = shared
    for _ in range(data.draw(st.integers(1, 12), label="calls")):
        t = data.draw(st.integers(0, tables - 1), label="table")
        index, model = indices[t], models[t]
        ids = data.draw(st.lists(st.sampled_from(UNIVERSE), max_size=10, unique=True))
        new = [i for i in ids if i not in model.held]
        old = [i for i in ids if i in model.held]
        index.touch(index.find(tensor(old)))
        model.touch(old)
        index.insert(tensor(new))
        model.insert(new, set(), False, [0] * len(new))
        if pinned and old:
            index.pin(index.find(tensor(old[:1])))
            model.held[old[0]][1] += 1
    for index, model in zip(indices, models, strict=True):
        check(index, model, UNIVERSE)
    order = sorted(
        (entry[0], i, t)
        for t, model in enumerate(models)
        for i, entry in model.held.items()
        if entry[1] == 0
    )
    for k in range(len(order) + 2):
        chosen = lowest(indices, k)
        got = sorted(
            (int(index.scores[p]), int(index.keys[p]), t)
            for t, (index, positions) in enumerate(zip(indices, chosen, strict=True))
            for p in positions.tolist()
        )
        assert got == order[:k], k
        assert all(bool((p[1:] > p[:-1]).all()) for p in chosen if p.numel() > 1)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_growing_keeps_every_row_and_its_bookkeeping(seed: int) -> None:
    """Thousands of ids through a growable index with few ways: it grows as buckets fill,
    every id stays findable with its value, dirty flag and score, and it stays sparse enough
    for its finds (at most ``ways`` ids a bucket, under 3/4 of the positions used)."""
    g = torch.Generator().manual_seed(seed)
    index = BucketIndex("lru", 8, values=True)
    ids = torch.randperm(2**20, generator=g)[:5000] * 4099 + 11
    for part in ids.split(700):
        index.insert(part, dirty=bool(part[0] % 2), values=part * 3)
    where = index.find(ids)
    assert bool((where >= 0).all()) and torch.equal(index.values[where], ids * 3)
    assert index.dirty[where].tolist() == [bool(p[0] % 2) for p in ids.split(700) for _ in p]
    assert index.scores[where].tolist() == [k + 1 for k, p in enumerate(ids.split(700)) for _ in p]
    assert len(index) == 5000 < 0.75 * index.capacity
    index.remove(where[:2500])
    assert index.find(ids[:2500]).tolist() == [-1] * 2500 and len(index) == 2500


def test_shared_clock_orders_uses_across_indices() -> None:
    clock = Clock()
    a, b = BucketIndex("lru", 4, clock=clock), BucketIndex("lru", 4, clock=clock)
    a.insert(tensor([1, 2]))
    b.insert(tensor([1]))  # later than a's rows
    a.touch(a.find(tensor([1])))  # a's id 1 now the latest
    first = lowest([a, b], 2)
    assert a.keys[first[0]].tolist() == [2] and b.keys[first[1]].tolist() == [1]
    b.set_scores(b.find(tensor([1])), tensor([100]))
    assert clock.now == 100 and a.insert(tensor([7]))[0].numel() == 1
    assert int(a.scores[a.find(tensor([7]))]) == 101


def test_bad_input_is_refused_with_what_is_wrong() -> None:
    index = BucketIndex("lfu", 4, values=True)
    index.insert(tensor([1, 2]), values=tensor([0, 1]))
    with pytest.raises(TypeError, match="int64"):
        index.find(torch.tensor([1.0]))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        index.find([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        index.find(tensor([-1]))  # -1 marks a free position: never an id
    with pytest.raises(ValueError, match="1-D"):
        index.insert(tensor([[3]]), values=tensor([[0]]))
    with pytest.raises(ValueError, match="distinct"):
        index.insert(tensor([3, 3]), values=tensor([0, 0]))
    with pytest.raises(ValueError, match="id 2 is held already"):
        index.insert(tensor([3, 2]), values=tensor([0, 0]))
    with pytest.raises(ValueError, match="values, one per id"):
        index.insert(tensor([3]))
    with pytest.raises(ValueError, match="values, one per id"):
        BucketIndex("lru", 4).insert(tensor([3]), values=tensor([0]))
    with pytest.raises(ValueError, match="scores must be in"):
        index.set_scores(index.find(tensor([1])), tensor([-5]))
    assert len(index) == 2 and index.find(tensor([3])).tolist() == [-1]  # nothing changed
    with pytest.raises(ValueError, match="policy"):
        BucketIndex("fifo", 4)
    with pytest.raises(ValueError, match="ways"):
        BucketIndex("lru", 0)
    with pytest.raises(ValueError, match="capacity"):
        BucketIndex("lru", 4, capacity=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Clock"):
        BucketIndex("lru", 4, clock=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be"):
        lowest([index], -1)
    with pytest.raises(ValueError, match="needs a capacity"):
        BoundedIndex(None, "lru")  # type: ignore[arg-type]
