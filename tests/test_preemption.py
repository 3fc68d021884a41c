"""Durable `embcache train` jobs: SIGTERM mid-run finishes the step in flight, flushes,
checkpoints, releases the tier's leases and exits 143; `--resume` then continues bit-exact with
a run that was never stopped; with `--nproc 2` no rank (nor the fork server) outlives the job.
Periodic checkpoints, the checks made before training and the one-line errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from embcache.checkpoint import latest_snapshot
from embcache.cli import main

SMALL = [
    "train",
    "--scale", "0.0005",
    "--batch-size", "64",
    "--dim", "8",
    "--eval-batches", "0",
    "--no-progress",
]  # fmt: skip
GRACE_S = 60.0  # a stopped job's flush and checkpoint on a busy 2-core machine


@pytest.fixture(autouse=True)
def keep_threads():
    """`embcache train` sets torch's thread count (--threads); restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _command(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "embcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def _interrupt(argv: list[str], marker: str, env: dict[str, str]) -> tuple[int, str]:
    """Start `embcache ARGV`, send it SIGTERM once ``marker`` shows on its stderr, and return
    its exit status and stderr; it must exit within `GRACE_S` of the signal."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "embcache.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if marker in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 400
        # Until the marker shows, or the job's stderr closes (it ended before it was signalled).
        while not seen.wait(timeout=1) and reader.is_alive() and time.monotonic() < deadline:
            pass
        assert seen.is_set(), "".join(lines)
        assert proc.poll() is None, "the job ended before it was signalled: " + "".join(lines)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=GRACE_S + 30)
        assert time.monotonic() - sent < GRACE_S, "the stopped job took too long to exit"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    proc.stdout.close()  # type: ignore[union-attr]
    return proc.returncode, "".join(lines)


def _stopped_at(err: str) -> int:
    found = re.search(r"stopped by SIGTERM after step (\d+)", err)
    assert found, err
    return int(found[1])


def _checkpoint_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every rank's latest snapshot under ``root`` (``root`` itself for one process) as
    tensors by name, table rows sorted by id (a Redis tier exports them in its own order), the
    caches' states left out (which rows a cache holds changes no number)."""
    out: dict[str, torch.Tensor] = {}
    roots = sorted(root.glob("rank-*")) or [root]
    for where in roots:
        snap, rank = latest_snapshot(where), where.name if where != root else "."
        tables: dict[str, list[dict[str, torch.Tensor]]] = {}
        for f in sorted((snap / "tables").glob("*.safetensors")):
            tables.setdefault(f.name.rsplit("-", 1)[0], []).append(load_file(f))
        for name, chunks in tables.items():
            ids = torch.cat([c["ids"] for c in chunks])
            order = torch.argsort(ids)
            out[f"{rank}/{name}:ids"] = ids[order]
            out[f"{rank}/{name}:rows"] = torch.cat([c["rows"] for c in chunks])[order]
        for f in sorted(snap.glob("*.safetensors")):
            for key, value in load_file(f).items():
                out[f"{rank}/{f.name}:{key}"] = value
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for key, value in b.items():
        assert torch.equal(a[key], value), key


