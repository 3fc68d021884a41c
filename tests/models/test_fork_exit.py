"""A child forked from a training process leaves the tier alone when it exits normally.

The child inherits the collection's exit hooks with a copy of the cache, whose dirty rows are
older than what the parent writes after the fork. Run against a real redis-server (the tier
both processes reach), the parent trains, forks, flushes and trains on; the child then exits
through the interpreter's normal shutdown (atexit runs). The tier must hold the parent's rows,
and the parent must still hold its tables' leases."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import embcache
from embcache.kv.url import open_store
from tests.kv.redis_servers import RedisServer, running_server

ROOT = Path(__file__).resolve().parents[2]

TABLE = {"name": "t0", "embedding_dim": 4, "num_embeddings": 30, "feature_names": ["f0"]}

# argv: tier URL, output file, a URL of the same namespace under another owner. The parent
# trains two steps (rows dirty in its cache), forks, then flushes, trains two more steps and
# flushes again before letting the child exit; after the child is gone it tries to open the
# table as another job would (refused while its own lease stands) and saves its rows.
JOB = """
import os, sys, torch, embcache
from embcache.kv.errors import TierOwnershipError
from embcache.kv.url import open_store

url, out, other = sys.argv[1:4]
TABLE = %r
ebc = embcache.CachedEmbeddingBagCollection(tables=[TABLE], store=url, seed=0)
opt = embcache.SparseAdaGrad([ebc], lr=0.1)
gen = torch.Generator().manual_seed(5)

def train(steps):
    for _ in range(steps):
        values = torch.randint(0, 30, (12,), generator=gen)
        batch = embcache.JaggedBatch.from_lengths(["f0"], values, torch.full((4,), 3))
        ebc(batch).values().square().sum().backward()
        opt.step()

train(2)
read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(write_end)
    os.read(read_end, 1)
    sys.exit(0)  # the interpreter's normal exit: atexit hooks run in the child
os.close(read_end)
ebc.flush()
train(2)
ebc.flush()
os.write(write_end, b"x")
_, status = os.waitpid(pid, 0)
try:
    with open_store(other) as kv:
        kv.init_table(ebc.store.table_spec("t0"))
    lease = "lost"
except TierOwnershipError:
    lease = "held"
torch.save({"rows": ebc.table_rows("t0"), "lease": lease, "child": status}, out)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis")) as started:
        yield started


def test_a_forked_child_exiting_normally_writes_nothing_back(
    server: RedisServer, tmp_path: Path
) -> None:
    namespace = f"fork-{uuid.uuid4().hex[:8]}"
    url = f"{server.url}?namespace={namespace}"
    other = f"{url}&owner=another-job"
    out = tmp_path / "parent.pt"
    proc = subprocess.run(
        [sys.executable, "-c", JOB % (TABLE,), url, str(out), other],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    saved = torch.load(out)
    assert saved["child"] == 0, proc.stderr
    assert saved["lease"] == "held", "the child's exit released the parent's lease"
    # The tier as the next job finds it (the parent exited normally: its leases are free).
    twin = embcache.CachedEmbeddingBagCollection(tables=[TABLE], store=embcache.HostKV(), seed=0)
    embcache.SparseAdaGrad([twin], lr=0.1)
    with open_store(url) as kv:
        spec = twin.store.table_spec("t0")
        kv.init_table(spec)
        rows = spec.to_float(kv.read("t0", torch.arange(TABLE["num_embeddings"])))
    assert torch.equal(rows, saved["rows"]), "the child's exit rolled the parent's rows back"
