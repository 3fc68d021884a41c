"""A collection implements `CachedCollectionInterface` and holds its parts: the store and the end
of its run (`CollectionLifetime`), torchrec's state_dict keys (`engine.collection_state`), its
whole tables (`LocalTables`), the export name (`ExportName`), the sharded exchanges
(`ShardExchange`). Each part is a plain object (no in-package base, no ``nn.Module``), so the
module's parameters, children and ``state_dict`` keys are what they were."""

from __future__ import annotations

import pytest
import torch

import embcache
from embcache.distributed.sharded import ShardExchange
from embcache.engine.collection_lifetime import CollectionLifetime
from embcache.engine.collection_state import load_weights, save_weights
from embcache.engine.interface import CachedCollectionInterface
from embcache.kv.host import HostKV
from embcache.models.collection import ExportName
from embcache.models.whole_tables import LocalTables
from embcache.recstore.collection import BackendOptimizer

TABLES = [
    {"name": "t0", "embedding_dim": 6, "num_embeddings": 40, "feature_names": ["f0", "f1"]},
    {"name": "t1", "embedding_dim": 3, "num_embeddings": 25, "feature_names": ["f2"]},
]
SEQUENCE_TABLES = [{**t, "pooling": "none"} for t in TABLES]


def _batch() -> embcache.JaggedBatch:
    lengths = torch.tensor([2, 1, 0, 3, 1, 2])
    values = torch.tensor([0, 39, 5, 1, 2, 24, 7, 7, 3])
    return embcache.JaggedBatch.from_lengths(["f0", "f1", "f2"], values, lengths)


class SpyStore(HostKV):
    """A given store that counts its owner's calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def flush(self) -> None:
        self.calls.append("flush")
        super().flush()

    def close(self) -> None:
        self.calls.append("close")
        super().close()


@pytest.mark.parametrize(
    "part",
    [CollectionLifetime, LocalTables, ExportName, ShardExchange, BackendOptimizer],
    ids=lambda c: c.__name__,
)
def test_each_part_stands_alone(part: type) -> None:
    """A part is a class of its own, not a view of the collection through a base."""
    assert part.__mro__[1:] == (object,)


@pytest.mark.parametrize(
    ("cls", "tables", "prefix"),
    [
        (embcache.CachedEmbeddingBagCollection, TABLES, "embedding_bags"),
        (embcache.CachedEmbeddingCollection, SEQUENCE_TABLES, "embeddings"),
    ],
    ids=["bags", "sequences"],
)
def test_the_parts_leave_the_module_as_torch_sees_it(cls: type, tables: list, prefix: str) -> None:
    m = cls(tables, seed=0)
    assert isinstance(m, CachedCollectionInterface)
    assert isinstance(m.lifetime, CollectionLifetime) and m.lifetime.store is m.store
    assert isinstance(m.whole_tables, LocalTables)
    assert [n for n, _ in m.named_parameters()] == ["grad_anchor"]
    assert [n for n, _ in m.named_modules()] == ["", prefix, f"{prefix}.t0", f"{prefix}.t1"]
    assert list(m.state_dict()) == [f"{prefix}.t0.weight", f"{prefix}.t1.weight"]


def test_a_given_store_is_flushed_at_close_and_left_open() -> None:
    store = SpyStore()
    ebc = embcache.CachedEmbeddingBagCollection(TABLES, store=store, seed=0)
    assert not ebc.lifetime.owns_store
    ebc(_batch()).values().sum().backward()
    ebc.close()
    ebc.close()  # idempotent
    assert store.calls == ["flush"] and ebc.lifetime.closed
    assert store.read("t0", torch.tensor([0])).shape == (1, 6)  # still open for its owner


def test_a_store_the_collection_opened_is_closed_with_it() -> None:
    ebc = embcache.CachedEmbeddingBagCollection(TABLES, seed=0)
    assert ebc.lifetime.owns_store
    ebc.close()
    with pytest.raises(RuntimeError, match="HostKV is closed"):
        ebc.store.read("t0", torch.tensor([0]))


def test_an_in_process_store_is_not_written_back_at_exit() -> None:
    """Its rows end with the process: the exit hook leaves the collection open."""
    ebc = embcache.CachedEmbeddingBagCollection(TABLES, seed=0)
    ebc.lifetime.close_at_exit(ebc)
    assert not ebc.lifetime.closed


def test_state_keys_are_checked_before_any_row_is_written() -> None:
    ebc = embcache.CachedEmbeddingBagCollection(TABLES, seed=0)
    before = ebc.table_rows("t0")
    good = torch.ones(40, 6)
    bad = torch.full((25, 3), float("nan"))
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    state = {"m.embedding_bags.t0.weight": good, "m.embedding_bags.t1.weight": bad, "m.x": 1}
    load_weights(ebc, state, "m.", True, missing, unexpected, errors)
    assert errors == ["m.embedding_bags.t1.weight holds NaN or Inf values"]
    assert unexpected == ["m.x"] and not missing
    assert torch.equal(ebc.table_rows("t0"), before)  # nothing written
    saved: dict[str, torch.Tensor] = {}
    save_weights(ebc, saved, "m.")
    assert list(saved) == ["m.embedding_bags.t0.weight", "m.embedding_bags.t1.weight"]
    assert torch.equal(saved["m.embedding_bags.t0.weight"], before[:, :6])


def test_whole_tables_refuse_an_unknown_table_naming_the_known_ones() -> None:
    ebc = embcache.CachedEmbeddingBagCollection(TABLES, seed=0)
    with pytest.raises(KeyError, match=r"unknown table 'tx'; tables: \['t0', 't1'\]"):
        ebc.table_weight("tx")
    assert ebc.table_weight("t1").shape == (25, 3)


def test_the_export_name_is_the_tables_unless_set() -> None:
    ebc = embcache.CachedEmbeddingBagCollection(TABLES, seed=0)
    assert ebc.export_name == "t0[40x6](f0,f1);t1[25x3](f2)"
    ebc.export_name = "user_tower"
    assert ebc.export_name == "user_tower"
    with pytest.raises(TypeError, match="export_name must be a non-empty str, got ''"):
        ebc.export_name = ""
    assert isinstance(embcache.CachedEmbeddingBagCollection.export_name, ExportName)
