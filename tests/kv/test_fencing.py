"""One writer per table, on real redis-server processes (issue 45, finding 1): a job whose
lease was lost writes nothing more (every write and read checks the table's epoch on the
server, in the same script or round trip), and a resumed job never shares a live job's tables,
whatever token it was given: it takes over the tables of the job that wrote its checkpoint only
once that job is dead."""

from __future__ import annotations

import signal
import time
import uuid

import pytest
import torch

import embcache
from embcache.kv.base import TableSpec
from embcache.kv.redis_kv import RedisKV
from embcache.kv.redis_lease import lease_key
from tests.kv.redis_servers import RedisServer
from tests.kv.test_leases import job

SPEC = TableSpec("t0", dim=2, num_embeddings=10)


def _lose_lease(kv: RedisKV, table: str) -> None:
    """As if ``kv``'s lease had expired while its process was paused (the process has not
    noticed: its last renewal looks recent)."""
    key = lease_key(kv._ns, table, kv.cluster)
    assert kv._client.delete(key) == 1


def test_a_deposed_writer_writes_nothing(url: str) -> None:
    """Job A's lease lapses and job B takes the table and writes: A's next write, which
    before this change overwrote B's rows whole, is refused with one line naming the table
    and what to do, and B's rows stay B's."""
    namespace = f"fence-{uuid.uuid4().hex[:8]}"
    a = RedisKV(url, namespace=namespace, chunk_rows=4)
    a.init_table(SPEC)
    a.put("t0", torch.arange(10), torch.zeros(10, 2))
    _lose_lease(a, "t0")
    b = RedisKV(url, namespace=namespace)
    b.init_table(SPEC)
    b.put("t0", torch.arange(10), torch.full((10, 2), 7.0))
    with pytest.raises(embcache.TierOwnershipError) as caught:
        a.put("t0", torch.arange(10), torch.ones(10, 2))
    message = str(caught.value)
    assert "\n" not in message and "'t0'" in message and "taken over" in message, message
    assert "--resume" in message and "namespace" in message, message
    assert torch.equal(b.get("t0", torch.arange(10)), torch.full((10, 2), 7.0))
    with pytest.raises(embcache.TierOwnershipError):  # and stays refused, reads included
        a.get("t0", torch.arange(3))
    with pytest.raises(embcache.TierOwnershipError):
        a.remove("t0", torch.arange(3))
    assert torch.equal(b.get("t0", torch.arange(10)), torch.full((10, 2), 7.0))
    b.close()
    a.close()


def test_a_deposed_reader_is_told_not_handed_a_foreign_row(server: RedisServer) -> None:
    """The original symptom: B re-declared the table with another optimizer's state (rows of
    another width) and A died with "a row on the server has 64 bytes, expected 128". A is
    now told the table was taken over."""
    a = RedisKV(server.url)
    a.init_table(TableSpec("t0", dim=4, num_embeddings=100, state_dim=4))
    a.put("t0", torch.arange(5), torch.zeros(5, 8))
    _lose_lease(a, "t0")
    b = RedisKV(server.url)
    b.init_table(TableSpec("t0", dim=4, num_embeddings=100, state_dim=1))  # rewrites the rows
    with pytest.raises(embcache.TierOwnershipError, match="taken over"):
        a.get("t0", torch.arange(5))
    b.close()


def test_resuming_a_live_jobs_tables_is_refused(server: RedisServer) -> None:
    """A job started with the token of a live job's checkpoint (``takeover``) is refused
    before it changes anything, naming that job; the live job keeps writing."""
    proc, token = job(server.url, 30.0)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        with pytest.raises(embcache.TierOwnershipError) as caught:
            RedisKV(server.url, namespace="lease", takeover=token).init_table(SPEC)
        message = str(caught.value)
        assert "still held by the job that wrote the checkpoint" in message, message
        assert f"pid {proc.pid}" in message, message
        proc.stdin.write("put\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_jobs_tables_are_taken_over_at_once_and_fenced(server: RedisServer) -> None:
    """The job that wrote the checkpoint was SIGKILLed: the resumed job takes its tables at
    once (its pid no longer runs on this host), not a lease TTL later, under a new epoch."""
    proc, token = job(server.url, 30.0)
    held = server.client().get(b"lease:lease:t0")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    started = time.monotonic()
    resumed = RedisKV(server.url, namespace="lease", takeover=token)
    resumed.init_table(SPEC)
    assert time.monotonic() - started < 5.0
    now = server.client().get(b"lease:lease:t0")
    assert held is not None and now is not None and now.split(b"\n")[1] == resumed.owner.encode()
    old, new = held.rsplit(b"\n", 1)[1], now.rsplit(b"\n", 1)[1]
    assert old.startswith(b"1.") and new.startswith(b"2."), (old, new)  # t0's second epoch
    assert server.client().get(b"lease:fence:t0") == new
    resumed.put("t0", torch.tensor([1]), torch.ones(1, 2))
    resumed.close()


def test_ranks_of_one_job_share_its_epoch(server: RedisServer) -> None:
    """Two clients with one owner token (two ranks) both write; a third job cannot."""
    first = RedisKV(server.url, owner="job-1")
    second = RedisKV(server.url, owner="job-1")
    for kv in (first, second):
        kv.init_table(SPEC)
    first.put("t0", torch.tensor([1]), torch.ones(1, 2))
    second.put("t0", torch.tensor([2]), torch.ones(1, 2))
    with pytest.raises(embcache.TierOwnershipError):
        RedisKV(server.url, owner="job-2").init_table(SPEC)
    with pytest.raises(ValueError, match="takeover"):
        RedisKV(server.url, owner="job-1", takeover="job-1")
    first.close()
    second.close()
