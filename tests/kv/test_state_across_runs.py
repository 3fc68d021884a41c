"""Optimizer state that survives a new run on a trained Redis namespace (issue 45, finding 3).

A collection declares its tables before its optimizer is attached (``state_dim=0``), then again
with the optimizer's state layout. On a namespace an AdaGrad run left, the first declaration
used to rewrite every row weights-only and the second every row again with fresh state: a run
started without ``--resume`` lost every accumulator and a ``?shared=1`` reader was refused. Now
a weights-only declaration is a view of the rows, which keep the server's layout and state, and
a declaration of the server's own layout rewrites nothing. Real redis-server processes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

import embcache
from tests.kv.redis_servers import RedisServer, running_server
from tests.test_redis_training import TABLES, batches, step

# Commands that write rows (and the INCR of the write mark every row write is followed by).
ROW_WRITES = ("mset", "msetnx", "setrange", "del", "unlink", "incr", "incrby")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis")) as started:
        yield started


def _build(url: str, optimizer: bool = True) -> tuple[object, object]:
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=TABLES,
        cache=embcache.CacheConfig(load_factor=0.05, ways=4),
        store=url,
        seed=0,
    )
    return ebc, embcache.SparseAdaGrad([ebc], lr=0.1) if optimizer else None


def _rows(client: redis.Redis, namespace: str) -> dict[bytes, bytes]:
    """Every row key of ``namespace`` (``ns:{tag.bucket}:table:id``) and its raw value."""
    keys = sorted(client.scan_iter(match=f"{namespace}:{{*", count=1000))
    return dict(zip(keys, client.mget(keys), strict=True))


def _table_and_id(key: bytes) -> tuple[str, int]:
    table, row = key.decode().rsplit(":", 2)[-2:]
    return table, int(row)


def _state_nonzero(blob: bytes, dim: int) -> bool:
    return bool(torch.frombuffer(bytearray(blob[dim * 4 :]), dtype=torch.float32).ne(0).any())


def _row_writes(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {cmd: int(stats.get(f"cmdstat_{cmd}", {}).get("calls", 0)) for cmd in ROW_WRITES}


def _trained_namespace(server: RedisServer, kind: str) -> tuple[str, str]:
    """Run 1: AdaGrad trains a fresh namespace and closes. Returns ``(url, namespace)``."""
    namespace = f"runs-{uuid.uuid4().hex[:8]}"
    url = f"{server.url}?namespace={namespace}"
    if kind == "tiered":
        url = f"tiered+{url}&capacity_rows=50"
    ebc, opt = _build(url)
    for kjt in batches(6):
        step(ebc, opt, kjt)
    ebc.close()  # type: ignore[attr-defined]
    return url, namespace


@pytest.mark.parametrize("kind", ["redis", "tiered"])
def test_a_new_run_keeps_the_state_of_rows_it_does_not_touch(
    server: RedisServer, kind: str
) -> None:
    """(a) run 2 attaches the same optimizer without resuming and takes one step: every row
    it does not update is bit-identical (weights and AdaGrad state) to what run 1 left."""
    client = server.client()
    url, namespace = _trained_namespace(server, kind)
    after_run1 = _rows(client, namespace)
    dims = {t.name: t.embedding_dim for t in TABLES}
    with_state = sum(_state_nonzero(v, dims[_table_and_id(k)[0]]) for k, v in after_run1.items())
    assert with_state > 100, "run 1 must leave AdaGrad state for this test to mean much"

    ebc, opt = _build(url)
    kjt = batches(7)[-1]  # one step on a batch of its own
    step(ebc, opt, kjt)
    ebc.close()  # type: ignore[attr-defined]
    features = {"f0": "t0", "f1": "t0", "f2": "t1"}
    touched: set[tuple[str, int]] = set()
    for feature, table in features.items():
        touched |= {(table, int(i)) for i in kjt[feature].values().tolist()}
    after_run2 = _rows(client, namespace)
    kept = [k for k in after_run1 if _table_and_id(k) not in touched]
    assert len(kept) > 100
    changed = [_table_and_id(k) for k in kept if after_run2[k] != after_run1[k]]
    assert not changed, f"{len(changed)} rows run 2 did not touch changed, e.g. {changed[:5]}"
    still = sum(_state_nonzero(after_run2[k], dims[_table_and_id(k)[0]]) for k in after_run1)
    assert still >= with_state, f"rows with AdaGrad state: {with_state} after run 1, {still} now"


@pytest.mark.parametrize("kind", ["redis", "tiered"])
def test_a_new_run_starts_without_rewriting_rows(server: RedisServer, kind: str) -> None:
    """(b) run 2's start-up (the collection, then its optimizer) on a trained namespace sends
    no row write (Redis INFO commandstats) and leaves every row as it was."""
    client = server.client()
    url, namespace = _trained_namespace(server, kind)
    after_run1 = _rows(client, namespace)
    client.config_resetstat()
    ebc, _ = _build(url)
    writes = _row_writes(client)
    assert writes == dict.fromkeys(ROW_WRITES, 0), f"start-up wrote rows: {writes}"
    assert _rows(client, namespace) == after_run1, "start-up changed rows on the server"
    ebc.close()  # type: ignore[attr-defined]


def test_a_shared_reader_opens_an_adagrad_namespace(server: RedisServer) -> None:
    """(c) ``?shared=1`` beside the live writer, with no optimizer: the table opens (it was
    refused: a state layout change) and its weights equal the writer's flushed rows, with no
    row written by the reader."""
    namespace = f"reader-{uuid.uuid4().hex[:8]}"
    url = f"{server.url}?namespace={namespace}"
    writer, opt = _build(url)
    for kjt in batches(4):
        step(writer, opt, kjt)
    writer.flush()  # type: ignore[attr-defined]
    client = server.client()
    before = _rows(client, namespace)
    client.config_resetstat()
    reader, _ = _build(f"{url}&shared=1", optimizer=False)
    for table in TABLES:
        written = writer.table_rows(table.name)  # type: ignore[attr-defined]
        read = reader.table_rows(table.name)  # type: ignore[attr-defined]
        assert read.shape == (table.num_embeddings, table.embedding_dim)
        assert torch.equal(read, written[:, : table.embedding_dim]), table.name
    assert _row_writes(client) == dict.fromkeys(ROW_WRITES, 0)
    assert _rows(client, namespace) == before
    reader.close()  # type: ignore[attr-defined]
    writer.close()  # type: ignore[attr-defined]


def test_a_weights_only_write_keeps_the_server_state(server: RedisServer, tmp_path: Path) -> None:
    """A writer that declared a table weights-only (its optimizer not attached yet) writes
    rows: their weights change, the state the server held for them stays, and rows it creates
    get the server layout's fresh state (no short rows for the next optimizer run)."""
    del tmp_path
    from embcache.kv.base import TableSpec
    from embcache.kv.redis_kv import RedisKV

    namespace = f"view-{uuid.uuid4().hex[:8]}"
    spec = TableSpec("t0", dim=3, num_embeddings=50, state_dim=2, state_init=0.25)
    trained = RedisKV(server.url, namespace=namespace)
    trained.init_table(spec)
    ids = torch.arange(0, 50, 5)
    rows = torch.randn(ids.numel(), spec.row_width)
    trained.put("t0", ids, rows)
    trained.close()

    view = RedisKV(server.url, namespace=namespace)
    view.init_table(TableSpec("t0", dim=3, num_embeddings=50))
    assert torch.equal(view.get("t0", ids), rows[:, :3])
    weights = torch.randn(ids.numel(), 3)
    view.put("t0", ids, weights)
    view.get("t0", torch.tensor([1, 2]))  # created in the server's layout
    view.close()

    full = RedisKV(server.url, namespace=namespace)
    full.init_table(spec)
    assert torch.equal(full.get("t0", ids), torch.cat([weights, rows[:, 3:]], dim=1))
    assert bool((full.get("t0", torch.tensor([1, 2]))[:, 3:] == 0.25).all())
    full.close()
