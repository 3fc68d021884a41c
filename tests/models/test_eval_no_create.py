"""Inference over ids the tier never held writes nothing to it (issue 44, finding 10).

A forward under ``torch.no_grad()`` (``eval()`` or not) reads the rows the tier lacks as their
initial values (seeded per id: the value training would create) without creating them: the
tier's rows (HostKV's row count; every key and value of a Redis namespace) are the same before
and after an evaluation pass over unseen ids and a flush (the rows it read are clean in the
cache: nothing is written back). Its outputs equal a training-mode forward's on a fresh twin,
which does create the rows; a training step on those ids afterwards creates them as before,
with the same values as the twin's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
import torch
from torchrec import KeyedJaggedTensor

import embcache
from embcache.kv.base import Store
from tests.kv.redis_servers import RedisServer, running_server
from tests.test_redis_training import TABLES

TRAINED = {"t0": 100, "t1": 50}  # training touches ids below these; evaluation those above
CACHES = {
    "10%": embcache.CacheConfig(load_factor=0.1, ways=4),  # set-associative: misses, evictions
    "whole": embcache.CacheConfig(load_factor=1.0),  # direct-mapped
    "bounded-tier": embcache.CacheConfig(load_factor=0.1, ways=4, tier_capacity=256),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis")) as started:
        yield started


def _kjt(seed: int, low: dict[str, int], high: dict[str, int]) -> KeyedJaggedTensor:
    """16 bags a feature (f0, f1 of t0; f2 of t1), ids in ``[low, high)`` of their table,
    some empty, some repeated."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (3 * 16,), generator=gen)
    values = []
    for f, table in enumerate(["t0", "t0", "t1"]):
        n = int(lengths[16 * f : 16 * (f + 1)].sum())
        values.append(torch.randint(low[table], high[table], (n,), generator=gen))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=torch.cat(values), lengths=lengths
    )


def _train_batches() -> list[KeyedJaggedTensor]:
    return [_kjt(s, {"t0": 0, "t1": 0}, TRAINED) for s in range(3)]


def _unseen() -> KeyedJaggedTensor:
    return _kjt(99, TRAINED, {"t0": 400, "t1": 150})


def _stores(kind: str, server: RedisServer | None) -> Callable[[], tuple[Store | str, str]]:
    """``make() -> (store, Redis namespace or "")``: a fresh tier of ``kind`` each call."""
    if kind == "host":
        return lambda: (embcache.HostKV(), "")
    assert server is not None

    def url() -> tuple[str, str]:
        namespace = f"eval-{uuid.uuid4().hex[:8]}"
        prefix = "tiered+" if kind == "tiered" else ""
        suffix = "&capacity_rows=120" if kind == "tiered" else ""
        return f"{prefix}{server.url}?namespace={namespace}{suffix}", namespace

    return url


def _build(store: Store | str, cache: str) -> tuple[embcache.CachedEmbeddingBagCollection, object]:
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=TABLES, cache=CACHES[cache], store=store, seed=0
    )
    return ebc, embcache.SparseAdaGrad([ebc], lr=0.1)


def _step(ebc: embcache.CachedEmbeddingBagCollection, opt: object, kjt: KeyedJaggedTensor) -> None:
    ebc(kjt).values().square().sum().backward()
    opt.step()  # type: ignore[attr-defined]


def _held(
    ebc: embcache.CachedEmbeddingBagCollection, client: redis.Redis | None, namespace: str
) -> object:
    """What the tier holds after a flush: each table's row count, and on Redis every key
    (but the leases, which renew) and its value."""
    ebc.flush()
    counts = {t.name: ebc.store.row_count(t.name) for t in TABLES}
    if client is None:
        return counts
    keys = sorted(k for k in client.scan_iter(match=f"{namespace}:*", count=1000)
                  if b":lease:" not in k)  # fmt: skip
    return counts, dict(zip(keys, [client.dump(k) for k in keys], strict=True))


# A bounded tier table is HostKV's (RedisKV bounds none): that cache runs on the host tier only.
CASES = [
    (k, c)
    for k in ("host", "redis", "tiered")
    for c in CACHES
    if k == "host" or c != "bounded-tier"
]


@pytest.mark.parametrize(("kind", "cache"), CASES)
def test_inference_over_unseen_ids_writes_nothing(
    kind: str, cache: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("server") if kind != "host" else None
    client = server.client() if server is not None else None
    make = _stores(kind, server)
    store, namespace = make()
    ebc, opt = _build(store, cache)
    for kjt in _train_batches():
        _step(ebc, opt, kjt)
    before = _held(ebc, client, namespace)

    ebc.eval()
    with torch.no_grad():
        evaluated = ebc(_unseen()).values()
        again = ebc(_unseen()).values()  # now hits: the same rows
    assert torch.equal(evaluated, again)
    assert _held(ebc, client, namespace) == before, "evaluation over unseen ids wrote to the tier"

    twin, twin_opt = _build(make()[0], cache)
    twin.train()
    created_before = sum(twin.store.row_count(t.name) for t in TABLES)
    assert torch.equal(twin(_unseen()).values(), evaluated)  # a training forward...
    twin.flush()
    if cache != "whole":  # a direct-mapped cache reads its rows through `Store.read` anyway
        assert sum(twin.store.row_count(t.name) for t in TABLES) > created_before  # ...creates

    # A training step on those ids afterwards creates them, as on the twin.
    ebc.train()
    _step(ebc, opt, _unseen())
    _step(twin, twin_opt, _unseen())
    ebc.flush()
    twin.flush()
    for table in TABLES:
        ids = torch.arange(TRAINED[table.name], table.num_embeddings)
        ours, theirs = ebc.store.read(table.name, ids), twin.store.read(table.name, ids)
        assert torch.equal(ours, theirs), table.name
        ours_ids = {int(i) for c in ebc.store.export_rows(table.name) for i in c[0]}
        twin_ids = {int(i) for c in twin.store.export_rows(table.name) for i in c[0]}
        assert twin_ids <= ours_ids, f"{table.name}: rows trained but not created"
    ebc.close()
    twin.close()
