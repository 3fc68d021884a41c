"""Frequencies in bounded memory: the count-min sketch against exact counts, the LFU counts of
a cache (exact or sketched), and admission after N sightings."""

from __future__ import annotations

import pytest
import torch

from embcache.cache.config import CacheConfig
from embcache.cache.sketch import Admission, CountMinSketch, LfuCounts
from embcache.hashing import mix64

FUSION_K = 40


def zipf_stream(seed: int, batches: int, batch: int, rows: int) -> list[torch.Tensor]:
    """Batches of distinct ids drawn Zipf(1.05) over ``rows`` ids (spread by a permutation)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.arange(1, rows + 1, dtype=torch.float64).pow(-1.05)
    perm = torch.randperm(rows, generator=gen) * 7919 + 3
    return [
        perm[torch.multinomial(p, batch, replacement=True, generator=gen)].unique()
        for _ in range(batches)
    ]


def exact_counts(stream: list[torch.Tensor]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for ids in stream:
        for i in ids.tolist():
            counts[i] = counts.get(i, 0) + 1
    return counts


def test_sketch_never_underestimates_and_overestimates_little() -> None:
    """On 200 batches over 100k ids, every estimate is at least the true count, and the excess
    keeps to the count-min bound: at most ``e * total / width`` for all but ``e**-depth`` of
    the keys (here 4 rows of 4,096 counters, some 15 keys per counter)."""
    stream = zipf_stream(0, 200, 2000, 100_000)
    sketch = CountMinSketch(width=4096, depth=4, device="cpu")
    returned = {}
    for ids in stream:
        for i, c in zip(ids.tolist(), sketch.add(ids).tolist(), strict=True):
            returned[i] = c
    truth = exact_counts(stream)
    keys = torch.tensor(list(truth))
    true = torch.tensor([truth[k] for k in keys.tolist()])
    est = sketch.estimate(keys)
    assert bool((est >= true).all())
    total = sum(truth.values())
    excess = (est - true).double()
    bound = torch.e * total / 4096
    assert (excess <= bound).double().mean() >= 1 - torch.e**-4
    assert excess.mean() < bound / 4  # conservative updates keep the excess well inside it
    final = torch.tensor([returned[k] for k in keys.tolist()])
    assert bool((final <= est).all())  # add returned the count at that time
    assert sketch.nbytes == 4 * 4 * 4096


def test_sketch_decay_scales_every_counter() -> None:
    sketch = CountMinSketch(width=64, depth=2, device="cpu")
    ids = torch.arange(10)
    for _ in range(9):
        sketch.add(ids)
    sketch.decay(0.5)
    assert sketch.estimate(ids).tolist() == [4] * 10


def test_lfu_counts_exact_or_sketched() -> None:
    """Table 0 (1,000 rows) counted exactly, table 1 (unbounded) in the sketch: table 0's
    counts are the true ones, table 1's never below them."""
    raw = [(ids - 3) // 7919 for ids in zipf_stream(1, 50, 500, 3000)]  # ids in [0, 3000)
    stream = [torch.cat([ids[ids < 1000], ids[ids >= 1000] | (1 << FUSION_K)]) for ids in raw]
    counts = LfuCounts(torch.tensor([0, -1]), 1000, CountMinSketch(256, 4, "cpu"), FUSION_K)
    for ids in stream:
        counts.add(ids.unique())
    truth = exact_counts([ids.unique() for ids in stream])
    keys = torch.tensor(list(truth))
    got = counts.get(keys)
    true = torch.tensor([truth[k] for k in keys.tolist()])
    exact = keys < 1000
    assert torch.equal(got[exact], true[exact])
    assert bool((got[~exact] >= true[~exact]).all())
    state = counts.state()
    again = LfuCounts(torch.tensor([0, -1]), 1000, CountMinSketch(256, 4, "cpu"), FUSION_K)
    again.load(state)
    assert torch.equal(again.get(keys), got)


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_admission_after_n_sightings(threshold: int) -> None:
    """An id of table 0 is admitted at the batch where it is seen the threshold-th time, and
    from then on; table 1 admits every id; reading without counting does not advance it."""
    admission = Admission(
        torch.tensor([threshold, 1]), CountMinSketch(1 << 12, 4, "cpu"), FUSION_K, window=1 << 12
    )
    a, b = 5, 5 | (1 << FUSION_K)
    seen = []
    for _ in range(4):
        seen.append(admission.admit(torch.tensor([a, b])).tolist())
        assert admission.admit(torch.tensor([a]), count=False).tolist() == [seen[-1][0]]
    assert [s[0] for s in seen] == [k + 1 >= threshold for k in range(4)]
    assert all(s[1] for s in seen)


def test_admission_halves_its_sketch_exactly_at_the_window() -> None:
    """A window of 10 sightings: 9 leave the counters as counted; the 10th (in the middle of a
    batch of 4) is counted, then every counter is halved, and the batch's last 3 ids count in
    the halved sketch; ``sightings`` restarts from there. Ids of a table without admission are
    not sightings."""
    sketch = CountMinSketch(1 << 10, 4, "cpu")
    admission = Admission(torch.tensor([2, 1]), sketch, FUSION_K, window=10)
    ids = torch.arange(3)
    for _ in range(3):
        admission.admit(ids)
        admission.admit(torch.tensor([7 | (1 << FUSION_K)]))  # table 1: not counted
    assert admission.sightings == 9 and sketch.estimate(ids).tolist() == [3, 3, 3]
    before = sketch.counters.clone()
    tenth, rest = torch.tensor([100]), torch.tensor([101, 102, 103])
    counted = admission.admit(torch.cat([tenth, rest]))
    assert counted.tolist() == [False, False, False, False]
    after_tenth = before.clone()
    after_tenth[sketch._cells(tenth).flatten()] += 1
    expected = after_tenth >> 1  # the 10th sighting counted, then every counter halved
    expected[sketch._cells(rest).flatten()] += 1  # the rest, after the halving
    assert torch.equal(sketch.counters, expected)
    assert sketch.estimate(ids).tolist() == [1, 1, 1] and admission.sightings == 3


def one_off_refusals(window: int, batches: int = 60, batch: int = 1000) -> float:
    """Share of first sightings refused (``admit_after=2``) over the last half of a stream of
    fresh one-off ids, 16x more than the sketch's width of 4,096."""
    admission = Admission(torch.tensor([2]), CountMinSketch(1 << 12, 4, "cpu"), FUSION_K, window)
    refused = 0
    for b in range(batches):
        ids = mix64(torch.arange(b * batch, (b + 1) * batch)) & ((1 << FUSION_K) - 1)
        admitted = admission.admit(ids.unique())
        if b >= batches // 2:
            refused += int((~admitted).sum())
    return refused / (batches // 2 * batch)


def test_aging_keeps_refusing_one_off_ids_where_a_sketch_never_aged_admits_them() -> None:
    """60,000 distinct ids through a sketch of 4 x 4,096 counters: halved every 4,096
    sightings (the default window, its width) it still refuses almost every first sighting at
    the end; never halved (a window longer than the stream), collisions have raised every
    counter and it refuses almost none."""
    aged = one_off_refusals(window=CacheConfig(sketch_width=1 << 12).effective_admission_window)
    never = one_off_refusals(window=1 << 40)
    assert aged > 0.9
    assert never < 0.1


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "10"])
def test_admission_window_is_validated(window: object) -> None:
    with pytest.raises(ValueError, match=r"CacheConfig\.admission_window must be an int >= 1"):
        CacheConfig(admit_after=2, admission_window=window)  # type: ignore[arg-type]
