"""`embcache train` on a Redis tier shared by several jobs and runs (issue 45, findings 1, 6, 7
and 10), each job its own process on a real redis-server:

* ``--resume`` of a live job's checkpoint is refused, and the live job trains on untouched;
* after a SIGKILL, the next run says the last job ended without closing the tier and names
  the checkpoint to resume from;
* the record that detects a lost tier lives with the tier (in Redis, and in the checkpoint),
  and a local copy outside the working directory: a server restarted empty is refused from
  any directory, rows deleted behind the job from any machine;
* a full disk while writing the local record is one line naming the file, with no temp file
  left.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from embcache.cli.tier_record import TierRecord, record_path, write_record
from tests.kv.redis_servers import RedisServer, running_server

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "train",
    "--scale", "0.0005",
    "--batch-size", "64",
    "--dim", "8",
    "--eval-batches", "0",
    "--no-progress",
]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}
    return {k: v for k, v in env.items() if v != ""}


def _train(*argv: str, cwd: Path | None = None, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", "embcache.cli", *SMALL, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env or _env(),
    )


class _Running:
    """``embcache train ARGV`` in the background, its stderr collected."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embcache.cli", *SMALL, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.lines.append(line)

    def wait_for(self, marker: str, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(marker in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.1)

    def stop(self, sig: int) -> tuple[int, str]:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=120)
        self._reader.join(timeout=10)
        self.proc.stdout.close()  # type: ignore[union-attr]
        return self.proc.returncode, "".join(self.lines)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_resuming_a_live_jobs_checkpoint_is_refused(tmp_path: Path) -> None:
    """Finding 1: job B given ``--resume`` of live job A's checkpoint took A's tables over
    (A's token) and rewrote every row; A died on a row of the wrong width. B is now refused
    before it changes anything, and A trains on and stops cleanly."""
    ckpt = tmp_path / "a"
    with running_server(tmp_path) as server:
        url = f"{server.url}?namespace=live"
        a = _Running("--steps", "2000", "--store", url, "--checkpoint", str(ckpt),
                     "--checkpoint-every", "3")  # fmt: skip
        try:
            a.wait_for("checkpoint at step 3")
            b = _train("--steps", "2", "--resume", str(ckpt), "--checkpoint", str(tmp_path / "b"))
            assert b.returncode == 2, b.stderr
            line = _one_line(b.stderr)
            assert "still held by the job that wrote the checkpoint" in line, line
            assert f"pid {a.proc.pid}" in line and "'t_cat_" in line, line
            assert not (tmp_path / "b").exists()
            time.sleep(1.0)  # A goes on training, its writes accepted
            assert a.proc.poll() is None, "".join(a.lines)
        finally:
            code, err = a.stop(signal.SIGTERM)
        assert code == 128 + signal.SIGTERM, err
        assert "Error" not in err and "Traceback" not in err, err
        # A is done: the same resume now goes ahead.
        done = _train("--steps", "2", "--resume", str(ckpt))
        assert done.returncode == 0, done.stderr


def test_after_a_kill_the_next_run_names_the_checkpoint(tmp_path: Path) -> None:
    """Finding 6: after a SIGKILL the next run without ``--resume`` said "continued from
    N rows", although the rows dirty in the dead job's cache were gone. It now says the last
    job ended without closing the tier, and names the checkpoint to resume from."""
    ckpt = tmp_path / "a"
    with running_server(tmp_path) as server:
        url = f"{server.url}?namespace=killed&lease_ttl_s=2"
        a = _Running("--steps", "2000", "--store", url, "--checkpoint", str(ckpt),
                     "--checkpoint-every", "3")  # fmt: skip
        try:
            a.wait_for("checkpoint at step 3")
        finally:
            a.stop(signal.SIGKILL)
        time.sleep(2.5)  # the dead job's leases lapse (another job does not take them over)
        after = _train("--steps", "2", "--store", url)
        assert after.returncode == 0, after.stderr
        assert "ended without closing it" in after.stderr, after.stderr
        assert f"pid {a.proc.pid}" in after.stderr, after.stderr
        assert f"--resume {ckpt}" in after.stderr, after.stderr
        assert f"--resume {ckpt}" in after.stdout and "WARNING" in after.stdout, after.stdout
        # Said once: that run ended cleanly, the next says nothing.
        again = _train("--steps", "1", "--store", url)
        assert again.returncode == 0, again.stderr
        assert "ended without closing" not in again.stderr + again.stdout