def _marked_env() -> tuple[dict[str, str], str]:
    """The environment for a job, with a variable that marks its processes (the ranks, forked
    from a fork server, do not carry the command line but do carry its environment)."""
    marker = f"EMBCACHE_TEST_JOB={uuid.uuid4().hex}"
    key, value = marker.split("=")
    return {**os.environ, key: value}, marker


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``marker`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


def test_sigterm_checkpoints_and_resume_is_exact(tmp_path: Path) -> None:
    from tests.kv.redis_servers import running_server

    env, _ = _marked_env()
    with running_server(tmp_path) as server:
        url = f"{server.url}?namespace=stopped"
        code, err = _interrupt(
            [*SMALL, "--steps", "2000", "--store", url, "--checkpoint", str(tmp_path / "a"),
             "--checkpoint-every", "3"],
            "checkpoint at step 3",
            env,
        )  # fmt: skip
        assert code == 128 + signal.SIGTERM, err
        assert "Traceback" not in err, err
        stopped = _stopped_at(err)
        assert stopped >= 3
        assert f"continue with --resume {tmp_path / 'a'}" in err
        assert not server.client().keys("stopped:lease:*"), "the leases were not released"
        assert latest_snapshot(tmp_path / "a").is_dir()
        assert sorted(p.name for p in (tmp_path / "a" / "steps").iterdir())[-1] == (
            f"step-{stopped:09d}"
        )
        # The resumed run keeps the checkpoint's tier (the same namespace) and says so.
        total = stopped + 4
        done = _command(
            *SMALL, "--steps", "4", "--resume", str(tmp_path / "a"),
            "--checkpoint", str(tmp_path / "b"), env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        resumed = re.search(
            r"resumed\s+from (\S+) at step (\d+).*tier (\S+) \(([^)]*)\)", done.stdout
        )
        assert resumed, done.stdout
        assert int(resumed[2]) == stopped and resumed[3] == url
        assert "the checkpoint's run's" in resumed[4]
        done = _command(
            *SMALL, "--steps", str(total), "--store", f"{server.url}?namespace=straight",
            "--checkpoint", str(tmp_path / "c"), env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    _assert_same(_checkpoint_tensors(tmp_path / "b"), _checkpoint_tensors(tmp_path / "c"))


@pytest.mark.slow
def test_sigterm_to_two_ranks_leaves_no_process(tmp_path: Path) -> None:
    env, marker = _marked_env()
    code, err = _interrupt(
        [*SMALL, "--nproc", "2", "--steps", "2000", "--checkpoint", str(tmp_path / "a"),
         "--checkpoint-every", "2"],
        "checkpoint at step 2",
        env,
    )  # fmt: skip
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    stopped = _stopped_at(err)
    deadline = time.monotonic() + 20
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with(marker), "a rank, the fork server or a helper outlived the job"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["rank-0", "rank-1", "steps"]
    done = _command(
        *SMALL, "--nproc", "2", "--steps", "2", "--resume", str(tmp_path / "a"),
        "--checkpoint", str(tmp_path / "b"), env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    done = _command(
        *SMALL, "--nproc", "2", "--steps", str(stopped + 2), "--checkpoint", str(tmp_path / "c"),
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    _assert_same(_checkpoint_tensors(tmp_path / "b"), _checkpoint_tensors(tmp_path / "c"))
    assert not _processes_with(marker)


def test_periodic_checkpoints_keep_the_last_k(tmp_path: Path, capsys) -> None:
    ckpt = tmp_path / "ck"
    argv = [*SMALL, "--steps", "7", "--checkpoint", str(ckpt), "--checkpoint-every", "2"]
    assert main([*argv, "--keep-checkpoints", "2"]) == 0
    kept = sorted(p.name for p in (ckpt / "steps").iterdir())
    assert kept == ["step-000000006", "step-000000007"]
    assert "checkpoint at step 6" in capsys.readouterr().err
    # Each kept one is a checkpoint --resume takes; the newest equals the directory's own.
    _assert_same(_checkpoint_tensors(ckpt / "steps" / kept[-1]), _checkpoint_tensors(ckpt))
    assert main([*SMALL, "--steps", "1", "--resume", str(ckpt / "steps" / kept[0])]) == 0
    assert "at step 6 (this run: steps 7-7)" in capsys.readouterr().out


def _damaged_gzip(tmp_path: Path) -> str:
    from tests.data import formats

    path = formats.write_criteo(tmp_path / "train.txt.gz", 2500, seed=0, gz=True)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    return f"criteo:{path}"


def _wide_integer(tmp_path: Path) -> str:
    from tests.data.formats import criteo_lines

    lines = criteo_lines(600, seed=1)
    fields = lines[300].split("\t")
    fields[1] = "1" * 23
    lines[300] = "\t".join(fields)
    path = tmp_path / "wide.txt"
    path.write_text("\n".join(lines) + "\n")
    return f"criteo:{path}"


def _damaged_resume(tmp_path: Path) -> str:
    ckpt = tmp_path / "ck"
    assert main([*SMALL, "--steps", "1", "--checkpoint", str(ckpt)]) == 0
    (ckpt / "CURRENT").write_text("snap-000001\nsha256 " + "0" * 64 + "\n")
    return str(ckpt)


def _unwritable(tmp_path: Path) -> str:
    blocker = tmp_path / "file"
    blocker.write_text("")
    return str(blocker)


REAL = ["--steps", "20", "--batch-size", "64", "--dim", "8", "--buckets", "500"]


@pytest.mark.parametrize(
    ("make", "code", "message"),
    [
        (lambda t: ["--data", _damaged_gzip(t), *REAL], (1, 2), "--data"),
        (lambda t: ["--data", _wide_integer(t), *REAL], (1, 2), "--data"),
        (lambda t: ["--batch-size", str(10**10)], (2,), "GiB"),
        (lambda t: ["--dim", str(10**9)], (2,), "GiB"),
        (lambda t: ["--lr", "1e30", "--steps", "30"], (1,), "diverged"),
        (lambda t: ["--threads", "100000"], (2,), "--threads must be at most"),
        (lambda t: ["--resume", _damaged_resume(t)], (2,), "--resume"),
        (lambda t: ["--checkpoint", _unwritable(t)], (2,), "--checkpoint"),
        (lambda t: ["--checkpoint", f"{_unwritable(t)}/under"], (2,), "not a directory"),
        (lambda t: ["--checkpoint-every", "5"], (2,), "needs --checkpoint"),
        (lambda t: ["--keep-checkpoints", "0"], (2,), "--keep-checkpoints must be >= 1"),
    ],
    ids=[
        "truncated-gzip", "23-digit-integer", "huge-batch", "huge-dim", "diverging-lr",
        "threads", "damaged-resume", "checkpoint-is-a-file", "checkpoint-under-a-file",
        "every-without-dir", "keep-0",
    ],
)  # fmt: skip
def test_one_line_errors(make, code, message, tmp_path: Path, capsys) -> None:
    argv = make(tmp_path)
    capsys.readouterr()
    base = SMALL if "--data" not in argv else [a for a in SMALL if a != "--scale" and a != "0.0005"]
    with pytest.raises(SystemExit) as info:
        main([*base, "--steps", "6", *argv])
    err = capsys.readouterr().err
    assert info.value.code in code, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("embcache train: error: ") and message in last, err
    if "--resume" in argv:
        assert "--store" not in last, "a damaged --resume was blamed on --store"


@pytest.mark.slow
def test_a_rank_error_reaches_the_parent_whole(tmp_path: Path) -> None:
    done = _command(*SMALL, "--nproc", "2", "--steps", "30", "--lr", "1e30")
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.match(
        r"embcache train: error: rank \d failed: DivergedError: training diverged", last
    )
