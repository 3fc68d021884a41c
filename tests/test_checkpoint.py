"""Checkpoints: exact round trips (also into a fresh process) and crash safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import embcache
from tests.checkpoint_job import build, train, weights

JOB = Path(__file__).with_name("checkpoint_job.py")


def run_job(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(JOB), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def test_resume_in_a_fresh_process_is_exact(tmp_path: Path) -> None:
    model, sparse, dense = build()
    train(model, sparse, dense, start=0, steps=5)
    embcache.save(tmp_path / "ckpt", model, [sparse, dense])
    train(model, sparse, dense, start=5, steps=4)
    expected = weights(model, sparse)

    out = tmp_path / "resumed.pt"
    done = run_job("resume", str(tmp_path / "ckpt"), "4", str(out))
    assert done.returncode == 0, done.stderr
    assert_same(torch.load(out), expected)


def test_load_into_a_used_model_resets_rows_touched_after_save(tmp_path: Path) -> None:
    model, sparse, dense = build()
    train(model, sparse, dense, start=0, steps=3)
    embcache.save(tmp_path / "ckpt", model, [sparse, dense])
    saved = weights(model, sparse)
    train(model, sparse, dense, start=3, steps=6)  # touches rows the checkpoint never saw
    assert not torch.equal(weights(model, sparse)["rows.t0"], saved["rows.t0"])
    embcache.load(tmp_path / "ckpt", model, [sparse, dense])
    assert_same(weights(model, sparse), saved)
    # Step counts were restored too: the same next steps give the same result as from scratch.
    fresh, fsparse, fdense = build()
    embcache.load(tmp_path / "ckpt", fresh, [fsparse, fdense])
    train(model, sparse, dense, start=3, steps=2)
    train(fresh, fsparse, fdense, start=3, steps=2)
    assert_same(weights(model, sparse), weights(fresh, fsparse))


def test_a_crash_during_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt, saved_a = tmp_path / "ckpt", tmp_path / "a.pt"
    proc = subprocess.Popen(
        [sys.executable, str(JOB), "crash", str(ckpt), str(saved_a)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert proc.stdout.readline().strip() == "saving B", proc.stderr.read()
        deadline = time.monotonic() + 60
        while not any(ckpt.glob(".tmp-snap-*/tables/*.safetensors")):
            assert time.monotonic() < deadline, "save B never started writing"
            time.sleep(0.05)
        time.sleep(0.3)  # well inside save B: it writes a chunk every 0.2 s
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the job must have died mid-save"
    assert any(ckpt.glob(".tmp-snap-*")), "the killed save left its temporary directory"

    model, sparse, dense = build()
    embcache.load(ckpt, model, [sparse, dense])
    assert_same(weights(model, sparse), torch.load(saved_a))


def test_a_second_save_replaces_the_first(tmp_path: Path) -> None:
    model, sparse, dense = build()
    train(model, sparse, dense, start=0, steps=2)
    first = embcache.save(tmp_path, model, [sparse, dense])
    train(model, sparse, dense, start=2, steps=2)
    second = embcache.save(tmp_path, model, [sparse, dense])
    assert not first.exists() and second.exists()
    fresh, fsparse, fdense = build()
    embcache.load(tmp_path, fresh, [fsparse, fdense])
    assert_same(weights(fresh, fsparse), weights(model, sparse))


def test_load_errors(tmp_path: Path) -> None:
    model, sparse, dense = build()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        embcache.load(tmp_path, model, [sparse, dense])
    embcache.save(tmp_path, model, [sparse, dense])
    with pytest.raises(ValueError, match="2 optimizers, 1 were given"):
        embcache.load(tmp_path, model, [sparse])
    other, _, odense = build()
    osparse = embcache.SparseSGD([other.sparse], lr=0.1)  # no state columns: layout differs
    with pytest.raises(ValueError, match="attach the same optimizer"):
        embcache.load(tmp_path, other, [osparse, odense])


@pytest.mark.parametrize(
    "cache",
    [None, embcache.CacheConfig(load_factor=0.1, ways=4)],
    ids=["whole-table", "10pct"],
)
def test_reads_create_no_rows_so_a_save_holds_the_trained_rows_only(
    tmp_path: Path, cache: embcache.CacheConfig | None
) -> None:
    """state_dict(), table_rows and a load of unchanged weights read every row of every table;
    none of it may create rows in the tier, so the checkpoint holds the 1% of rows trained
    (ids and bytes), exactly as when nothing was read."""
    from safetensors.torch import load_file

    rows, dim, n_tables = 20_000, 8, 3
    tables = [
        embcache.TableConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                             feature_names=[f"f{i}"])
        for i in range(n_tables)
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randperm(rows, generator=gen)[: rows // 100] for _ in range(n_tables)]

    def trained(read_everything: bool, where: Path) -> dict[str, set[int]]:
        ebc = embcache.CachedEmbeddingBagCollection(tables=tables, cache=cache)
        opt = embcache.SparseAdaGrad(ebc, lr=0.1)
        gen.manual_seed(1)  # the same batches in both runs
        for _ in range(4):
            picks = [p[torch.randint(p.numel(), (64,), generator=gen)] for p in pools]
            batch = embcache.JaggedBatch.from_lengths(
                [f"f{i}" for i in range(n_tables)],
                torch.cat(picks),
                torch.ones(64 * n_tables, dtype=torch.int64),
            )
            ebc(batch).values().square().sum().backward()
            opt.step()
        if read_everything:
            state = ebc.state_dict()
            assert state["embedding_bags.t0.weight"].shape == (rows, dim)
            for t in tables:
                ebc.table_rows(t.name)
            ebc.load_state_dict(state)  # the weights it holds: nothing changes
        snap = embcache.save(where, ebc, [opt])
        saved: dict[str, set[int]] = {}
        for entry in json.loads((snap / "manifest.json").read_text())["tables"]:
            ids = [load_file(snap / f["name"])["ids"] for f in entry["files"]]
            saved[entry["table"]] = set(torch.cat(ids).tolist()) if ids else set()
        return saved

    quiet = trained(False, tmp_path / "quiet")
    read = trained(True, tmp_path / "read")
    assert read == quiet
    for i, t in enumerate(tables):
        assert read[t.name] <= set(pools[i].tolist()), "only rows looked up for training"
    table_bytes = sum(f.stat().st_size for f in (tmp_path / "read").rglob("tables/*"))
    whole = n_tables * rows * 2 * dim * 4  # weights + AdaGrad state of every row
    assert table_bytes < 0.02 * whole, (table_bytes, whole)
