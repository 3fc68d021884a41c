"""How `embcache train` ends when it is signalled (issue 45, findings 2 and 9), with the real
CLI in subprocesses: SIGKILL of the ``--nproc`` launcher leaves no rank, fork server or resource
tracker behind; SIGTERM to one rank stops every rank, names the signal and exits 128 + its
number; SIGTERM before the first step is one line; SIGTERM after the last step (during the
final save) leaves a finished run's status at 0; ``--total-steps`` makes a requeued
``--resume`` end where the first run was to end.

Signals are sent once a line on the job's stderr shows it is where the test wants it, or, for
the instants no line marks (the set-up before the first step, the final save), by the job
itself from inside the CLI's own call (`_hooked`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from embcache.checkpoint import read_extra
from tests.test_preemption import (
    SMALL,
    _assert_same,
    _checkpoint_tensors,
    _command,
    _marked_env,
    _processes_with,
)

GONE_S = 30.0  # how long processes may take to go once their launcher is killed (a busy machine)
EXIT_S = 90.0  # a stopped job's flush and checkpoint, two ranks on a busy 2-core machine
STOP_LINE = re.compile(r"^embcache train: stopped by (SIG[A-Z]+) after step (\d+) of (\d+): ")


@pytest.fixture(autouse=True)
def keep_threads():
    """`embcache train` sets torch's thread count (--threads); restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


