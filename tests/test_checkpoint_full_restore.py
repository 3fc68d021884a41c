"""A checkpoint gives back every row, the ones never touched included, whatever seed the
loading model was built with; and the KV client's own tensors round-trip through it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import embcache
from embcache.checkpoint import CheckpointError
from embcache.kv import HostKV
from embcache.recstore.kv_client import KVClient, KVOptimizer

TABLES = [
    embcache.TableConfig(name="t0", embedding_dim=4, num_embeddings=400, feature_names=["f0"]),
    embcache.TableConfig(name="t1", embedding_dim=6, num_embeddings=200, feature_names=["f1"]),
]
CACHES = {
    "whole-table": None,  # every row cached: without a seed, torchrec's draws kept on the host
    "partial": embcache.CacheConfig(load_factor=0.1, ways=4),  # rows drawn per id from a hash
}


def build(cache: str, seed: int | None, torch_seed: int):
    torch.manual_seed(torch_seed)
    ebc = embcache.CachedEmbeddingBagCollection(tables=TABLES, cache=CACHES[cache], seed=seed)
    return ebc, embcache.SparseAdaGrad(ebc, lr=0.1)


def train(ebc, opt, steps: int = 4) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):  # ids below 40: most rows are never touched
        ids = torch.randint(0, 40, (2 * 16,), generator=gen)
        batch = embcache.JaggedBatch.from_lengths(
            ["f0", "f1"], ids, torch.ones(32, dtype=torch.int64)
        )
        ebc(batch).values().square().sum().backward()
        opt.step()


def every_row(ebc) -> dict[str, torch.Tensor]:
    return {t.name: ebc.table_rows(t.name) for t in ebc.tables}


def assert_rows_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name in want:
        differ = (got[name] != want[name]).any(dim=1)
        assert not differ.any(), f"{name}: {int(differ.sum())} rows differ"


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("saved_seed", [None, 7], ids=["saved-torch-seed", "saved-seed-7"])
@pytest.mark.parametrize(
    "loader", [(123, 0), (None, 1)], ids=["loader-seed-123", "loader-manual-seed-1"]
)
def test_a_load_into_a_model_of_another_seed_gives_back_every_row(
    tmp_path: Path, cache: str, saved_seed: int | None, loader: tuple[int | None, int]
) -> None:
    ebc, opt = build(cache, saved_seed, torch_seed=0)
    train(ebc, opt)
    embcache.save(tmp_path / "ckpt", ebc, [opt])
    want = every_row(ebc)

    other, other_opt = build(cache, *loader)
    before = every_row(other)
    assert any((before[n] != want[n]).any() for n in want), "the loader must start elsewhere"
    embcache.load(tmp_path / "ckpt", other, [other_opt])
    assert_rows_equal(every_row(other), want)

    # And training goes on alike: rows first touched after the load start alike too.
    train(ebc, opt, steps=2)
    train(other, other_opt, steps=2)
    assert_rows_equal(every_row(other), every_row(ebc))


def test_a_whole_table_checkpoint_keeps_torchrecs_draws(tmp_path: Path) -> None:
    ebc, opt = build("whole-table", None, torch_seed=0)
    snap = embcache.save(tmp_path / "ckpt", ebc, [opt])
    manifest = json.loads((snap / "manifest.json").read_text())
    kinds = {e["table"]: e["init"]["kind"] for e in manifest["tables"]}
    assert kinds == {"t0": "drawn", "t1": "drawn"}
    partial, popt = build("partial", None, torch_seed=3)
    manifest = json.loads((embcache.save(tmp_path / "p", partial, [popt]) / "manifest.json")
                          .read_text())  # fmt: skip
    assert {e["init"]["kind"] for e in manifest["tables"]} == {"hashed"}


def _rewrite_manifest(root: Path, edit) -> Path:
    """Edit the manifest CURRENT names and re-sign it (what an older embcache wrote, say)."""
    name = (root / "CURRENT").read_text().split("\n")[0]
    path = root / name / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    text = json.dumps(manifest, indent=1).encode()
    path.write_bytes(text)
    (root / "CURRENT").write_text(f"{name}\nsha256 {hashlib.sha256(text).hexdigest()}\n")
    return root / name


@pytest.mark.parametrize("cache", list(CACHES))
def test_a_checkpoint_without_init_records_still_loads(tmp_path: Path, cache: str) -> None:
    """Older checkpoints hold no "init": the trained rows load, the others stay the model's."""
    ebc, opt = build(cache, None, torch_seed=0)
    train(ebc, opt)
    embcache.save(tmp_path / "ckpt", ebc, [opt])
    want = every_row(ebc)

    def drop(manifest):
        for entry in manifest["tables"]:
            entry.pop("init")

    _rewrite_manifest(tmp_path / "ckpt", drop)
    other, other_opt = build(cache, 123, torch_seed=1)
    before = every_row(other)
    embcache.load(tmp_path / "ckpt", other, [other_opt])
    got = every_row(other)
    for t in TABLES:
        trained = (want[t.name][:, t.embedding_dim :] != 0).any(dim=1)  # AdaGrad state
        assert 0 < int(trained.sum()) < t.num_embeddings
        assert torch.equal(got[t.name][trained], want[t.name][trained])
        assert torch.equal(got[t.name][~trained], before[t.name][~trained])


