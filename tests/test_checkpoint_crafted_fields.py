"""Every field of a checkpoint is checked by the rules the live object enforces before anything
is applied: crafted eviction scores of a bounded tier and crafted sparse learning rates are
refused with the model, its rows and both optimizers as they were, and a later load of a good
checkpoint still works."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import KeyedJaggedTensor

import embcache
from embcache.checkpoint import CheckpointError
from tests.checkpoint_job import TABLES, batch, full_state, train
from tests.test_checkpoint_all_or_nothing import (
    _assert_unchanged,
    _rewrite,
    _rewrite_optimizer,
    _saved,
    _trained_elsewhere,
)


class BoundedModel(nn.Module):
    """`tests.checkpoint_job.Model` on a bounded host tier: its checkpoints hold scores."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sparse = embcache.CachedEmbeddingBagCollection(
            tables=TABLES, cache=embcache.CacheConfig(load_factor=0.05, ways=4, tier_capacity=64)
        )
        self.head = nn.Linear(10, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.sparse(kjt).values()).square().mean()


def _bounded(steps: int):
    model = BoundedModel()
    job = (
        model,
        embcache.SparseAdam([model.sparse], lr=0.01),
        torch.optim.Adam(model.head.parameters(), lr=0.01),
    )
    train(*job, start=0, steps=steps)
    return job


def _scores_of(table: str, edit):
    def entry_of(manifest):
        entry = next(e for e in manifest["tables"] if e["table"] == table)
        return entry["files"][0]

    def edited(tensors, meta):
        assert "scores" in tensors
        tensors["scores"] = edit(tensors["scores"])
        return tensors, meta

    return entry_of, edited


@pytest.mark.parametrize(
    "table, edit",
    [
        ("t1", lambda s: torch.cat([s[:-1], torch.tensor([-1])])),
        ("t1", lambda s: torch.full_like(s, (1 << 63) - 1)),
        ("t0", lambda s: torch.cat([s[:-1], torch.tensor([-5])])),
        ("t1", lambda s: s.to(torch.int32)),
    ],
    ids=["negative-in-the-second-table", "free-score", "negative-in-the-first", "int32"],
)
def test_crafted_eviction_scores_are_refused_before_any_row_changes(
    tmp_path, table: str, edit
) -> None:
    ckpt = tmp_path / "ckpt"
    job = _bounded(3)
    embcache.save(ckpt, job[0], list(job[1:]))
    _rewrite(ckpt, *_scores_of(table, edit))
    other = _bounded(7)
    before = full_state(*other)
    with pytest.raises(CheckpointError, match=rf"table {table!r}.*eviction scores must be"):
        embcache.load(ckpt, other[0], list(other[1:]))
    _assert_unchanged(other, before)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s["param_groups"][0].update(lr=-1.0),
        lambda s: s["param_groups"][0].update(lr=-1e30),
        lambda s: s["param_groups"][0].update(eps=-1.0),
        lambda s: s["param_groups"][0].update(betas=(0.9, 1.5)),
        lambda s: s["param_groups"][0].update(weight_decay=-0.1),
    ],
    ids=["lr-negative", "lr-huge-negative", "eps-negative", "beta2-over-one", "decay-negative"],
)
def test_a_crafted_sparse_hyper_parameter_is_refused_and_a_good_load_still_works(
    tmp_path, edit
) -> None:
    good = _saved(tmp_path / "good")
    bad = _saved(tmp_path / "bad")
    _rewrite_optimizer(bad, 0, edit)
    job, before = _trained_elsewhere()
    with pytest.raises(ValueError, match=r"optim-0\.safetensors.*RowUpdate\.\w+ must be"):
        embcache.load(bad, job[0], list(job[1:]))
    _assert_unchanged(job, before)
    embcache.load(good, job[0], list(job[1:]))  # not poisoned: a good load, then steps
    assert job[1].lr == 0.01
    job[0](batch(0)).backward()
    job[1].step()
