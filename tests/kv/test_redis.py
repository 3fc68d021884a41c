"""RedisKV against real redis-server processes (one server, and a 3-node cluster): the `Store`
contract, equality with HostKV, key layout, chunking, and faults (server down, lost, back)."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import pytest
import torch

from embcache.kv.base import Store, TableSpec
from embcache.kv.host import HostKV
from embcache.kv.redis_kv import RedisKV, TierUnavailableError
from embcache.kv.tiered import TieredKV
from embcache.kv.url import open_store
from tests.kv.redis_servers import (
    RedisClusterNodes,
    RedisServer,
    free_port,
)

FAST_RETRY_S = 0.3  # retry budget of the fault tests: long enough to retry, short to wait out


@pytest.fixture
def namespace() -> str:
    """A namespace of this test's own (the cluster is shared by the module's tests)."""
    return f"test-{uuid.uuid4().hex[:12]}"


def _host(spec: TableSpec) -> HostKV:
    kv = HostKV(pin_memory=False)
    kv.init_table(spec)
    return kv


def _export(kv: Store, table: str, chunk_rows: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    chunks = list(kv.export_rows(table, chunk_rows=chunk_rows))
    if not chunks:
        width = kv.table_spec(table).row_width
        return torch.empty(0, dtype=torch.int64), torch.empty(0, width)
    return torch.cat([ids for ids, _ in chunks]), torch.cat([rows for _, rows in chunks])


SPECS = [
    pytest.param(TableSpec("t0", dim=1, num_embeddings=50), id="dim1"),
    pytest.param(TableSpec("t0", dim=7, num_embeddings=1000, state_dim=1, seed=3), id="dim7-s1"),
    pytest.param(
        TableSpec("t0", dim=16, num_embeddings=None, state_dim=2, state_init=0.1), id="unbounded"
    ),
]


def _some_ids(spec: TableSpec, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.num_embeddings is None:
        return torch.cat([torch.tensor([0, 2**62 + 5]), torch.randint(0, 2**40, (n - 2,))]).unique()
    n = min(n, spec.num_embeddings)
    ids = torch.randperm(spec.num_embeddings, generator=g)[:n]
    ids[0] = spec.num_embeddings - 1  # the table's last row
    return ids.unique()[torch.randperm(ids.unique().numel(), generator=g)]


# -- the Store contract, on a server and on a cluster ---------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_get_put_round_trip_and_initial_rows_equal_hostkv(
    url: str, namespace: str, spec: TableSpec
) -> None:
    kv = RedisKV(url, namespace=namespace)
    kv.init_table(spec)
    host = _host(spec)
    ids = _some_ids(spec, 40)
    # First touch creates rows by the initialiser: the same numbers as HostKV's, in any order.
    assert torch.equal(kv.get("t0", ids.flip(0)), host.get("t0", ids.flip(0)))
    assert torch.equal(kv.get("t0", ids), host.get("t0", ids))
    rows = torch.randn(ids.numel(), spec.row_width)
    kv.put("t0", ids[:10], rows[:10])
    assert torch.equal(kv.get("t0", ids[:10]), rows[:10])
    # A second client of the same job (same lease owner) sees the same rows.
    other = RedisKV(url, namespace=namespace, owner=kv.owner)
    other.init_table(spec)
    assert torch.equal(other.get("t0", ids[:10]), rows[:10])
    assert kv.get("t0", torch.empty(0, dtype=torch.int64)).shape == (0, spec.row_width)
    assert isinstance(kv, Store)
    kv.close()
    other.close()


@pytest.mark.parametrize("spec", SPECS)
def test_read_creates_no_row_on_the_server(url: str, namespace: str, spec: TableSpec) -> None:
    kv = RedisKV(url, namespace=namespace, chunk_rows=16)
    kv.init_table(spec)
    host = _host(spec)
    ids = _some_ids(spec, 40)
    assert torch.equal(kv.read("t0", ids), host.get("t0", ids))
    assert _export(kv, "t0")[0].numel() == 0, "a read must not create rows"
    rows = torch.randn(5, spec.row_width)
    kv.put("t0", ids[:5], rows)
    got = kv.read("t0", ids)
    assert torch.equal(got[:5], rows)
    assert torch.equal(got[5:], host.get("t0", ids[5:]))
    assert sorted(_export(kv, "t0")[0].tolist()) == sorted(ids[:5].tolist())
    assert kv.io_stats()["rows_created"] == 0
    kv.close()


def test_io_stats_count_rows_and_bytes(server: RedisServer) -> None:
    kv = RedisKV(server.url)
    kv.init_table(TableSpec("t0", dim=3, num_embeddings=100, state_dim=1))
    kv.get("t0", torch.arange(10))
    kv.put("t0", torch.arange(4), torch.zeros(4, 4))
    kv.get("t0", torch.arange(5))
    assert kv.io_stats() == {
        "rows_read": 15,
        "rows_written": 4,
        "bytes_read": 15 * 16,
        "bytes_written": 4 * 16,
        "get_calls": 2,
        "put_calls": 1,
        "rows_created": 10,
        "tier_evictions": 0,
    }
    kv.reset_io_stats()
    assert set(kv.io_stats().values()) == {0}


def test_bad_input_is_rejected(server: RedisServer) -> None:
    kv = RedisKV(server.url)
    kv.init_table(TableSpec("t0", dim=3, num_embeddings=10))
    with pytest.raises(ValueError, match="out of range"):
        kv.get("t0", torch.tensor([10]))
    with pytest.raises(ValueError, match="negative"):
        kv.put("t0", torch.tensor([-1]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="shape"):
        kv.put("t0", torch.tensor([1]), torch.zeros(1, 4))
    with pytest.raises(KeyError, match="nope"):
        kv.get("nope", torch.tensor([1]))
    with pytest.raises(ValueError, match="namespace"):
        RedisKV(server.url, namespace="a:{b}")
    kv.close()
    with pytest.raises(RuntimeError, match="closed"):
        kv.get("t0", torch.tensor([1]))


def test_namespaces_are_isolated(url: str, namespace: str) -> None:
    spec = TableSpec("t0", dim=4, num_embeddings=100)
    a = RedisKV(url, namespace=namespace + "-a")
    b = RedisKV(url, namespace=namespace + "-b")
    a.init_table(spec)
    b.init_table(dataclasses.replace(spec, dim=8))  # same table name, another model: fine
    a.put("t0", torch.tensor([1, 2]), torch.ones(2, 4))
    assert torch.equal(
        b.get("t0", torch.tensor([1])), _host(b.table_spec("t0")).get("t0", torch.tensor([1]))
    )
    assert _export(b, "t0")[0].tolist() == [1]
    assert _export(a, "t0")[0].tolist() == [1, 2]


def test_dim_mismatch_across_clients_is_a_clear_error(url: str, namespace: str) -> None:
    first = RedisKV(url, namespace=namespace, owner="one-job")
    first.init_table(TableSpec("t0", dim=8, num_embeddings=100))
    second = RedisKV(url, namespace=namespace, owner="one-job")
    with pytest.raises(ValueError, match=r"dim=8 on the server.*dim=16.*namespace"):
        second.init_table(TableSpec("t0", dim=16, num_embeddings=100))
    with pytest.raises(ValueError, match="num_embeddings=100 on the server"):
        second.init_table(TableSpec("t0", dim=8, num_embeddings=None))
    with pytest.raises(ValueError, match="dim=8 here"):
        first.init_table(TableSpec("t0", dim=9, num_embeddings=100))
    second.init_table(TableSpec("t0", dim=8, num_embeddings=100))  # the same spec attaches


@pytest.mark.parametrize(
    "new_state", [(2, 0.5), (0, 0.0), (1, 0.0)], ids=["grow", "drop", "shrink"]
)
def test_redeclare_with_state_keeps_weights(
    url: str, namespace: str, new_state: tuple[int, float]
) -> None:
    old = TableSpec("t0", dim=5, num_embeddings=300, state_dim=1, state_init=0.25)
    new = dataclasses.replace(old, state_dim=new_state[0], state_init=new_state[1])
    kv = RedisKV(url, namespace=namespace, chunk_rows=16)  # several chunks of rewrite
    kv.init_table(old)
    host = _host(old)
    ids = torch.arange(0, 300, 3)
    rows = torch.randn(ids.numel(), old.row_width)
    for store in (kv, host):
        store.put("t0", ids, rows)
        store.get("t0", torch.arange(1, 40, 3))
        store.init_table(new)
    assert torch.equal(_export(kv, "t0")[0], _export(host, "t0")[0])
    assert torch.equal(_export(kv, "t0")[1], _export(host, "t0")[1])
    assert torch.equal(kv.get("t0", ids)[:, :5], rows[:, :5])
    # Another client attaching with the old layout resets the state again (the protocol's
    # re-declare); one still holding the old layout is told, not handed misshapen rows. A
    # weights-only declaration ("drop") is a view of the rows, which keep their layout and
    # state (issue 45, finding 3): its client reads the weights whatever the layout.
    stale = RedisKV(url, namespace=namespace, owner=kv.owner)
    stale.init_table(new)
    stale.init_table(old)
    if new.state_dim == 0:
        assert torch.equal(kv.get("t0", ids[:3]), rows[:3, :5])
    elif new.row_width != old.row_width:
        with pytest.raises(RuntimeError, match="re-declared"):
            kv.get("t0", ids[:3])
    else:  # same width: the rows read fine, with the state the last declaration set
        assert bool((kv.get("t0", ids[:3])[:, 5:] == old.state_init).all())


def test_export_import_round_trip(url: str, namespace: str) -> None:
    spec = TableSpec("t0", dim=6, num_embeddings=5000, state_dim=2)
    kv = RedisKV(url, namespace=namespace, chunk_rows=64)
    kv.init_table(spec)
    host = _host(spec)
    ids = _some_ids(spec, 500, seed=1)
    rows = torch.randn(300, spec.row_width)
    for store in (kv, host):
        store.get("t0", ids)
        store.put("t0", ids[:300], rows)
    chunks = list(kv.export_rows("t0", chunk_rows=77))
    assert all(c[0].numel() <= 77 for c in chunks)
    exported_ids, exported_rows = _export(kv, "t0", chunk_rows=77)
    assert torch.equal(exported_ids, torch.sort(ids).values)  # ascending across all chunks
    host_ids, host_rows = _export(host, "t0")
    assert torch.equal(exported_ids, host_ids) and torch.equal(exported_rows, host_rows)
    # Import into another namespace (a restore) gives the same table.
    restored = RedisKV(url, namespace=namespace + "-restored")
    restored.init_table(spec)
    for chunk_ids, chunk_rows in chunks:
        restored.import_rows("t0", chunk_ids, chunk_rows)
    assert torch.equal(_export(restored, "t0")[1], exported_rows)
    assert restored.io_stats()["rows_written"] == 0  # checkpoints are not traffic
    assert kv.row_count("t0") == restored.row_count("t0") == host.row_count("t0") == 500


def test_export_skips_tables_with_similar_names(server: RedisServer) -> None:
    kv = RedisKV(server.url)
    for name in ("t", "t:1", "t*", "[t]"):
        kv.init_table(TableSpec(name, dim=2, num_embeddings=100))
    for k, name in enumerate(("t", "t:1", "t*", "[t]")):
        kv.put(name, torch.tensor([k, 50 + k]), torch.full((2, 2), float(k)))
    for k, name in enumerate(("t", "t:1", "t*", "[t]")):
        ids, rows = _export(kv, name)
        assert ids.tolist() == [k, 50 + k] and bool((rows == k).all())


def test_chunking_bounds_each_round_trip(server: RedisServer) -> None:
    spec = TableSpec("t0", dim=3, num_embeddings=1000)
    kv = RedisKV(server.url, chunk_rows=5)
    kv.init_table(spec)
    raw = server.client()
    raw.config_resetstat()
    ids = torch.randperm(1000)[:23]
    assert torch.equal(kv.get("t0", ids), _host(spec).get("t0", ids))
    rows = torch.randn(23, 3)
    kv.put("t0", ids, rows)
    assert torch.equal(kv.get("t0", ids), rows)
    stats = raw.info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 2 * 5  # two gets of ceil(23 / 5) chunks
    assert stats["cmdstat_eval"]["calls"] == 5  # one fenced write script per written chunk
    assert stats["cmdstat_mset"]["calls"] == 5  # (commands run by a script count too)
    assert stats["cmdstat_msetnx"]["calls"] == 5  # new rows created by chunk, MSETNX
    assert "cmdstat_set" not in stats  # no race, so no key-by-key creation
    assert stats["cmdstat_incr"]["calls"] == 5  # each written chunk bumps the write mark
    # Each read chunk checks the mark and the fence first; each write script the fence.
    assert stats["cmdstat_get"]["calls"] == 2 * 5 * 2 + 5
    # The rows, the table's spec, write mark, fence and lease, the tier id, the open jobs.
    assert raw.dbsize() == 23 + 7 - 1


def test_key_layout(server: RedisServer) -> None:
    kv = RedisKV(server.url, namespace="m1")
    kv.init_table(TableSpec("t0", dim=2, num_embeddings=1000, seed=7))
    kv.put("t0", torch.tensor([300]), torch.tensor([[1.5, -2.0]]))
    keys = sorted(server.client().keys("*"))
    assert keys[:6] == [
        b"m1:fence:t0", b"m1:jobs", b"m1:lease:t0", b"m1:meta:t0", b"m1:seq:t0", b"m1:tier"
    ]  # fmt: skip
    keys = keys[3:]
    assert keys[3].startswith(b"m1:{") and keys[3].endswith(b".44}:t0:300")  # 300 % 256
    assert server.client().get(keys[3]) == torch.tensor([1.5, -2.0]).numpy().tobytes()
    assert server.client().get(b"m1:seq:t0") == b"1"  # one write acknowledged


def test_racing_creators_keep_one_value(url: str, namespace: str) -> None:
    """Two clients whose init functions differ create the same rows at once: each row ends up
    with one of the two values, and both clients return that one."""
    ids = torch.arange(2000)
    results: dict[float, torch.Tensor] = {}

    def create(fill: float) -> None:
        kv = RedisKV(url, namespace=namespace, chunk_rows=100, owner="one-job")
        kv.init_table(
            TableSpec(
                "t0", dim=2, num_embeddings=2000, init=lambda i, d: torch.full((i.numel(), d), fill)
            )
        )
        results[fill] = kv.get("t0", ids)

    threads = [threading.Thread(target=create, args=(fill,)) for fill in (1.0, 2.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.equal(results[1.0], results[2.0])
    assert set(results[1.0].unique().tolist()) <= {1.0, 2.0}


def test_creation_keeps_rows_another_client_made(url: str, namespace: str) -> None:
    """Rows that exist are never overwritten by creation: when part of a batch exists, the
    rest is created key by key and the existing rows keep their values."""
    first = RedisKV(url, namespace=namespace, owner="one-job")
    first.init_table(TableSpec("t0", dim=2, num_embeddings=100))
    made = first.get("t0", torch.arange(10))
    second = RedisKV(url, namespace=namespace, owner="one-job")
    second.init_table(
        TableSpec(
            "t0", dim=2, num_embeddings=100, init=lambda i, d: torch.full((i.numel(), d), 7.0)
        )
    )
    rows = second.get("t0", torch.arange(5, 15))
    assert torch.equal(rows[:5], made[5:])
    assert bool((rows[5:] == 7.0).all())
    assert second.io_stats()["rows_created"] == 5


def test_threads_share_one_client(url: str, namespace: str) -> None:
    spec = TableSpec("t0", dim=4, num_embeddings=4000)
    kv = RedisKV(url, namespace=namespace, chunk_rows=50)
    kv.init_table(spec)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            ids = torch.arange(k, 4000, 8)
            rows = torch.full((ids.numel(), 4), float(k))
            kv.put("t0", ids, rows)
            assert torch.equal(kv.get("t0", ids), rows)
        except BaseException as err:  # reported below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert kv.io_stats()["rows_written"] == 4000


# -- cluster ---------------------------------------------------------------------------------


def test_cluster_matches_single_server_and_spreads_keys(
    server: RedisServer, cluster: RedisClusterNodes, namespace: str
) -> None:
    spec = TableSpec("t0", dim=9, num_embeddings=100_000, state_dim=1, state_init=0.5)
    single = RedisKV(server.url, namespace=namespace, chunk_rows=333)
    spread = RedisKV(cluster.url, namespace=namespace, chunk_rows=333)
    assert spread.cluster and not single.cluster
    g = torch.Generator().manual_seed(5)
    before = cluster.dbsizes()
    for kv in (single, spread):
        kv.init_table(spec)
    for step in range(4):
        ids = torch.randperm(100_000, generator=g)[:700]
        rows = torch.randn(700, spec.row_width, generator=g)
        assert torch.equal(single.get("t0", ids), spread.get("t0", ids)), step
        single.put("t0", ids[::2], rows[::2])
        spread.put("t0", ids[::2], rows[::2])
    for a, b in zip(_export(single, "t0"), _export(spread, "t0"), strict=True):
        assert torch.equal(a, b)
    added = [after - prior for after, prior in zip(cluster.dbsizes(), before, strict=True)]
    assert all(n > 0 for n in added), added  # keys on every node, not one hash tag
    marks = sum(len(node.client().keys(f"{namespace}:seq:*")) for node in cluster.nodes)
    assert 200 < marks <= 256  # a write mark per bucket written, beside its rows
    fences = sum(len(node.client().keys(f"{namespace}:fence:*")) for node in cluster.nodes)
    assert fences == 256  # the table's epoch, beside every bucket's rows
    # + the spec record, the lease, the namespace record and the open jobs
    assert sum(added) == _export(spread, "t0")[0].numel() + marks + fences + 4


# -- open_store --------------------------------------------------------------------------------


def test_open_store_forms(server: RedisServer) -> None:
    assert isinstance(open_store(None), HostKV)
    assert isinstance(open_store("host"), HostKV)
    given = HostKV(pin_memory=False)
    assert open_store(given) is given
    kv = open_store(server.url + "?namespace=m2&chunk_rows=7&retry_timeout_s=1.5")
    assert isinstance(kv, RedisKV)
    assert (kv.namespace, kv.chunk_rows, kv.retry_timeout_s) == ("m2", 7, 1.5)
    tiered = open_store("tiered+" + server.url + "?capacity_rows=10")
    assert isinstance(tiered, TieredKV) and tiered.capacity_rows == 10
    assert isinstance(tiered.back, RedisKV)
    for bad in ("memcached://x", "hosts", "redis:/x", 42):
        with pytest.raises(ValueError, match="accepted forms"):
            open_store(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_rows"):
        open_store(server.url + "?capacity_rows=5")
    with pytest.raises(ValueError, match="chunk_rows"):
        open_store(server.url + "?chunk_rows=many")


def test_open_store_cluster(cluster: RedisClusterNodes, namespace: str) -> None:
    kv = open_store(f"{cluster.url}?namespace={namespace}")
    assert isinstance(kv, RedisKV) and kv.cluster
    tiered = open_store(f"tiered+{cluster.url}?namespace={namespace}")
    assert isinstance(tiered, TieredKV) and tiered.back.cluster  # type: ignore[attr-defined]


# -- faults ----------------------------------------------------------------------------------


def test_server_down_at_start_fails_fast_naming_the_url() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    start = time.monotonic()
    with pytest.raises(TierUnavailableError, match=url.replace("/", r"\/").replace(".", r"\.")):
        RedisKV(url, retry_timeout_s=30)
    with pytest.raises(TierUnavailableError, match="cannot reach"):
        open_store(f"tiered+{url}")
    assert time.monotonic() - start < 5
    assert issubclass(TierUnavailableError, ConnectionError)


def test_password_is_not_in_errors() -> None:
    url = f"redis://user:secret@127.0.0.1:{free_port()}/0"
    with pytest.raises(TierUnavailableError) as caught:
        RedisKV(url)
    assert "secret" not in str(caught.value) and "***" in str(caught.value)


def test_server_lost_mid_run_raises_within_the_retry_budget(server: RedisServer) -> None:
    kv = RedisKV(server.url, retry_timeout_s=FAST_RETRY_S)
    kv.init_table(TableSpec("emb", dim=4, num_embeddings=100))
    kv.put("emb", torch.arange(10), torch.ones(10, 4))
    server.stop()
    for op, call in (
        ("put", lambda: kv.put("emb", torch.arange(10), torch.zeros(10, 4))),
        ("get", lambda: kv.get("emb", torch.arange(3))),
    ):
        start = time.monotonic()
        with pytest.raises(TierUnavailableError) as caught:
            call()
        elapsed = time.monotonic() - start
        assert FAST_RETRY_S <= elapsed < FAST_RETRY_S + 2.0, elapsed
        message = str(caught.value)
        assert server.url in message and "'emb'" in message and op in message, message


def test_retries_ride_out_a_restart(server: RedisServer) -> None:
    """A put issued while the server is down succeeds once it is back (within the budget), and
    the table's spec is recorded again on the new, empty server."""
    spec = TableSpec("t0", dim=4, num_embeddings=100)
    kv = RedisKV(server.url, retry_timeout_s=10)
    kv.init_table(spec)
    server.stop()
    restart = threading.Timer(0.4, server.start)
    restart.start()
    try:
        kv.put("t0", torch.arange(5), torch.full((5, 4), 3.0))
    finally:
        restart.join()
    check = RedisKV(server.url, owner=kv.owner)
    with pytest.raises(ValueError, match="dim=4 on the server"):
        check.init_table(TableSpec("t0", dim=5, num_embeddings=100))
    check.init_table(spec)
    assert torch.equal(check.get("t0", torch.arange(5)), torch.full((5, 4), 3.0))


