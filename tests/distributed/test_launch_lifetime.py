"""No rank of `embcache.distributed.launch.spawn` outlives the process that called it, however
that process dies (issue 45, finding 2): SIGKILLed, its ranks, the fork server and the resource
tracker are gone within seconds, though the fork server (the ranks' parent) would live on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embcache.distributed.launch import _Launcher, _start_ticks
from tests.test_preemption import _marked_env, _processes_with

GONE_S = 30.0  # generous: a busy 2-core machine
REPO = Path(__file__).resolve().parents[2]


def _sleeper(rank: int, where: str) -> None:
    """A rank that says it started (a file named by its pid) and then waits for ever."""
    Path(where, f"{rank}-{os.getpid()}").write_text("")
    time.sleep(3600)


def test_a_launcher_is_known_by_pid_and_start_time() -> None:
    me = _Launcher.this_process()
    assert me.alive()
    assert me.start_ticks == _start_ticks(os.getpid())
    # Another process that got the same pid later is not the launcher.
    assert not _Launcher(me.pid, (me.start_ticks or 0) + 1).alive()
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert not _Launcher(int(done.stdout), None).alive()  # exited and reaped


@pytest.mark.slow
def test_sigkill_of_the_launcher_ends_its_ranks(tmp_path: Path) -> None:
    env, marker = _marked_env()
    script = (
        "import sys\n"
        "from embcache.distributed.launch import spawn\n"
        "from tests.distributed.test_launch_lifetime import _sleeper\n"
        "spawn(_sleeper, 2, args=(sys.argv[1],), timeout=60)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 300
        while len(list(tmp_path.iterdir())) < 2:
            assert launcher.poll() is None, launcher.stderr.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the ranks did not start in 300 s"
            time.sleep(0.2)
        ranks = [int(p.name.split("-")[1]) for p in tmp_path.iterdir()]
        assert all(pid in _processes_with(marker) for pid in ranks)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + GONE_S
        while (left := _processes_with(marker)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"alive {GONE_S:.0f} s after the launcher's SIGKILL: {left}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        launcher.stderr.close()  # type: ignore[union-attr]
        for pid in _processes_with(marker):  # what a failure left: not for the next tests
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
