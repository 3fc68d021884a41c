"""What generic ``nn.Module`` tooling does with a collection: copies and pickles.

A collection's rows live in its caches and its tier, not in the module, so ``copy.deepcopy``,
``pickle``, ``torch.save(module)`` and ``copy.copy`` raise a `TypeError` that says what to do
instead (``state_dict`` / ``load_state_dict``, ``embcache.save`` / ``embcache.load``), for the
collection and for a model holding it; the collection is unchanged and keeps training. The ways
the messages name work.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torchrec import EmbeddingBagConfig

import embcache
from tests.models.conftest import feature_rows, random_kjt

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=6, num_embeddings=30, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=6, num_embeddings=20, feature_names=["f2"]),
]
ROWS = feature_rows(TABLES)

COPIES = {
    "deepcopy": (copy.deepcopy, "copy.deepcopy of a CachedEmbeddingBagCollection"),
    "copy": (copy.copy, "cannot be pickled"),
    "pickle": (pickle.dumps, "cannot be pickled"),
    "torch.save": (lambda m: torch.save(m, io.BytesIO()), "cannot be pickled"),
}


def _step(ebc: embcache.CachedEmbeddingBagCollection, opt: embcache.SparseAdaGrad, seed: int):
    kjt = random_kjt(torch.Generator().manual_seed(seed), ROWS, 5)
    ebc(kjt).values().square().sum().backward()
    opt.step()


def _trained() -> tuple[embcache.CachedEmbeddingBagCollection, embcache.SparseAdaGrad]:
    ebc = embcache.CachedEmbeddingBagCollection(TABLES, device="cpu", seed=3)
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    _step(ebc, opt, 0)
    return ebc, opt


# A shallow copy of a model shares its children: only the collection itself is refused.
CASES = [(how, holder) for how in COPIES for holder in ("collection", "model")]
CASES.remove(("copy", "model"))


@pytest.mark.parametrize(("how", "holder"), CASES, ids=[f"{h}-{m}" for h, m in CASES])
def test_copies_and_pickles_are_refused_saying_what_to_do(how: str, holder: str) -> None:
    ebc, opt = _trained()
    before = ebc.state_dict()
    target = (
        ebc if holder == "collection" else embcache.DLRM(ebc, dense_in_features=0, bottom_mlp=())
    )
    fn, what = COPIES[how]
    with pytest.raises(TypeError, match=what) as info:
        fn(target)
    message = str(info.value)
    assert "state_dict()" in message and "embcache.save" in message
    # Nothing changed, and training goes on.
    after = ebc.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    _step(ebc, opt, 1)


def test_the_ways_the_messages_name_copy_the_tables(tmp_path) -> None:
    ebc, opt = _trained()
    # Weights: a new collection over the same tables, loaded from the state_dict.
    copied = embcache.CachedEmbeddingBagCollection(TABLES, device="cpu", seed=7)
    buffer = io.BytesIO()
    torch.save(ebc.state_dict(), buffer)
    buffer.seek(0)
    copied.load_state_dict(torch.load(buffer))
    expected = ebc.state_dict()
    assert all(torch.equal(v, copied.state_dict()[k]) for k, v in expected.items())
    # Weights and optimizer state: embcache.save / embcache.load into the same model rebuilt
    # (same seed: the checkpoint holds the rows trained, the others come from the initialiser).
    restored = embcache.CachedEmbeddingBagCollection(TABLES, device="cpu", seed=3)
    restored_opt = embcache.SparseAdaGrad([restored], lr=0.1)
    embcache.save(tmp_path / "ckpt", ebc, [opt])
    embcache.load(tmp_path / "ckpt", restored, [restored_opt])
    for table in ("t0", "t1"):
        torch.testing.assert_close(restored.table_rows(table), ebc.table_rows(table))
