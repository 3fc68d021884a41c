"""Nothing is lost at the end of a run: a collection writes its dirty cached rows back on
`close()`, on leaving ``with collection:``, and at the interpreter's exit, then closes the store
it opened (a Redis tier releases its owner leases, so the next job opens the tables at once).
The exit cases run a real training process against a real redis-server and read its rows from
the next process, as a job resumed after a normal exit would."""

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

# The first process: trains on the tier named by argv[1] (every trained row stays dirty in the
# cache, which holds the whole tables), writes the rows it expects the tier to end with (the
# same training on an in-process tier: `table_rows` would flush the Redis collection) and
# exits without flush() or close().
JOB = """
import gc, sys, torch, embcache
from embcache.kv.url import open_store

url, out, mode = sys.argv[1:4]
TABLES = [
    {"name": "t0", "embedding_dim": 6, "num_embeddings": 40, "feature_names": ["f0", "f1"]},
    {"name": "t1", "embedding_dim": 3, "num_embeddings": 25, "feature_names": ["f2"]},
]

def train(store):
    ebc = embcache.CachedEmbeddingBagCollection(tables=TABLES, store=store, seed=0)
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        lengths = torch.randint(0, 4, (3 * 5,), generator=gen)
        rows = torch.tensor([40, 40, 25]).repeat_interleave(5).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen) * rows).long()
        batch = embcache.JaggedBatch.from_lengths(["f0", "f1", "f2"], values, lengths)
        ebc(batch).values().square().sum().backward()
        opt.step()
    return ebc, opt

store = open_store(url) if mode.startswith("instance") else url
ebc, opt = train(store)
reference, _ = train(embcache.HostKV())
dirty = sum(int(c.dirty.sum()) for c in ebc.caches())
torch.save({"dirty": dirty, **{t: reference.table_rows(t) for t in ("t0", "t1")}}, out)
if mode.endswith("gc"):
    del ebc, opt
    gc.collect()
print("trained", flush=True)
sys.stdin.readline()  # the test may stop the server before this process exits
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis")) as started:
        yield started


def _url(server: RedisServer) -> str:
    return f"{server.url}?namespace=exit-{uuid.uuid4().hex[:8]}&retry_timeout_s=0.5"


def _run_job(url: str, tmp_path: Path, mode: str, before_exit=None) -> tuple[dict, str]:
    """Run `JOB`; returns what it saved and its stderr."""
    out = tmp_path / "expected.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", JOB, url, str(out), mode],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line == "trained\n", proc.communicate(timeout=60)[1]
        if before_exit is not None:
            before_exit()
        _, err = proc.communicate("exit\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return torch.load(out), err


def _reopened_rows(url: str) -> dict[str, torch.Tensor]:
    """The tables as the next job finds them in the tier, weights and AdaGrad state: opened at
    once (a lease still held would raise TierOwnershipError), declared with the job's specs
    (taken from the same collection on an in-process tier: a collection declaring them before
    its optimizer would reset the state columns it is meant to read)."""
    twin = embcache.CachedEmbeddingBagCollection(tables=_tables(), store=embcache.HostKV(), seed=0)
    embcache.SparseAdaGrad([twin], lr=0.1)
    with open_store(url) as kv:
        rows = {}
        for name in ("t0", "t1"):
            spec = twin.store.table_spec(name)
            kv.init_table(spec)
            rows[name] = spec.to_float(kv.read(name, torch.arange(spec.num_embeddings)))
        return rows


@pytest.mark.parametrize("mode", ["url", "instance"], ids=["store-opened-by-it", "store-given"])
def test_a_normal_exit_writes_back_every_row_and_frees_the_tables(
    server: RedisServer, tmp_path: Path, mode: str
) -> None:
    url = _url(server)
    expected, err = _run_job(url, tmp_path, mode)
    assert expected.pop("dirty") > 0, "the job must exit with unwritten rows for this to mean much"
    assert "embcache" not in err, err
    rows = _reopened_rows(url)
    for name, want in expected.items():
        assert torch.equal(rows[name], want), f"table {name}: rows lost at exit"


def test_a_failed_exit_write_back_says_so_in_one_line(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        expected, err = _run_job(_url(server), tmp_path, "url", before_exit=server.stop)
    lines = [line for line in err.splitlines() if "could not write back" in line]
    assert len(lines) == 1, err
    dirty = expected["dirty"]
    assert "CachedEmbeddingBagCollection of tables ['t0', 't1']" in lines[0]
    assert "TierUnavailableError" in lines[0] and f"; {dirty} dirty rows not written" in lines[0]
    assert "Traceback" not in err, err


def test_a_collection_garbage_collected_before_exit_is_skipped(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        _, err = _run_job(_url(server), tmp_path, "instance-gc", before_exit=server.stop)
    assert "could not write back" not in err and "Traceback" not in err, err


def _train_in_process(ebc: embcache.CachedEmbeddingBagCollection) -> None:
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    batch = embcache.JaggedBatch.from_lengths(
        ["f0", "f1", "f2"], torch.tensor([1, 2, 39, 4, 7, 24]), torch.tensor([2, 1, 1, 0, 1, 1])
    )
    ebc(batch).values().square().sum().backward()
    opt.step()


def _tables() -> list[dict]:
    return [
        {"name": "t0", "embedding_dim": 6, "num_embeddings": 40, "feature_names": ["f0", "f1"]},
        {"name": "t1", "embedding_dim": 3, "num_embeddings": 25, "feature_names": ["f2"]},
    ]


def test_leaving_the_with_block_writes_back_and_closes_the_store_it_opened(
    server: RedisServer,
) -> None:
    url = _url(server)
    with embcache.CachedEmbeddingBagCollection(tables=_tables(), store=url, seed=0) as ebc:
        _train_in_process(ebc)
        assert sum(int(c.dirty.sum()) for c in ebc.caches()) > 0
        reference = embcache.CachedEmbeddingBagCollection(
            tables=_tables(), store=embcache.HostKV(), seed=0
        )
        _train_in_process(reference)
    assert not any(int(c.dirty.sum()) for c in ebc.caches())
    with pytest.raises(RuntimeError, match="closed"):
        ebc.store.table_spec("t0")
    ebc.close()  # idempotent
    rows = _reopened_rows(url)  # the leases were released: no TierOwnershipError
    for name in ("t0", "t1"):
        assert torch.equal(rows[name], reference.table_rows(name)), name


def test_close_flushes_a_given_store_and_leaves_it_open(server: RedisServer) -> None:
    with open_store(_url(server)) as kv:
        ebc = embcache.CachedEmbeddingBagCollection(tables=_tables(), store=kv, seed=0)
        _train_in_process(ebc)
        ebc.close()
        assert not any(int(c.dirty.sum()) for c in ebc.caches())
        assert kv.row_count("t0") > 0  # still open, and holding the trained rows