def test_tiered_keeps_dirty_rows_through_an_outage(server: RedisServer) -> None:
    """With the server gone, TieredKV still holds every dirty row: a flush and an eviction both
    fail and drop nothing; after a restart (persistence off, so the server is empty) a flush
    writes every one of them."""
    spec = TableSpec("t0", dim=3, num_embeddings=1000, state_dim=1)
    tiered = TieredKV(RedisKV(server.url, retry_timeout_s=FAST_RETRY_S), capacity_rows=16)
    tiered.init_table(spec)
    ids = torch.arange(0, 40, 4)  # 10 rows, all held dirty
    rows = torch.randn(10, 4)
    tiered.put("t0", ids, rows)
    server.stop()
    with pytest.raises(TierUnavailableError):
        tiered.flush()
    more_ids = torch.arange(100, 110)  # 20 held > 16: the eviction's write-back fails
    more_rows = torch.randn(10, 4)
    with pytest.raises(TierUnavailableError):
        tiered.put("t0", more_ids, more_rows)
    assert tiered.held_rows() == 20 and tiered.dirty_rows() == 20  # nothing dropped
    server.start()
    tiered.flush()
    assert tiered.dirty_rows() == 0
    check = RedisKV(server.url, owner=tiered.back.owner)  # type: ignore[attr-defined]
    check.init_table(spec)
    all_ids = torch.cat([ids, more_ids])
    exported_ids, exported_rows = _export(check, "t0")
    assert torch.equal(exported_ids, all_ids)
    assert torch.equal(exported_rows, torch.cat([rows, more_rows]))
    tiered.get("t0", torch.tensor([999]))  # the next call brings it back within capacity
    assert tiered.held_rows() <= 16