def test_damaged_initial_weights_change_nothing(tmp_path: Path) -> None:
    ebc, opt = build("whole-table", None, torch_seed=0)
    train(ebc, opt)
    snap = embcache.save(tmp_path / "ckpt", ebc, [opt])
    victim = sorted((snap / "inits").iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    other, other_opt = build("whole-table", None, torch_seed=1)
    before = every_row(other)
    with pytest.raises(CheckpointError, match="inits"):
        embcache.load(tmp_path / "ckpt", other, [other_opt])
    assert_rows_equal(every_row(other), before)


def _client() -> KVClient:
    client = KVClient(HostKV())
    client.init_data("user", (100, 8), optimizer=KVOptimizer("AdaGrad", lr=0.05))
    client.init_data("item", (50, 4), init_func=lambda shape, dtype: torch.randn(shape))
    return client


def test_kv_client_tensors_round_trip_with_their_optimizer_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    client = _client()
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randperm(100, generator=gen)[:10]
        client.wait(client.update_async("user", ids, torch.randn(10, 8, generator=gen)))
        ids = torch.randperm(50, generator=gen)[:5]
        client.wait(client.update_async("item", ids, torch.randn(5, 4, generator=gen)))
    want = {n: client.export_rows(n) for n in ("user", "item")}
    assert (want["user"][:, 8:] != 0).any(), "AdaGrad's accumulators are part of the rows"
    ebc, opt = build("partial", None, torch_seed=0)
    embcache.save(tmp_path / "ckpt", ebc, [opt], kv_client=client)

    torch.manual_seed(1)  # another item init_func draw
    fresh = _client()
    other, other_opt = build("partial", None, torch_seed=1)
    with pytest.raises(ValueError, match="kv_client"):
        embcache.load(tmp_path / "ckpt", other, [other_opt])
    embcache.load(tmp_path / "ckpt", other, [other_opt], kv_client=fresh)
    for name, rows in want.items():
        assert torch.equal(fresh.export_rows(name), rows), name
    assert_rows_equal(every_row(other), every_row(ebc))
    client.close()
    fresh.close()


@pytest.mark.parametrize("cache", list(CACHES))
def test_every_row_comes_back_over_redis(tmp_path: Path, cache: str) -> None:
    """The loading model's tier re-declares its tables with the checkpoint's initialiser: over
    a Redis server too (and its rows are those of the first model, in another namespace)."""
    from embcache.kv.redis_kv import RedisKV
    from tests.kv.redis_servers import running_server

    with running_server(tmp_path / "redis") as server:

        def build_on(namespace: str, seed: int | None, torch_seed: int):
            torch.manual_seed(torch_seed)
            ebc = embcache.CachedEmbeddingBagCollection(
                tables=TABLES,
                cache=CACHES[cache],
                seed=seed,
                store=RedisKV(server.url, namespace=namespace),
            )
            return ebc, embcache.SparseAdaGrad(ebc, lr=0.1)

        ebc, opt = build_on("saved", None, 0)
        train(ebc, opt)
        embcache.save(tmp_path / "ckpt", ebc, [opt])
        want = every_row(ebc)
        other, other_opt = build_on("loaded", 123, 1)
        embcache.load(tmp_path / "ckpt", other, [other_opt])
        assert_rows_equal(every_row(other), want)
        ebc.close()
        other.close()
