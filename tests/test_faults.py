"""Fault injection against real redis-server processes while a collection trains: every fault
ends in the exact weights of a run on the host tier, or in a clear error; never in rows silently
re-created from their initial values.

| fault                                   | persistence        | expected                      |
|-----------------------------------------|--------------------|-------------------------------|
| kill -9, restart                        | AOF always         | exact                         |
| kill -9, restart empty                  | none               | TierDataLossError             |
| restart from an older RDB snapshot      | RDB (SAVE)         | TierDataLossError             |
| SIGSTOP shorter than the retry budget   | none               | exact                         |
| SIGSTOP longer than the retry budget    | none               | TierUnavailableError, retried |
|                                         |                    | batch then exact              |
| cluster node kill -9, restarted empty   | none               | TierDataLossError             |
| cluster node kill -9, not restarted     | none               | TierUnavailableError          |

Each runs in a few seconds: small tables, short retry budgets.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import embcache
from embcache.kv.redis_kv import RedisKV
from tests.kv.redis_servers import (
    RedisServer,
    running_cluster,
    running_server,
    wait_cluster_ok,
)
from tests.test_redis_training import batches, build, step

STEPS = 8
FAULT_AT = 4


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """Every row (weights and AdaGrad state) after STEPS batches on the host tier."""
    ebc, opt = build(embcache.HostKV())
    for kjt in batches(STEPS):
        step(ebc, opt, kjt)
    return {t.name: ebc.table_rows(t.name) for t in ebc.tables}


def run_with_fault(store: RedisKV, fault: Callable[[], None]) -> dict[str, torch.Tensor]:
    """Train STEPS batches, injecting ``fault`` before batch FAULT_AT; a batch that fails with
    TierUnavailableError is run again once (the retriable contract). Returns every row."""
    ebc, opt = build(store)
    data = batches(STEPS)
    for kjt in data[:FAULT_AT]:
        step(ebc, opt, kjt)
    assert sum(int(c.dirty.sum()) for c in ebc.caches()) > 0, "unwritten updates must be cached"
    fault()
    for kjt in data[FAULT_AT:]:
        try:
            step(ebc, opt, kjt)
        except embcache.TierUnavailableError:
            opt.zero_grad()
            step(ebc, opt, kjt)
    ebc.flush()
    return {t.name: ebc.table_rows(t.name) for t in ebc.tables}


def assert_exact(rows: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    for name, expected in reference.items():
        assert torch.equal(rows[name], expected), f"table {name} differs from the host tier run"


def assert_loss_reported(store: RedisKV, fault: Callable[[], None], url: str) -> None:
    with pytest.raises(embcache.TierDataLossError) as caught:
        run_with_fault(store, fault)
    message = str(caught.value)
    assert url in message and "resume from the last checkpoint" in message, message
    assert "table 't" in message, message
    # The store stays refusing: no later call may quietly carry on over the lost rows.
    table = re.search(r"writes of table '(\w+)'", message)
    assert table, message
    with pytest.raises(embcache.TierDataLossError):
        store.get(table[1], torch.tensor([0]))


def test_kill9_with_aof_always_is_exact(tmp_path: Path, reference) -> None:
    aof = ("--appendonly", "yes", "--appendfsync", "always")
    with running_server(tmp_path, extra_args=aof) as server:
        store = RedisKV(server.url, namespace="f", retry_timeout_s=5)

        def crash_and_restart() -> None:
            server.kill()
            server.start()  # same port, same directory: the AOF is replayed

        assert_exact(run_with_fault(store, crash_and_restart), reference)
        store.close()


def test_kill9_restart_empty_is_data_loss(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        store = RedisKV(server.url, namespace="f", retry_timeout_s=5)

        def crash_and_restart_empty() -> None:
            server.kill()
            server.start()

        assert_loss_reported(store, crash_and_restart_empty, server.url)


def test_restart_from_an_older_snapshot_is_data_loss(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        store = RedisKV(server.url, namespace="f", retry_timeout_s=5)
        ebc, opt = build(store)
        data = batches(STEPS)
        step(ebc, opt, data[0])
        ebc.flush()
        assert server.client().save()  # dump.rdb: the state after one batch
        for kjt in data[1:FAULT_AT]:
            step(ebc, opt, kjt)
        ebc.flush()  # acknowledged writes beyond the snapshot
        server.kill()
        server.start()  # loads dump.rdb: older than what was acknowledged
        assert server.client().dbsize() > 0, "the snapshot must hold the early rows"
        with pytest.raises(embcache.TierDataLossError, match=r"lost acknowledged writes"):
            for kjt in data[FAULT_AT:]:
                step(ebc, opt, kjt)
            ebc.flush()


def test_pause_within_the_retry_budget_is_exact(tmp_path: Path, reference) -> None:
    with running_server(tmp_path) as server:
        # A pause several socket timeouts long, well inside the retry budget; neither number is
        # near what a busy machine takes to answer a normal call.
        store = RedisKV(server.url, namespace="f", retry_timeout_s=60, socket_timeout_s=1.0)

        def pause_briefly() -> None:
            server.pause()
            threading.Timer(3.0, server.resume).start()

        assert_exact(run_with_fault(store, pause_briefly), reference)


def test_pause_beyond_the_retry_budget_fails_then_retries_exactly(
    tmp_path: Path, reference
) -> None:
    with running_server(tmp_path) as server:
        # The pause outlasts the retry budget by far; the budget and the socket timeout are far
        # beyond what a loaded machine takes for a normal call (the steps before the pause).
        store = RedisKV(server.url, namespace="f", retry_timeout_s=2.0, socket_timeout_s=1.0)
        ebc, opt = build(store)
        data = batches(STEPS)
        for kjt in data[:FAULT_AT]:
            step(ebc, opt, kjt)
        server.pause()
        resume = threading.Timer(8.0, server.resume)
        resume.start()
        with pytest.raises(embcache.TierUnavailableError, match="unavailable"):
            ebc.flush()  # dirty rows to write: the tier is needed
        resume.join()
        ebc.flush()  # the same call again, the server back
        for kjt in data[FAULT_AT:]:
            step(ebc, opt, kjt)
        ebc.flush()
        assert_exact({t.name: ebc.table_rows(t.name) for t in ebc.tables}, reference)


def _cluster_store(cluster) -> RedisKV:
    return RedisKV(cluster.url, namespace="f", retry_timeout_s=5, socket_timeout_s=2.0)


def test_cluster_node_restarted_empty_is_data_loss(tmp_path: Path) -> None:
    with running_cluster(tmp_path, node_timeout_ms=1000) as cluster:
        store = _cluster_store(cluster)
        node: RedisServer = cluster.nodes[1]

        def lose_a_node() -> None:
            node.kill()
            node.start()  # same nodes.conf: same slots, no data
            wait_cluster_ok(cluster)

        assert_loss_reported(store, lose_a_node, cluster.url)


def test_cluster_node_down_is_a_clear_error(tmp_path: Path) -> None:
    with running_cluster(tmp_path, node_timeout_ms=1000) as cluster:
        store = _cluster_store(cluster)
        with pytest.raises(embcache.TierUnavailableError, match="unavailable") as caught:
            run_with_fault(store, cluster.nodes[2].kill)
        assert "\\x" not in str(caught.value), "no row bytes in the message"


def test_a_tier_error_inside_step_is_retriable(tmp_path: Path) -> None:
    """Scratch rows (a batch larger than its cache) are updated by the step; their write-back
    once failed inside ``opt.step()`` and left every later call raising "a slot that is not
    locked was unlocked". Now the step needs no tier, the write-back fails in the next call
    that does (cleanly), and the same call succeeds once the tier is back: exact results."""
    config = embcache.CacheConfig(capacity=8, ways=4)

    def small(store):
        from tests.test_redis_training import TABLES

        ebc = embcache.CachedEmbeddingBagCollection(
            tables=TABLES, cache=config, store=store, seed=0
        )
        return ebc, embcache.SparseAdaGrad([ebc], lr=0.1)

    ref, ref_opt = small(embcache.HostKV())
    for kjt in batches(STEPS):
        step(ref, ref_opt, kjt)
    expected = {t.name: ref.table_rows(t.name) for t in ref.tables}

    aof = ("--appendonly", "yes", "--appendfsync", "always")
    with running_server(tmp_path, extra_args=aof) as server:
        # The server is stopped, not paused: calls fail at once (connection refused), so the
        # budget only bounds the retries; a normal call under load never comes near either.
        store = RedisKV(server.url, namespace="f", retry_timeout_s=2.0, socket_timeout_s=10.0)
        ebc, opt = small(store)
        data = batches(STEPS)
        for kjt in data[:FAULT_AT]:
            step(ebc, opt, kjt)
        ebc(data[FAULT_AT]).values().square().sum().backward()
        assert any(c._scratch_used for c in ebc.caches()), "the batch must overflow to scratch"
        server.stop()
        opt.step()  # in-cache update: no tier call, nothing to fail
        with pytest.raises(embcache.TierUnavailableError, match="unavailable"):
            step(ebc, opt, data[FAULT_AT + 1])  # its resolve writes the scratch rows back
        opt.zero_grad()  # no "not locked" error
        with pytest.raises(embcache.TierUnavailableError):
            step(ebc, opt, data[FAULT_AT + 1])  # still down: still clean
        server.start()  # the AOF brings every acknowledged write back
        for kjt in data[FAULT_AT + 1 :]:
            step(ebc, opt, kjt)
        ebc.flush()
        assert_exact({t.name: ebc.table_rows(t.name) for t in ebc.tables}, expected)
