"""A closed collection refuses training: its rows were written back and its store closed or
flushed, so a forward with gradients or an optimizer step after ``close()`` would leave updates
in the cache that nothing writes; each is one `RuntimeError` line and nothing changes."""

from __future__ import annotations

import pytest
import torch

import embcache

TABLES = [
    {"name": "t0", "embedding_dim": 6, "num_embeddings": 40, "feature_names": ["f0"]},
    {"name": "t1", "embedding_dim": 3, "num_embeddings": 25, "feature_names": ["f1"]},
]


def _batch() -> embcache.JaggedBatch:
    lengths = torch.tensor([2, 1, 0, 3, 1, 2])
    values = torch.tensor([0, 39, 5, 1, 2, 24, 7, 7, 3])
    return embcache.JaggedBatch.from_lengths(["f0", "f1"], values, lengths)


def _rows(ebc) -> dict[str, torch.Tensor]:
    return {t: ebc.table_rows(t) for t in ("t0", "t1")}


def test_a_closed_collection_refuses_forward_and_step() -> None:
    store = embcache.HostKV()
    ebc = embcache.CachedEmbeddingBagCollection(tables=TABLES, store=store, seed=0)
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    ebc(_batch()).values().sum().backward()
    opt.step()
    ebc(_batch()).values().sum().backward()  # a gradient recorded, then close drops it
    ebc.close()
    before = _rows(ebc)
    with pytest.raises(RuntimeError, match=r"^training forward on a closed \w+: close\(\)"):
        ebc(_batch())
    with pytest.raises(RuntimeError, match=r"^optimizer step on a closed \w+: close\(\)"):
        opt.step()
    opt.zero_grad()  # nothing to drop: allowed
    with torch.no_grad():
        ebc(_batch())  # reading still works on a store it was given
    after = _rows(ebc)
    assert all(torch.equal(before[t], after[t]) for t in before)
