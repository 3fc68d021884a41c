"""HashIndex, the vectorised open-addressing map of the tiers, against a dict: inserts in
batches, lookups of present and absent keys, removals with tombstones, rebuilds."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.kv.hash_index import HashIndex

BIG = 2**62  # the largest keys drawn below the top of int64

key_sets = st.lists(
    st.one_of(
        st.integers(0, 64),  # dense small keys
        st.integers(0, BIG),  # spread over the whole range
        st.integers(BIG - 64, 2**63 - 1),  # the top of int64
    ),
    max_size=300,
    unique=True,
)


@settings(max_examples=60, deadline=None)
@given(keys=key_sets, data=st.data())
def test_hash_index_matches_a_dict(keys: list[int], data: st.DataObject) -> None:
    index = HashIndex(min_slots=2)
    model: dict[int, int] = {}
    cuts = data.draw(st.lists(st.integers(0, len(keys)), max_size=8), label="batch cuts")
    bounds = sorted({0, len(keys), *cuts})
    for start, stop in itertools.pairwise(bounds):
        batch = keys[start:stop]
        index.insert(torch.tensor(batch, dtype=torch.int64), torch.arange(start, stop))
        model.update(zip(batch, range(start, stop), strict=True))
        assert len(index) == len(model)
        assert index.num_slots >= 2 * len(model)
    absent = data.draw(st.lists(st.integers(0, 2**63 - 1), max_size=20))
    probe = keys + [k for k in absent if k not in model]
    found = index.find(torch.tensor(probe, dtype=torch.int64)).tolist()
    assert found == [model.get(k, -1) for k in probe]
    held_keys, held_values = index.items()
    assert dict(zip(held_keys.tolist(), held_values.tolist(), strict=True)) == model


def test_id_index_survives_insert_remove_churn() -> None:
    """The id -> slot index against a dict, through many rounds of inserts and removals
    (tombstones, their reuse, rebuilds), with colliding and huge ids."""
    index = HashIndex()
    model: dict[int, int] = {}
    g = torch.Generator().manual_seed(0)
    universe = torch.cat([torch.arange(300), torch.randint(0, 2**62, (300,), generator=g)])
    for round_ in range(60):
        present = torch.tensor(sorted(model), dtype=torch.int64)
        absent = universe[~torch.isin(universe, present)]
        add = absent[
            torch.randperm(absent.numel(), generator=g)[
                : int(torch.randint(0, 40, (1,), generator=g))
            ]
        ]
        index.insert(add, add * 3 + round_)
        model.update(zip(add.tolist(), (add * 3 + round_).tolist(), strict=True))
        present = torch.tensor(sorted(model), dtype=torch.int64)
        drop = present[
            torch.randperm(present.numel(), generator=g)[
                : int(torch.randint(0, 30, (1,), generator=g))
            ]
        ]
        index.remove(drop)
        for key in drop.tolist():
            del model[key]
        want = torch.tensor([model.get(k, -1) for k in universe.tolist()])
        assert torch.equal(index.find(universe), want), round_
        assert len(index) == len(model)
