"""The backend is chosen in one place (`embcache.backend`): every choice asks it, a name that
is none of the choices is a ValueError wherever the choice is made, and whoever holds a choice
makes it once (a tier table its row moves when declared)."""

from __future__ import annotations

import pytest
import torch

import embcache
import embcache.native as native
from embcache.backend import CHOICES, backend_name, for_device
from embcache.kernels.backend import use_triton
from embcache.kv.base import TableSpec
from embcache.kv.host import HostKV
from embcache.kv.host_tables import DenseTable

TYPO = "tourch"


def _tables() -> list[embcache.TableConfig]:
    return [
        embcache.TableConfig(name="t0", embedding_dim=8, num_embeddings=300,
                             feature_names=["f0", "f1"]),
        embcache.TableConfig(name="t1", embedding_dim=8, num_embeddings=200,
                             feature_names=["f2"]),
    ]  # fmt: skip


def _batch() -> embcache.JaggedBatch:
    lengths = torch.tensor([1, 2, 0, 3, 1, 1])
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    return embcache.JaggedBatch.from_lengths(["f0", "f1", "f2"], values, lengths)


@pytest.mark.parametrize(("value", "name"), [("", "auto"), (" Torch ", "torch"),
                                             ("TRITON", "triton"), ("auto", "auto")])  # fmt: skip
def test_each_choice_is_read_as_its_name(monkeypatch, value: str, name: str) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", value)
    assert backend_name() == name and name in CHOICES


def test_unset_is_auto(monkeypatch) -> None:
    monkeypatch.delenv("EMBCACHE_BACKEND", raising=False)
    assert backend_name() == "auto"


def test_a_typo_raises_at_every_choice(monkeypatch) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", TYPO)
    cpu = torch.empty(1)
    for choose in (backend_name, lambda: for_device("cpu"), lambda: use_triton(cpu),
                   lambda: for_device("cuda"),
                   lambda: HostKV(pin_memory=False).init_table(TableSpec("t", 4, 10))):  # fmt: skip
        with pytest.raises(ValueError, match=f"EMBCACHE_BACKEND='{TYPO}' is not one of"):
            choose()


def test_a_typo_raises_when_the_collection_is_made(monkeypatch) -> None:
    monkeypatch.setenv("EMBCACHE_BACKEND", TYPO)
    with pytest.raises(ValueError, match="EMBCACHE_BACKEND"):
        embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0)


def test_a_typo_set_after_the_collection_changes_nothing_it_chose(monkeypatch) -> None:
    """Every part of a collection made its choice when built (its caches, tier tables and
    initialisers hold their bound implementations): a name set later, even one that is none of
    the choices, is read by nothing of its step, which trains to the same rows as a twin built
    and trained with the variable left alone."""
    rows = []
    for later in ("auto", TYPO):
        monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
        ebc = embcache.CachedEmbeddingBagCollection(
            tables=_tables(), seed=0, cache=embcache.CacheConfig(capacity=64, ways=4)
        )
        opt = embcache.SparseSGD([ebc], lr=0.1)
        monkeypatch.setenv("EMBCACHE_BACKEND", later)
        for _ in range(3):
            ebc(_batch()).values().square().sum().backward()
            opt.step()
        monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
        rows.append(ebc.state_dict()["embedding_bags.t0.weight"])
    assert torch.equal(rows[0], rows[1])
    assert not torch.equal(
        rows[0],
        embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0).state_dict()[
            "embedding_bags.t0.weight"
        ],
    )  # it trained


def test_the_tbe_step_follows_the_backend_its_cache_was_built_with(monkeypatch) -> None:
    """The cache holds its `Backend` from construction: the TBE step runs for a cache built
    under ``auto`` (the native family) whatever the variable says later, never for one built
    under ``torch``."""
    pytest.importorskip("fbgemm_gpu")
    from embcache.engine.tbe_step import TbeStep

    engines, optimizers = {}, {}
    for name in ("auto", "torch"):
        monkeypatch.setenv("EMBCACHE_BACKEND", name)
        ebc = embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0)
        optimizers[name] = embcache.SparseSGD([ebc], lr=0.1)
        engines[name] = ebc.engines.engines[0]
    assert engines["auto"].cache.backend.name == "native"
    assert engines["torch"].cache.backend.name == "torch"
    for later in ("torch", "auto"):
        monkeypatch.setenv("EMBCACHE_BACKEND", later)
        assert TbeStep.for_engine(engines["auto"], optimizers["auto"]) is not None
        assert TbeStep.for_engine(engines["torch"], optimizers["torch"]) is None


# -- a tier table chooses its row moves when declared -----------------------------------------

SIZES = {"a": 50, "b": 80}


def _store() -> HostKV:
    kv = HostKV(pin_memory=False)
    for name, rows in SIZES.items():
        kv.init_table(TableSpec(name, 3, num_embeddings=rows, state_dim=1, state_init=0.5))
    return kv


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_a_dense_table_keeps_the_row_moves_it_was_declared_with(monkeypatch) -> None:
    compiled = _store()
    monkeypatch.setenv("EMBCACHE_BACKEND", "torch")
    twins = _store()
    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    tables = {name: kv._tables[name] for kv in (compiled, twins) for name in SIZES}
    assert all(isinstance(t, DenseTable) for t in tables.values())
    assert all(compiled._tables[n].compiled for n in SIZES)
    assert not any(twins._tables[n].compiled for n in SIZES)
    ids = torch.tensor([3, 7, 3, 49, 0, 5, 79, 5])  # repeats; a miss seen twice
    counts = [4, 4]
    assert torch.equal(
        compiled.get_grouped(list(SIZES), ids, counts), twins.get_grouped(list(SIZES), ids, counts)
    )
    assert compiled.io_stats() == twins.io_stats()


@pytest.mark.skipif(not native.importable(), reason="numba cannot be imported here")
def test_a_missed_grouped_read_takes_no_other_implementation(monkeypatch) -> None:
    """Rows never created, read through the compiled pass: created there, not by falling back
    to `get` per table (or to the torch ops of `DenseTable.get`)."""
    kv, reference = _store(), _store()
    for store in (kv, reference):  # both tables allocated, a few rows of each created
        store.put("a", torch.tensor([1, 2]), torch.ones(2, 4))
        store.put("b", torch.tensor([3]), torch.ones(1, 4))

    def refuse(*_args, **_kwargs):
        raise AssertionError("a missed read walked to another implementation")

    monkeypatch.setattr(HostKV, "get", refuse, raising=True)
    monkeypatch.setattr(DenseTable, "get", refuse)
    monkeypatch.setattr(kv, "get", refuse)
    ids, counts = torch.tensor([1, 2, 9, 9, 0, 79]), [4, 2]
    got = kv.get_grouped(list(SIZES), ids, counts)
    monkeypatch.undo()
    want = torch.cat([reference.get("a", ids[:4]), reference.get("b", ids[4:])])
    assert torch.equal(got, want)
    assert kv.row_count("a") == 3 and kv.row_count("b") == 3
