"""Tiers that remember, on real redis-server processes: a run that says which tier state it
continues from is refused when the server came back empty, older or different; an eviction
policy switched on while a job runs stops it at the next check; rows deleted behind the job are
`TierDataLossError`, never rows re-created from their initial values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import embcache
from embcache.kv.base import TableSpec
from embcache.kv.errors import TierConfigError, TierDataLossError
from embcache.kv.redis_kv import RedisKV
from embcache.kv.tier_state import TableState, TierState, WrittenIds, expect_tier_state, tier_state
from tests.kv.redis_servers import RedisServer, running_server
from tests.test_redis_training import batches, build, step

SPEC = TableSpec("t0", dim=3, num_embeddings=100)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path) as started:
        yield started


def _first_run(url: str, n: int = 3) -> TierState:
    """A run that trains ``n`` batches, flushes, records the tier state and ends."""
    store = embcache.open_store(url)
    ebc, opt = build(store)
    for kjt in batches(n):
        step(ebc, opt, kjt)
    ebc.flush()
    state = tier_state(store)
    assert state is not None
    store.close()
    return state


def _next_run(url: str, state: TierState) -> tuple[object, object]:
    """A later run that says it continues from ``state`` (as the CLI hands it back from its
    run directory: through JSON) before declaring its tables."""
    store = embcache.open_store(url)
    expect_tier_state(store, json.loads(json.dumps(state.to_dict())))
    return build(store)


def test_a_run_continues_from_the_tier_it_left(server: RedisServer) -> None:
    state = _first_run(server.url)
    assert state.tier_id and state.generation > 0 and state.rows and state.rows > 0
    assert "continued from" in state.summary() and f"{state.rows:,} rows" in state.summary()
    ebc, opt = _next_run(server.url, state)
    for kjt in batches(2):
        step(ebc, opt, kjt)  # type: ignore[arg-type]
    ebc.flush()  # type: ignore[attr-defined]
    later = tier_state(ebc.store)  # type: ignore[attr-defined]
    assert later.tier_id == state.tier_id and later.generation > state.generation


def test_an_empty_namespace_says_so(server: RedisServer) -> None:
    kv = RedisKV(server.url, namespace="fresh")
    kv.init_table(SPEC)
    assert "started on an empty namespace" in kv.tier_state().summary()
    tiered = embcache.open_store(f"tiered+{server.url}?namespace=fresh")
    assert tier_state(tiered).tier_id == kv.tier_state().tier_id  # type: ignore[union-attr]
    assert tier_state(embcache.HostKV()) is None
    expect_tier_state(embcache.HostKV(), kv.tier_state())  # nothing kept between processes
    with pytest.raises(ValueError, match="namespace 'fresh'"):
        RedisKV(server.url, namespace="other").expect_state(kv.tier_state())


def test_a_server_restarted_empty_between_runs_is_refused(server: RedisServer) -> None:
    """The found case: Redis restarted empty between two runs, and the second run trained on
    re-created rows with the loss curve of a fresh run."""
    state = _first_run(server.url)
    server.restart()
    with pytest.raises(TierDataLossError) as caught:
        _next_run(server.url, state)
    message = str(caught.value)
    assert "namespace record" in message and "missing" in message and server.url in message
    assert state.tier_id in message and "from the last checkpoint" in message, message
    assert server.client().dbsize() == 0, "refused before writing anything"


def test_a_server_back_from_an_older_snapshot_between_runs_is_refused(
    server: RedisServer,
) -> None:
    kv = RedisKV(server.url)
    kv.init_table(SPEC)
    kv.put("t0", torch.arange(10), torch.ones(10, 3))
    assert server.client().save()
    kv.put("t0", torch.arange(10), torch.full((10, 3), 2.0))
    state = kv.tier_state()
    kv.close()
    server.kill()
    server.start()  # loads the snapshot: the record is there, one write is not
    again = RedisKV(server.url, owner=kv.owner)  # the snapshot holds the old lease
    again.expect_state(state)
    with pytest.raises(TierDataLossError, match=r"write mark \S+ is 1, the earlier run left 2"):
        again.init_table(SPEC)
    with pytest.raises(TierDataLossError):
        again.get("t0", torch.arange(3))  # and it stays refused


def test_a_namespace_written_again_is_another_tier(server: RedisServer) -> None:
    state = _first_run(server.url)
    server.client().flushall()
    _first_run(server.url)  # a fresh start by some other run: a new tier id
    with pytest.raises(TierDataLossError, match="another tier"):
        _next_run(server.url, state)


def test_rows_deleted_between_runs_are_found(server: RedisServer) -> None:
    kv = RedisKV(server.url)
    kv.init_table(SPEC)
    kv.put("t0", torch.arange(20), torch.ones(20, 3))
    state = kv.tier_state()
    kv.close()
    raw = server.client()
    raw.delete(*list(raw.scan_iter(match="embcache:{*}:t0:1*")))  # ids 1, 10..19; marks kept
    again = RedisKV(server.url)
    again.expect_state(state)
    with pytest.raises(TierDataLossError, match=r"holds 9 rows, the earlier run left 20"):
        again.init_table(SPEC)


def test_rows_found_at_the_start_count_as_written(server: RedisServer) -> None:
    """Rows the earlier run left that go missing later in this run are a loss too."""
    kv = RedisKV(server.url)
    kv.init_table(SPEC)
    kv.put("t0", torch.arange(5), torch.ones(5, 3))
    state = kv.tier_state()
    kv.close()
    again = RedisKV(server.url)
    again.expect_state(state)
    again.init_table(SPEC)
    raw = server.client()
    raw.delete(*list(raw.scan_iter(match="embcache:{*}:t0:3")))
    with pytest.raises(TierDataLossError, match=r"1 row\(s\) written .* missing \(ids 3\)"):
        again.get("t0", torch.arange(5))


@pytest.mark.parametrize("op", ["get", "read", "export"])
def test_rows_deleted_behind_the_job_are_data_loss(server: RedisServer, op: str) -> None:
    """Row keys deleted with the write marks left: a read that finds a written row missing
    raises instead of re-creating it from its initial value."""
    kv = RedisKV(server.url)
    kv.init_table(SPEC)
    kv.put("t0", torch.arange(10), torch.full((10, 3), 2.0))
    raw = server.client()
    raw.delete(*list(raw.scan_iter(match="embcache:{*}:t0:7")))
    calls = {
        "get": lambda: kv.get("t0", torch.arange(20)),
        "read": lambda: kv.read("t0", torch.arange(20)),
        "export": lambda: list(kv.export_rows("t0")),
    }
    with pytest.raises(TierDataLossError, match=r"ids 7\)") as caught:
        calls[op]()
    assert "deleted behind this job" in str(caught.value)
    assert raw.keys("embcache:{*}:t0:7") == [], "not re-created"
    with pytest.raises(TierDataLossError):
        kv.get("t0", torch.arange(1))  # and it stays refused


def test_rows_deleted_behind_a_training_job_are_data_loss(server: RedisServer) -> None:
    store = RedisKV(server.url, namespace="f")
    ebc, opt = build(store)
    data = batches(8)
    for kjt in data[:4]:
        step(ebc, opt, kjt)
    ebc.flush()
    raw = server.client()
    raw.delete(*list(raw.scan_iter(match="f:{*}:t0:*")))  # every row of t0; marks kept
    with pytest.raises(TierDataLossError, match="'t0'"):
        for kjt in data[4:]:
            step(ebc, opt, kjt)
        ebc.flush()
        for t in ebc.tables:
            store.get(t.name, torch.arange(t.num_embeddings))


def test_a_policy_switched_to_eviction_mid_run_stops_the_job(server: RedisServer) -> None:
    """The found case: maxmemory-policy set to allkeys-lru while a job ran, and rows were
    re-created from their initial values. The policy is checked again every verify_interval_s
    and on each flush, not only when a table is declared."""
    raw = server.client()
    raw.config_set("maxmemory", 256 * 1024 * 1024)  # noeviction: a full server refuses writes
    store = RedisKV(server.url, namespace="f", verify_interval_s=0)
    ebc, opt = build(store)
    data = batches(6)
    for kjt in data[:3]:
        step(ebc, opt, kjt)
    raw.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(TierConfigError, match=r"allkeys-lru.*changed while this job runs"):
        for kjt in data[3:]:
            step(ebc, opt, kjt)
        ebc.flush()
    with pytest.raises(TierConfigError):  # every call, until the policy is fixed
        store.get("t0", torch.arange(3))
    raw.config_set("maxmemory-policy", "noeviction")
    store.get("t0", torch.arange(3))


def test_flush_checks_the_policy(server: RedisServer) -> None:
    raw = server.client()
    raw.config_set("maxmemory", 256 * 1024 * 1024)
    kv = RedisKV(server.url, verify_interval_s=3600)
    kv.init_table(SPEC)
    kv.put("t0", torch.arange(3), torch.ones(3, 3))
    raw.config_set("maxmemory-policy", "volatile-lru")
    kv.put("t0", torch.arange(3), torch.ones(3, 3))  # not checked yet: within the interval
    with pytest.raises(TierConfigError, match="owner leases"):
        kv.flush()


def test_tier_state_round_trips_and_refuses_damage() -> None:
    state = TierState("redis://h:1/0", "ns", "abc", {"t0": TableState((1, 2), 7)})
    assert TierState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    assert state.generation == 3 and state.rows == 7
    with pytest.raises(ValueError, match="damaged"):
        TierState.from_dict({**state.to_dict(), "tables": {"t0": {"marks": "x"}}})


@pytest.mark.parametrize("bound", [None, 1000], ids=["unbounded", "bounded"])
def test_written_ids(bound: int | None) -> None:
    written = WrittenIds(bound)
    for start in range(0, 900, 7):
        written.add(torch.arange(start, start + 3))
    written.discard(torch.tensor([7, 8]))
    ids = torch.tensor([0, 1, 3, 7, 9, 14, 999])
    assert written.contains(ids).tolist() == [True, True, False, False, True, True, False]
    assert written.ids()[:6].tolist() == [0, 1, 2, 9, 14, 15]