class _Job:
    """`embcache ARGV` running, its stderr collected line by line."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embcache.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._out: list[str] = []
        self._out_reader = threading.Thread(target=self._read_out, daemon=True)
        self._out_reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.lines.append(line)

    def _read_out(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._out.append(line)

    @property
    def err(self) -> str:
        return "".join(self.lines)

    def wait_for(self, marker: str, timeout: float = 400.0) -> None:
        """Until ``marker`` shows on stderr; the job must still be running then."""
        deadline = time.monotonic() + timeout
        while not any(marker in line for line in self.lines):
            assert self._reader.is_alive(), f"the job ended before {marker!r}:\n{self.err}"
            assert time.monotonic() < deadline, f"no {marker!r} in {timeout:.0f} s:\n{self.err}"
            time.sleep(0.2)
        assert self.proc.poll() is None, "the job ended before it was signalled:\n" + self.err

    def finish(self, timeout: float = EXIT_S) -> int:
        """The exit status, which must come within ``timeout`` s."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not exit within {timeout:.0f} s:\n{self.err}")
        self._reader.join(timeout=GONE_S)
        self._out_reader.join(timeout=GONE_S)
        return code

    def kill(self, marker: str | None = None) -> None:
        """End the job, and with ``marker`` every process it left (after a failure: not for
        the next tests)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in _processes_with(marker) if marker else ():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(int(entry.name))
    return found


def _ranks(launcher: int) -> list[int]:
    """The rank processes of a ``--nproc`` launcher: the fork server's children, by pid (rank 0
    is forked first)."""
    return sorted(pid for child in _children(launcher) for pid in _children(child))


def _wait_gone(marker: str, timeout: float) -> list[int]:
    """The processes marked ``marker`` still alive after up to ``timeout`` s (polled)."""
    deadline = time.monotonic() + timeout
    while (alive := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def _hooked(argv: list[str], hook: str) -> subprocess.CompletedProcess:
    """`embcache ARGV` in a process where ``hook`` (Python source defining ``install(job)``,
    given the module `embcache.cli.job`) has wrapped one of the CLI's own calls, to send
    the process a real signal at an instant no output line marks."""
    code = (
        "import os, signal, sys\n"
        "import embcache.cli.job as job\n"
        f"{hook}\n"
        "install(job)\n"
        "from embcache.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=600
    )


def _last_line(err: str) -> str:
    lines = err.strip().splitlines()
    return lines[-1] if lines else ""


# ----------------------------------------------------------------------------------------------
# finding 2: no rank outlives its launcher


@pytest.mark.slow
def test_sigkill_of_the_launcher_leaves_no_process(tmp_path: Path) -> None:
    env, marker = _marked_env()
    job = _Job(
        [*SMALL, "--nproc", "2", "--steps", "2000", "--checkpoint", str(tmp_path / "a"),
         "--checkpoint-every", "2"],
        env,
    )  # fmt: skip
    try:
        job.wait_for("checkpoint at step 2")
        ranks = _ranks(job.proc.pid)
        assert len(ranks) == 2, (ranks, job.err)
        job.proc.send_signal(signal.SIGKILL)
        job.proc.wait(timeout=30)
        left = _wait_gone(marker, GONE_S)
        assert not left, f"alive {GONE_S:.0f} s after the launcher's SIGKILL: {left}"
    finally:
        job.kill(marker)


# ----------------------------------------------------------------------------------------------
# finding 9: signals and exit statuses


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_the_job_and_names_the_signal(tmp_path: Path) -> None:
    env, marker = _marked_env()
    job = _Job(
        [*SMALL, "--nproc", "2", "--steps", "2000", "--checkpoint", str(tmp_path / "a"),
         "--checkpoint-every", "2"],
        env,
    )  # fmt: skip
    try:
        job.wait_for("checkpoint at step 2")
        ranks = _ranks(job.proc.pid)
        assert len(ranks) == 2, (ranks, job.err)
        signal_sent = ranks[-1]  # rank 1: the rank that does not print the summary
        os.kill(signal_sent, signal.SIGTERM)
        code = job.finish()
    finally:
        job.kill(marker)
    err = job.err
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    stop = STOP_LINE.match(_last_line(err))
    assert stop, err
    assert stop[1] == "SIGTERM" and int(stop[2]) >= 2 and stop[3] == "2000", err
    extra = read_extra(tmp_path / "a" / "rank-0")
    assert extra["steps_done"] == int(stop[2])
    assert not _wait_gone(marker, GONE_S)


def test_sigterm_before_the_first_step_is_one_line(tmp_path: Path) -> None:
    """The signal comes while the tier is opened (set-up, the handlers installed): the run
    stops at its first step with the stop line, no summary and no traceback."""
    hook = (
        "def install(job):\n"
        "    real = job.open_store\n"
        "    def open_store(*a, **k):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        return real(*a, **k)\n"
        "    job.open_store = open_store\n"
    )
    done = _hooked([*SMALL, "--steps", "50", "--checkpoint", str(tmp_path / "a")], hook)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    stop = STOP_LINE.match(_last_line(done.stderr))
    assert stop and stop[1] == "SIGTERM" and stop[2] == "0" and stop[3] == "50", done.stderr
    assert "summary" not in done.stdout
    assert read_extra(tmp_path / "a")["steps_done"] == 0


def test_sigterm_during_the_final_save_of_a_finished_run_exits_0(tmp_path: Path) -> None:
    """The signal comes as the last checkpoint is written: every step was trained and the
    save completes, so the run finished (status 0), and says the signal changed nothing."""
    hook = (
        "def install(job):\n"
        "    real = job.save_checkpoint\n"
        "    def save_checkpoint(*a, **k):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        return real(*a, **k)\n"
        "    job.save_checkpoint = save_checkpoint\n"
    )
    done = _hooked([*SMALL, "--steps", "3", "--checkpoint", str(tmp_path / "a")], hook)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert _last_line(done.stderr) == (
        "embcache train: SIGTERM came after the last step: the run finished and was saved"
    ), done.stderr
    assert read_extra(tmp_path / "a")["steps_done"] == 3
    assert "training      3 steps" in done.stdout


def test_total_steps_resumes_to_the_same_end(tmp_path: Path) -> None:
    """A requeue loop: the run is stopped by SIGTERM, then the same ``--resume DIR
    --checkpoint DIR --total-steps N`` command runs until it ends at step N (and once more,
    doing nothing), bit-equal to a run of N steps never stopped."""
    env, _ = _marked_env()
    ckpt = tmp_path / "a"
    total = 40
    job = _Job(
        [*SMALL, "--total-steps", str(total), "--checkpoint", str(ckpt),
         "--checkpoint-every", "2"],
        env,
    )  # fmt: skip
    try:
        job.wait_for("checkpoint at step 2")
        job.proc.send_signal(signal.SIGTERM)
        code = job.finish()
    finally:
        job.kill()
    assert code == 128 + signal.SIGTERM, job.err
    stop = STOP_LINE.match(_last_line(job.err))
    assert stop and stop[3] == str(total), job.err
    stopped = int(stop[2])
    assert 2 <= stopped < total
    requeue = ["--resume", str(ckpt), "--checkpoint", str(ckpt), "--total-steps", str(total)]
    assert f"continue with --resume {ckpt}: it ends at step {total}" in job.err
    done = _command(*SMALL, *requeue, env=env)
    assert done.returncode == 0, done.stderr
    assert f"(this run: steps {stopped + 1}-{total})" in done.stdout, done.stdout
    assert read_extra(ckpt)["steps_done"] == total
    again = _command(*SMALL, *requeue, env=env)
    assert again.returncode == 0, again.stderr
    assert _last_line(again.stderr) == (
        f"embcache train: --resume {ckpt} is at step {total}, --total-steps {total}: "
        "nothing left to train"
    )
    assert read_extra(ckpt)["steps_done"] == total
    straight = _command(*SMALL, "--steps", str(total), "--checkpoint", str(tmp_path / "b"), env=env)
    assert straight.returncode == 0, straight.stderr
    _assert_same(_checkpoint_tensors(ckpt), _checkpoint_tensors(tmp_path / "b"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "5"], "--steps and --total-steps: give one"),
        (["--epochs", "1"], "--epochs and --total-steps: give one"),
    ],
    ids=["with-steps", "with-epochs"],
)
def test_total_steps_refuses_a_second_length(extra, message, capsys) -> None:
    from embcache.cli import main

    with pytest.raises(SystemExit) as info:
        main([*SMALL, "--total-steps", "5", *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_total_steps_is_in_the_help() -> None:
    from embcache.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    assert "--total-steps" in sub.format_help()
