"""Training over the Redis tiers: the same numbers as the host tier, and a server that goes away
mid-training loses nothing. Real redis-server processes, started and stopped by the tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import embcache
from embcache.kv.redis_kv import RedisKV, TierUnavailableError
from tests.kv.redis_servers import RedisClusterNodes, RedisServer, running_cluster, running_server

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=400, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=150, feature_names=["f2"]),
]


def batches(n: int) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (3 * 8,), generator=gen)
        limit = torch.tensor([400, 400, 150]).repeat_interleave(8).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen).pow(2) * limit).long()
        out.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=["f0", "f1", "f2"], values=values, lengths=lengths
            )
        )
    return out


def build(store) -> tuple[embcache.CachedEmbeddingBagCollection, embcache.SparseOptimizer]:
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=TABLES,
        cache=embcache.CacheConfig(load_factor=0.05, ways=4),
        store=store,
        seed=0,  # the same rows on every tier
    )
    return ebc, embcache.SparseAdaGrad([ebc], lr=0.1)


def step(ebc, opt, kjt) -> None:
    ebc(kjt).values().square().sum().backward()
    opt.step()


def trained(store, n: int = 8) -> dict[str, torch.Tensor]:
    ebc, opt = build(store)
    for kjt in batches(n):
        step(ebc, opt, kjt)
    return {t.name: ebc.table_rows(t.name) for t in ebc.tables}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return trained(embcache.HostKV())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis")) as started:
        yield started


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.mark.parametrize("kind", ["redis", "tiered", "cluster"])
def test_training_over_redis_equals_host_tier(kind, reference, request) -> None:
    namespace = f"parity-{uuid.uuid4().hex[:8]}"
    if kind == "cluster":
        cluster = request.getfixturevalue("cluster")
        url = f"{cluster.url}?namespace={namespace}"
    else:
        server = request.getfixturevalue("server")
        url = f"{server.url}?namespace={namespace}"
        if kind == "tiered":
            url = f"tiered+{url}&capacity_rows=50"
    rows = trained(url)
    for name, expected in reference.items():
        assert torch.equal(rows[name], expected), f"{kind}: table {name} differs"
    if kind == "cluster":
        assert all(size > 0 for size in cluster.dbsizes()), "rows must spread over every node"


def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        url = server.url
    with pytest.raises(TierUnavailableError, match=r"127\.0\.0\.1"):
        build(url)


def test_server_lost_mid_training_loses_nothing(tmp_path: Path, reference) -> None:
    # Persistence on, so a restarted server still holds what was written before it stopped.
    persistent = ("--appendonly", "yes", "--appendfsync", "always")
    with running_server(tmp_path, extra_args=persistent) as server:
        store = RedisKV(server.url, namespace="faults", retry_timeout_s=0.5)
        ebc, opt = build(store)
        data = batches(8)
        for kjt in data[:4]:
            step(ebc, opt, kjt)
        dirty_before = sum(int(c.dirty.sum()) for c in ebc.caches())
        assert dirty_before > 0, "the cache must hold unwritten updates for this test to mean much"

        server.stop()
        with pytest.raises(TierUnavailableError, match=r"127\.0\.0\.1"):
            step(ebc, opt, data[4])  # the forward must fetch misses / write back victims
        opt.zero_grad()
        assert all(c.locked_slots() == 0 for c in ebc.caches())
        assert sum(int(c.dirty.sum()) for c in ebc.caches()) == dirty_before, "dirty rows kept"
        with pytest.raises(TierUnavailableError):
            ebc.flush()

        server.start()  # same port, same data directory
        ebc.flush()
        for kjt in data[4:]:  # the failed batch again, then the rest
            step(ebc, opt, kjt)
        for name, expected in reference.items():
            assert torch.equal(ebc.table_rows(name), expected), f"table {name} differs"
        store.close()
