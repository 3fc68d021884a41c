"""Write marks and the tier's own records on real redis-server processes: a server that lost
acknowledged writes is an error on every path (get, put, export, the periodic check), never a
re-created row; a client that never wrote is not alarmed; damaged records on the server, refused
commands and a missing password are clear errors without row bytes or passwords."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import embcache
from embcache.kv.base import TableSpec
from embcache.kv.errors import TierAuthError, TierCommandError
from embcache.kv.redis_kv import RedisKV
from tests.kv.redis_servers import RedisServer, running_cluster, running_server

SPEC = TableSpec("t0", dim=3, num_embeddings=100)


def _written(url: str, **options) -> RedisKV:
    kv = RedisKV(url, retry_timeout_s=5, **options)
    kv.init_table(SPEC)
    kv.put("t0", torch.arange(10), torch.full((10, 3), 2.0))
    return kv


@pytest.mark.parametrize("op", ["get", "put", "export"])
def test_a_server_restarted_empty_is_data_loss(server: RedisServer, op: str) -> None:
    kv = _written(server.url)
    server.restart()  # no persistence: everything gone, the server answers again at once
    calls = {
        "get": lambda: kv.get("t0", torch.arange(5)),
        "put": lambda: kv.put("t0", torch.arange(20, 25), torch.zeros(5, 3)),
        "export": lambda: list(kv.export_rows("t0")),
    }
    with pytest.raises(embcache.TierDataLossError) as caught:
        calls[op]()
    message = str(caught.value)
    assert server.url in message and "'t0'" in message and "resume" in message, message
    if op == "get":  # refused before creating rows from the initialiser
        assert server.client().dbsize() <= 2, "only the lease and record may be back"
    with pytest.raises(embcache.TierDataLossError):
        kv.get("t0", torch.arange(1))  # and it stays refused


def test_a_client_that_never_wrote_is_not_alarmed(server: RedisServer) -> None:
    reader = RedisKV(server.url)
    reader.init_table(SPEC)
    first = reader.get("t0", torch.arange(5))
    server.restart()
    assert torch.equal(reader.get("t0", torch.arange(5)), first)  # initial rows, same values
    # The spec record is back after the reconnect, for other clients to check against.
    record = json.loads(server.client().get("embcache:meta:t0"))
    assert record["dim"] == 3


def test_the_periodic_check_covers_tables_a_call_does_not_touch(server: RedisServer) -> None:
    kv = _written(server.url, verify_interval_s=0)
    kv.init_table(TableSpec("t1", dim=3, num_embeddings=100))
    server.restart()
    with pytest.raises(embcache.TierDataLossError, match="'t0'"):
        kv.get("t1", torch.arange(3))  # t1 was only read; t0's writes were lost


def test_a_cluster_node_that_lost_its_rows_is_data_loss(
    tmp_path: Path,
) -> None:
    with running_cluster(tmp_path, node_timeout_ms=1000) as cluster:
        kv = RedisKV(cluster.url, retry_timeout_s=5)
        kv.init_table(SPEC)
        kv.put("t0", torch.arange(100), torch.ones(100, 3))
        for node in cluster.nodes:  # lose one node's keys, as a node restarted empty would
            node.client().flushall()
            break
        with pytest.raises(embcache.TierDataLossError, match=r"seq:\{"):
            kv.get("t0", torch.arange(100))


@pytest.mark.parametrize(
    ("record", "field"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON list"),
        ({"buckets": 0}, "buckets"),
        ({"buckets": 10**12}, "buckets"),
        ({"buckets": "8"}, "buckets"),
        ({"dim": -3}, "dim"),
        ({"name": "t9"}, "name"),
        ({"state_init": float("nan")}, "state_init"),
    ],
    ids=["garbage", "list", "zero-buckets", "huge-buckets", "str-buckets", "dim", "name", "nan"],
)
def test_a_damaged_table_record_is_a_clear_error(
    server: RedisServer, record: bytes | dict, field: str
) -> None:
    RedisKV(server.url, namespace="d", owner="one-job").init_table(SPEC)
    raw = server.client()
    if isinstance(record, dict):
        stored = json.loads(raw.get("d:meta:t0"))
        stored.update(record)
        record = json.dumps(stored).encode()
    raw.set("d:meta:t0", record)
    with pytest.raises(ValueError, match=field) as caught:
        RedisKV(server.url, namespace="d", owner="one-job").init_table(SPEC)
    assert "d:meta:t0" in str(caught.value)


def test_a_damaged_write_mark_is_a_clear_error(server: RedisServer) -> None:
    kv = _written(server.url)
    server.client().set("embcache:seq:t0", b"\xff\x00")
    with pytest.raises(TierCommandError, match="t0"):
        kv.get("t0", torch.arange(3))


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_refused_commands_name_the_reply_not_the_rows(
    request: pytest.FixtureRequest, where: str
) -> None:
    target = request.getfixturevalue(where)
    kv = RedisKV(target.url, namespace=f"oom-{where}", retry_timeout_s=0.5)
    kv.init_table(SPEC)
    nodes = target.nodes if where == "cluster" else [target]
    for node in nodes:
        node.client().config_set("maxmemory", 1)
    try:
        rows = torch.full((50, 3), 1.2345678e-21)  # bytes that would show as \x.. escapes
        with pytest.raises(TierCommandError, match=r"OutOfMemoryError.*maxmemory") as caught:
            kv.put("t0", torch.arange(50), rows)
    finally:
        for node in nodes:
            node.client().config_set("maxmemory", 0)
    message = str(caught.value)
    assert "\\x" not in message and "MSET" not in message, message
    assert "'t0'" in message and "put" in message


def test_a_missing_or_wrong_password_says_so(tmp_path: Path) -> None:
    with running_server(tmp_path, password="hunter2-secret") as server:
        with pytest.raises(TierAuthError, match="wants a password") as caught:
            RedisKV(server.url)
        assert "is redis-server running" not in str(caught.value)
        wrong = server.url.replace("redis://", "redis://:not-it@")
        with pytest.raises(TierAuthError) as caught:
            RedisKV(wrong)
        assert "not-it" not in str(caught.value) and "***" in str(caught.value)
        right = RedisKV(server.url.replace("redis://", "redis://:hunter2-secret@"))
        right.init_table(SPEC)
        assert "hunter2" not in repr(right)
