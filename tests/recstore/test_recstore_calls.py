"""RecStore's module paths and the KV client's RecStore call shapes (beside embcache's own), as
RecStore's ``recstore/KVClient.py`` defines them; rows of ``init_data`` without an init_func
start at zeros, as RecStore writes them."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

import embcache
from embcache.recstore.kv_client import KVClient, KVOptimizer

META = {"identity": {"job": "test"}, "checkpoint_id": "step-1"}


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("embcache.torchrec_kv.EmbeddingBag", "RecStoreEmbeddingBagCollection"),
        ("embcache.recstore.DistEmb", "DistEmbedding"),
        ("embcache.recstore.DistTensor", "DistTensor"),
        ("embcache.recstore.optimizer", "SparseSGD"),
        ("embcache.recstore.optimizer", "SparseOptimizer"),
        ("embcache.recstore.optimizer", "SparseRowWiseAdagrad"),
        ("embcache.recstore.KVClient", "get_kv_client"),
        ("embcache.recstore.KVClient", "RecStoreClient"),
    ],
)
def test_recstores_module_paths(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(embcache, name, None) or (
        name == "RecStoreClient"
        and getattr(importlib.import_module(module), name) is embcache.KVClient
    )
    # Importing the alias modules never replaces the package's classes of the same name.
    assert embcache.recstore.KVClient is KVClient
    assert embcache.recstore.DistTensor is embcache.DistTensor


def test_init_data_without_init_func_is_zeros() -> None:
    kv = KVClient()
    kv.init_data("z", (1000, 4), torch.float32)
    assert torch.equal(kv.pull("z", torch.tensor([999, 0, 5])), torch.zeros(3, 4))
    kv.init_data("skip", (5, 2), torch.float32, None, lambda s, d: torch.ones(s, dtype=d),
                 initialize_values=False)  # fmt: skip
    assert torch.equal(kv.pull("skip", torch.arange(5)), torch.zeros(5, 2))


def test_init_data_takes_recstores_positions_and_embcaches() -> None:
    kv = KVClient()
    ones = lambda shape, dtype: torch.ones(shape, dtype=dtype)  # noqa: E731
    kv.init_data("rs", (4, 2), torch.float32, None, ones)  # RecStore: part_policy, init_func
    kv.init_data("ec", (4, 2), torch.float32, ones, KVOptimizer("AdaGrad", lr=0.5))  # embcache
    assert torch.equal(kv.pull("rs", torch.arange(4)), torch.ones(4, 2))
    assert torch.equal(kv.pull("ec", torch.arange(4)), torch.ones(4, 2))
    assert kv.optimizer_of("ec") == KVOptimizer("AdaGrad", lr=0.5)
    kv.init_data("kw", (3, 2), torch.float32, part_policy="p", init_func=ones, is_gdata=False)
    assert torch.equal(kv.pull("kw", torch.arange(3)), torch.ones(3, 2))


def test_base_offset_shifts_the_ids() -> None:
    kv = KVClient()
    kv.init_data("off", (3, 2), torch.float32, base_offset=100,
                 init_func=lambda s, d: torch.arange(6, dtype=d).reshape(s))  # fmt: skip
    torch.testing.assert_close(
        kv.pull("off", torch.tensor([102, 100])), torch.tensor([[4.0, 5], [0, 1]])
    )
    kv.push("off", torch.tensor([101]), data=torch.tensor([[9.0, 9]]))
    assert kv.pull("off", torch.tensor([101])).tolist() == [[9.0, 9.0]]
    with pytest.raises(ValueError, match=r"id 3 out of range \[100, 103\)"):
        kv.pull("off", torch.tensor([3]))


def test_prefetch_and_wait_and_get_in_both_shapes() -> None:
    kv = KVClient()
    kv.init_data("p", (6, 3), torch.float32, init_func=lambda s, d: torch.randn(s, dtype=d))
    ids = torch.tensor([5, 0, 5])
    expected = kv.pull("p", ids)
    assert torch.equal(kv.wait_and_get(kv.prefetch("p", ids)), expected)  # embcache
    assert torch.equal(kv.wait_and_get(kv.prefetch(ids, name="p"), 3), expected)  # RecStore
    assert torch.equal(kv.wait_and_get(kv.prefetch(ids, "p"), 3, device="cpu"), expected)
    with pytest.raises(ValueError, match="no tensor name"):
        kv.prefetch(ids)
    kv.set_prefetch_table_name("p")
    handle = kv.prefetch(ids)
    with pytest.raises(ValueError, match="embedding_dim=4"):
        kv.wait_and_get(handle, 4)
    assert torch.equal(kv.wait_and_get(handle, embedding_dim=3, device=torch.device("cpu")),
                       expected)  # fmt: skip


def test_push_takes_data_or_rows() -> None:
    kv = KVClient()
    kv.init_data("w", (4, 2), torch.float32)
    kv.push("w", torch.tensor([0]), data=torch.tensor([[1.0, 2]]))
    kv.push("w", torch.tensor([1]), rows=torch.tensor([[3.0, 4]]))
    kv.push("w", torch.tensor([2]), torch.tensor([[5.0, 6]]))
    assert kv.pull("w", torch.arange(3)).tolist() == [[1, 2], [3, 4], [5, 6]]
    with pytest.raises(TypeError, match="once"):
        kv.push("w", torch.tensor([0]), torch.ones(1, 2), rows=torch.ones(1, 2))


def test_names_meta_update_and_flush_async_updates() -> None:
    kv = embcache.get_kv_client()
    kv.init_data("a", (5, 2), torch.float16)
    ebc = embcache.RecStoreEmbeddingBagCollection(
        [{"name": "t", "embedding_dim": 3, "num_embeddings": 9, "feature_names": ["f"]}]
    )
    assert sorted(kv.data_name_list()) == ["a", "t"]
    assert kv.get_data_meta("a") == (torch.float16, (5, 2))
    assert kv.get_data_meta("t") == (torch.float32, (9, 3))
    handles = [kv.update_async("a", torch.tensor([1]), torch.ones(1, 2)) for _ in range(3)]
    kv.flush_async_updates()
    assert all(h.done() for h in handles)
    kv.update("a", torch.tensor([2]), torch.ones(1, 2))  # synchronous
    torch.testing.assert_close(
        kv.pull("a", torch.tensor([1, 2])).float(), torch.tensor([[-0.03] * 2, [-0.01] * 2]),
        atol=1e-3, rtol=0,
    )  # fmt: skip
    del ebc


def test_save_and_load_checkpoint(tmp_path: Path) -> None:
    kv = embcache.get_kv_client(optimizer={"type": "AdaGrad", "learning_rate": 0.1})
    kv.init_data("a", (5, 2), torch.float32, init_func=lambda s, d: torch.randn(s, dtype=d))
    ebc = embcache.RecStoreEmbeddingBagCollection(
        [{"name": "t", "embedding_dim": 3, "num_embeddings": 9, "feature_names": ["f"]}], seed=1
    )
    kv.update_async("a", torch.tensor([0, 3]), torch.ones(2, 2))  # queued: saved after it
    kv.push("t", torch.tensor([4]), torch.tensor([[1.0, 2, 3]]))
    saved = {n: kv.export_rows(n) for n in ("a", "t")}
    kv.save_checkpoint(tmp_path / "ckpt", META)
    kv.update_async("a", torch.tensor([0, 1]), torch.ones(2, 2))
    kv.push("t", torch.tensor([4]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="differs"):
        kv.load_checkpoint(tmp_path / "ckpt", {**META, "checkpoint_id": "other"})
    kv.load_checkpoint(tmp_path / "ckpt", json.dumps(META))
    for n, rows in saved.items():
        assert torch.equal(kv.export_rows(n), rows)  # weights and AdaGrad's state alike
    with pytest.raises(ValueError, match="checkpoint_id"):
        kv.save_checkpoint(tmp_path / "bad", {"identity": {}})
    del ebc


def test_a_corrupt_checkpoint_changes_nothing(tmp_path: Path) -> None:
    kv = KVClient()
    kv.init_data("a", (4, 2), torch.float32, init_func=lambda s, d: torch.ones(s, dtype=d))
    kv.init_data("b", (4, 2), torch.float32, init_func=lambda s, d: torch.ones(s, dtype=d))
    kv.save_checkpoint(tmp_path, META)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    kv.push("a", torch.arange(4), torch.zeros(4, 2))
    kv.push("b", torch.arange(4), torch.zeros(4, 2))
    data = bytearray((tmp_path / manifest["tensors"]["b"]["file"]).read_bytes())
    data[0] ^= 1
    (tmp_path / manifest["tensors"]["b"]["file"]).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="'b' fails its checksum"):
        kv.load_checkpoint(tmp_path, META)
    assert torch.equal(kv.pull("a", torch.arange(4)), torch.zeros(4, 2))  # "a" not loaded
