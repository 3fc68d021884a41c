"""`embcache train` over real Redis servers when things go wrong: a server that comes back
empty or dies mid-run ends the run with the tier's one-line error and a non-zero status; a
password never appears in any output; a second job is refused while a resumed one reopens its
own tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import torch

from embcache.cli import main
from tests.kv.redis_servers import RedisServer, running_server

SECRET = "hunter2-secret"
TINY = [
    "train",
    "--scale", "0.0005",
    "--steps", "6",
    "--batch-size", "64",
    "--dim", "8",
    "--eval-batches", "0",
    "--no-progress",
]  # fmt: skip
LONG = [a if a != "6" else "300" for a in TINY]


@pytest.fixture(autouse=True)
def keep_threads():
    """`embcache train` sets torch's thread count (--threads); restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code


def _after_writes(server: RedisServer, fault, writes: int = 3) -> threading.Thread:
    """A thread that runs ``fault()`` once the server has acknowledged ``writes`` row writes
    (each bumps a write mark)."""

    def watch() -> None:
        raw = server.client()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                calls = raw.info("commandstats").get("cmdstat_incr", {}).get("calls", 0)
            except redis.exceptions.RedisError:
                calls = 0
            if calls >= writes:
                fault()
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_server_back_empty_mid_run_is_an_error_not_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_server(tmp_path) as server:
        url = f"{server.url}?namespace=loss&retry_timeout_s=5"

        def crash_and_restart_empty() -> None:
            server.kill()
            server.start()

        watcher = _after_writes(server, crash_and_restart_empty)
        code = _exit_code([*LONG, "--store", url])
        watcher.join()
    assert code == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "lost acknowledged writes" in line and "--resume" in line, line


def test_a_server_lost_mid_run_prints_the_tier_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_server(tmp_path, password=SECRET) as server:
        url = server.url.replace("redis://", f"redis://:{SECRET}@") + "?retry_timeout_s=0.5"
        watcher = _after_writes(server, server.kill)
        code = _exit_code([*LONG, "--store", url])
        watcher.join()
    assert code == 1
    out, err = capsys.readouterr()
    line = _one_line_error(err)
    assert "unavailable" in line and "127.0.0.1" in line, line
    assert SECRET not in out + err


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "embcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_no_output_ever_shows_the_password(tmp_path: Path) -> None:
    """Every output of runs given a password (progress bar on, summary, errors) and every file
    they write, grepped for it."""
    args = [a for a in TINY if a != "--no-progress"]
    with running_server(tmp_path, password=SECRET) as server:
        host = server.url.removeprefix("redis://")
        runs = {
            "userinfo": _run(*args, "--store", f"redis://:{SECRET}@{host}?namespace=a",
                             "--checkpoint", str(tmp_path / "ckpt")),
            "query": _run(*args, "--store", f"redis://{host}?password={SECRET}&namespace=b"),
            "wrong": _run(*args, "--store", f"redis://:{SECRET}-wrong@{host}"),
            "option": _run(*args, "--store", f"redis://:{SECRET}@{host}?chunk_rows=x"),
            "form": _run(*args, "--store", f"redis+nope://:{SECRET}@{host}"),
        }  # fmt: skip
    assert runs["userinfo"].returncode == 0, runs["userinfo"].stderr
    assert runs["query"].returncode == 0, runs["query"].stderr
    assert "store redis://:***@" in runs["userinfo"].stdout
    assert "password=***" in runs["query"].stdout
    assert runs["wrong"].returncode == 2 and "password" in runs["wrong"].stderr
    assert runs["option"].returncode == 2 and "chunk_rows" in runs["option"].stderr
    assert runs["form"].returncode == 2 and "unknown store" in runs["form"].stderr
    for name, done in runs.items():
        assert SECRET not in done.stdout + done.stderr, f"{name} printed the password"
    for path in (tmp_path / "ckpt").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_second_job_is_refused_and_a_resumed_one_takes_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_server(tmp_path) as server:
        url = f"{server.url}?namespace=jobs&retry_timeout_s=2"
        ckpt = tmp_path / "ckpt"
        assert main([*TINY, "--store", url, "--checkpoint", str(ckpt)]) == 0
        owner = json.loads(next(ckpt.glob("snap-*/manifest.json")).read_text())["extra"]
        # The first run's process, still holding a table's lease (its token), alive...
        record = json.loads(server.client().get("jobs:meta:t_cat_0"))
        hold = (
            "import sys, time; from embcache.kv.base import TableSpec; "
            "from embcache.kv.redis_kv import RedisKV; "
            "kv = RedisKV(sys.argv[1], namespace='jobs', owner=sys.argv[2]); "
            f"kv.init_table(TableSpec('t_cat_0', dim={record['dim']}, "
            f"num_embeddings={record['num_embeddings']})); print('ready', flush=True); "
            "time.sleep(600)"
        )
        first = subprocess.Popen(
            [sys.executable, "-c", hold, server.url, owner["tier_owner"]],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert first.stdout is not None and first.stdout.readline().strip() == "ready"
            capsys.readouterr()
            assert _exit_code([*TINY, "--store", url]) == 2  # another job: refused
            line = _one_line_error(capsys.readouterr().err)
            assert "in use by another job" in line and "namespace" in line, line
        finally:
            first.kill()  # ...then killed: its lease is still live, for lease_ttl_s
            first.wait()
        # The same job resumed from its checkpoint takes its tables over at once.
        assert main([*TINY, "--store", url, "--resume", str(ckpt)]) == 0
