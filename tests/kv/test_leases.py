"""Owner leases on real redis-server processes: a second job cannot open (and clobber) the
tables of a live one unless both share them on purpose; the same job reopens its own; a job that
dies frees its tables within the lease TTL; a job whose lease lapsed while it was paused is
told, not allowed to write over the job that took the tables."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import embcache
from embcache.kv.base import TableSpec
from embcache.kv.redis_kv import RedisKV
from tests.kv.redis_servers import RedisServer, running_server
from tests.test_redis_training import batches, step

JOB = Path(__file__).with_name("lease_job.py")
SPEC = TableSpec("t0", dim=2, num_embeddings=10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path) as started:
        yield started


def job(url: str, ttl_s: float, namespace: str = "lease") -> tuple[subprocess.Popen[str], str]:
    """`lease_job.py` holding table t0 of ``namespace`` in a process of its own, and its
    owner token."""
    proc = subprocess.Popen(
        [sys.executable, str(JOB), url, str(ttl_s), namespace],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()  # type: ignore[union-attr]
    return proc, proc.stdout.readline().strip()


def _collection(url: str, optimizer: type = embcache.SparseAdaGrad):
    from tests.test_redis_training import TABLES

    ebc = embcache.CachedEmbeddingBagCollection(
        tables=TABLES, cache=embcache.CacheConfig(load_factor=0.05, ways=4), store=url
    )
    return ebc, optimizer([ebc], lr=0.1)


def test_a_second_job_is_refused_and_changes_nothing(server: RedisServer) -> None:
    """Two jobs, same tables, default namespace: the second (with another optimizer, whose
    state layout would have reset the first's AdaGrad state) is refused before it touches a
    row, naming the namespace and sharing options."""
    first, opt = _collection(server.url)
    for kjt in batches(3):
        step(first, opt, kjt)
    first.flush()
    before = {t.name: first.table_rows(t.name) for t in first.tables}
    with pytest.raises(embcache.TierOwnershipError) as caught:
        _collection(server.url, embcache.SparseSGD)
    message = str(caught.value)
    assert "namespace" in message and "shared" in message and server.url in message, message
    assert f"pid {os.getpid()}" in message, "the holder is named"
    for name, rows in before.items():
        assert torch.equal(first.table_rows(name), rows), f"table {name} was changed"
    first.store.close()


def test_shared_is_read_only(server: RedisServer) -> None:
    """``?shared=1`` opens tables read-only beside the job that trains them: it reads that
    job's current rows, creates nothing, and every write is refused with what to do instead
    (two writers would overwrite each other's updates with whole rows)."""
    writer = RedisKV(server.url)
    writer.init_table(SPEC)
    writer.put("t0", torch.tensor([3]), torch.full((1, 2), 5.0))
    reader = RedisKV(server.url, shared=True)
    reader.init_table(SPEC)  # beside a live exclusive job: no lease taken
    assert torch.equal(reader.get("t0", torch.tensor([3])), torch.full((1, 2), 5.0))
    keys = server.client().dbsize()
    assert torch.equal(reader.get("t0", torch.arange(4, 8)), writer.read("t0", torch.arange(4, 8)))
    assert server.client().dbsize() == keys, "a read-only client creates no rows"
    writes = {
        "put": lambda: reader.put("t0", torch.tensor([3]), torch.zeros(1, 2)),
        "import_rows": lambda: reader.import_rows("t0", torch.tensor([3]), torch.zeros(1, 2)),
        "remove": lambda: reader.remove("t0", torch.tensor([3])),
    }
    for op, write in writes.items():
        with pytest.raises(embcache.TierOwnershipError, match="read-only") as caught:
            write()
        message = str(caught.value)
        assert op in message and "owner" in message and "namespace" in message, message
    writer.put("t0", torch.tensor([3]), torch.full((1, 2), 6.0))
    assert torch.equal(reader.get("t0", torch.tensor([3])), torch.full((1, 2), 6.0))
    # Another state layout opens too (issue 45, finding 3): the weights, its own fresh state.
    other = RedisKV(server.url, shared=True)
    other.init_table(TableSpec("t0", dim=2, num_embeddings=10, state_dim=1, state_init=0.5))
    assert torch.equal(other.get("t0", torch.tensor([3])), torch.tensor([[6.0, 6.0, 0.5]]))
    assert embcache.open_store(f"{server.url}?shared=1").shared  # type: ignore[attr-defined]


def test_a_second_training_job_on_shared_tables_is_refused_not_lost(server: RedisServer) -> None:
    """Two jobs training one table with ?shared=1 lost 3,006 of 5,000 rows' updates when
    each write-back overwrote the other's: the second job is now told at its first
    write-back, and the first job's rows are exactly what it wrote."""
    first, opt = _collection(server.url)
    for kjt in batches(3):
        step(first, opt, kjt)
    first.flush()
    before = {t.name: first.table_rows(t.name) for t in first.tables}
    with pytest.raises(embcache.TierOwnershipError, match="read-only"):
        # Refused at once (the collection declares its tables before the optimizer's state
        # layout) or at the latest at its first write-back.
        second, opt2 = _collection(f"{server.url}?shared=1")
        for kjt in batches(3):
            step(second, opt2, kjt)
        second.flush()
    for name, rows in before.items():
        assert torch.equal(first.table_rows(name), rows), f"table {name} was changed"
    first.store.close()


def test_the_same_owner_reopens_and_close_frees(server: RedisServer) -> None:
    first = RedisKV(server.url)
    first.init_table(SPEC)
    again = RedisKV(server.url, owner=first.owner)  # another rank of the same job
    again.init_table(SPEC)
    other = RedisKV(server.url)
    with pytest.raises(embcache.TierOwnershipError):
        other.init_table(SPEC)
    first.close()  # deletes the exclusive lease it holds
    other.init_table(SPEC)


def test_a_dead_job_frees_its_tables_within_the_ttl(server: RedisServer) -> None:
    ttl = 1.0
    proc, _ = job(server.url, ttl)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    kv = RedisKV(server.url, namespace="lease")
    with pytest.raises(embcache.TierOwnershipError, match=r"expires in \d"):
        kv.init_table(SPEC)  # the killed job's lease is still live
    deadline = time.monotonic() + ttl + 1.0
    while True:
        try:
            kv.init_table(SPEC)
            break
        except embcache.TierOwnershipError:
            assert time.monotonic() < deadline, "the dead job's lease must expire within its TTL"
            time.sleep(0.05)


def test_a_job_whose_lease_lapsed_is_told(server: RedisServer) -> None:
    """A job paused (SIGSTOP) past its TTL loses its tables to the next job; when it resumes,
    its next write is refused instead of clobbering the new owner's rows."""
    proc, _ = job(server.url, 0.6)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("put\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "ok"
    proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(1.0)
        taker = RedisKV(server.url, namespace="lease")
        taker.init_table(SPEC)
        taker.put("t0", torch.tensor([1]), torch.full((1, 2), 9.0))
    finally:
        proc.send_signal(signal.SIGCONT)
    proc.stdin.write("put\n")
    proc.stdin.flush()
    reply = proc.stdout.readline().strip()
    proc.stdin.close()
    proc.wait(timeout=10)
    assert reply.startswith("TierOwnershipError") and "lapsed" in reply, reply
    assert torch.equal(taker.get("t0", torch.tensor([1])), torch.full((1, 2), 9.0))


def test_lease_options_are_checked(server: RedisServer) -> None:
    for bad in ({"lease_ttl_s": 0}, {"lease_ttl_s": "1"}, {"owner": ""}, {"owner": "a\nb"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RedisKV(server.url, **bad)
    with pytest.raises(TypeError, match="shared"):
        RedisKV(server.url, shared=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shared=maybe"):
        embcache.open_store(f"{server.url}?shared=maybe")