def test_a_tier_restarted_empty_is_refused_from_any_directory(tmp_path: Path) -> None:
    """Finding 7: the record lived in ./.embcache, so the same command from another
    directory went ahead on the empty namespace. The local record is now the user's, in
    ``$XDG_STATE_HOME``."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    env = _env(EMBCACHE_TIER_RECORDS="", XDG_STATE_HOME=str(tmp_path / "state"))
    with running_server(tmp_path) as server:
        url = f"{server.url}?namespace=moved"
        first = _train("--steps", "3", "--store", url, cwd=tmp_path / "one", env=env)
        assert first.returncode == 0, first.stderr
        assert not (tmp_path / "one" / ".embcache").exists()
        assert record_path(url, directory=tmp_path / "state" / "embcache" / "tiers").is_file()
        server.restart()  # no persistence: back empty, its own record gone with it
        second = _train("--steps", "3", "--store", url, cwd=tmp_path / "two", env=env)
        assert second.returncode == 1, second.stderr
        line = _one_line(second.stderr)
        assert "namespace record" in line and "missing" in line, line
        assert "--fresh-tier" in line and str(tmp_path / "state") in line, line
        assert server.client().dbsize() == 0


def test_the_record_lives_with_the_tier_and_the_checkpoint(tmp_path: Path) -> None:
    """Finding 7: with no local record at all (another machine), the tier's own record
    catches rows deleted behind the job, and the checkpoint's copy a server that restarted
    empty."""
    ckpt = tmp_path / "ckpt"
    with running_server(tmp_path) as server:
        url = f"{server.url}?namespace=kept"
        here = _env(EMBCACHE_TIER_RECORDS=str(tmp_path / "here"))
        first = _train("--steps", "3", "--store", url, "--checkpoint", str(ckpt), env=here)
        assert first.returncode == 0, first.stderr
        raw = server.client()
        assert raw.get("kept:record") is not None
        rows = [key for key in raw.scan_iter("kept:{*") if key.count(b":") == 3]
        raw.delete(*rows[:5])

        elsewhere = _env(EMBCACHE_TIER_RECORDS=str(tmp_path / "elsewhere"))
        second = _train("--steps", "3", "--store", url, env=elsewhere)
        assert second.returncode == 1, second.stderr
        line = _one_line(second.stderr)
        assert "rows" in line and "the run record on the tier" in line, line

        server.restart()
        third = _train("--steps", "3", "--store", url, "--checkpoint", str(ckpt), env=elsewhere)
        assert third.returncode == 1, third.stderr
        line = _one_line(third.stderr)
        assert "missing" in line and f"the checkpoint {ckpt}" in line, line
        assert server.client().dbsize() == 0


def test_a_full_disk_writing_the_record_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Finding 10: a full disk while writing the local record raised an OSError naming no
    path and left a 0-byte temp file."""
    path = tmp_path / "records" / "tier.json"

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as caught:
        write_record(path, {"format": 1})
    message = str(caught.value)
    assert str(path) in message and "full" in message and "\n" not in message, message
    assert list(path.parent.iterdir()) == [], "no temp file, no record"

    class Tier:  # what TierRecord.save needs of a store
        def flush(self) -> None:
            pass

        def tier_state(self):
            from embcache.kv import TierState

            return TierState("redis://x", "ns", "id", {})

        def save_run_record(self, name: str, record: dict) -> None:
            self.saved = record

    tier = Tier()
    TierRecord(path).save(tier, 3)  # type: ignore[arg-type]
    assert tier.saved["steps_done"] == 3
    err = capsys.readouterr().err
    assert _one_line(err).startswith("embcache train: warning: cannot write the tier record")
    assert str(path) in err and list(path.parent.iterdir()) == []


@pytest.fixture
def server(tmp_path: Path):
    with running_server(tmp_path) as started:
        yield started


def test_a_damaged_record_on_the_tier_is_one_line(tmp_path: Path, server: RedisServer) -> None:
    url = f"{server.url}?namespace=bad"
    server.client().set("bad:record", b"{not json")
    done = _train("--steps", "1", "--store", url)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr)
    assert "bad:record" in line and "--fresh-tier" in line, line
