"""`embcache train --resume DIR` finishes the run DIR was saved from (issue 48, item 4): the
checkpoint records the step the run was to end at and where and how often it saved, so Ctrl-C,
``--resume DIR``, Ctrl-C, ``--resume DIR`` ends at the original step count with every step kept
(each interruption checkpoints into the original directory, though the resumed runs were given
no ``--checkpoint``), bit-equal to a run never stopped. Also: a failed periodic save (a full
disk) is one line naming the path and the checkpoint kept.

The signals are real SIGINTs sent to the CLI's process once a line on its stderr (a periodic
checkpoint) shows it is training; nothing waits on a sleep."""

from __future__ import annotations

import errno
import re
import signal
from pathlib import Path

import pytest
import torch

from embcache.checkpoint import read_extra
from tests.test_preemption import SMALL, _assert_same, _checkpoint_tensors, _command, _marked_env
from tests.test_signals_exit import STOP_LINE, _Job, _last_line

TOTAL = 400  # steps of the run: hundreds after the first line the test waits for
EVERY = 40  # --checkpoint-every: the lines it waits for


@pytest.fixture(autouse=True)
def keep_threads():
    """`embcache train` sets torch's thread count (--threads); restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _interrupted(argv: list[str], env: dict[str, str], marker: str) -> tuple[int, str]:
    """Run `embcache ARGV`, send it SIGINT once ``marker`` shows on its stderr; returns the
    step it stopped after and its stderr."""
    job = _Job(argv, env)
    try:
        job.wait_for(marker)
        job.proc.send_signal(signal.SIGINT)
        code = job.finish()
    finally:
        job.kill()
    assert code == 128 + signal.SIGINT, job.err
    assert "Traceback" not in job.err, job.err
    stop = STOP_LINE.match(_last_line(job.err))
    assert stop and stop[1] == "SIGINT" and stop[3] == str(TOTAL), job.err
    return int(stop[2]), job.err


def test_ctrl_c_resume_ctrl_c_resume_ends_where_the_run_was_to_end(tmp_path: Path) -> None:
    env, _ = _marked_env()
    ckpt = tmp_path / "a"
    first = [*SMALL, "--steps", str(TOTAL), "--checkpoint", str(ckpt),
             "--checkpoint-every", str(EVERY)]  # fmt: skip
    stopped, err = _interrupted(first, env, f"checkpoint at step {EVERY} ")
    assert EVERY <= stopped < TOTAL
    assert f"continue with --resume {ckpt}: it ends at step {TOTAL}" in err, err
    assert read_extra(ckpt)["steps_done"] == stopped  # the step in flight was kept

    # --resume alone: it goes on towards step TOTAL, saving into the same directory (and every
    # EVERY steps) without being told; its own interruption keeps every step it made.
    resume = [*SMALL, "--resume", str(ckpt)]
    again, err = _interrupted(resume, env, f"checkpoint at step {stopped + EVERY} in {ckpt}")
    assert stopped + EVERY <= again < TOTAL, err
    extra = read_extra(ckpt)
    assert extra["steps_done"] == again and extra["target_steps"] == TOTAL
    assert (ckpt / "steps" / f"step-{stopped + EVERY:09d}").is_dir()

    done = _command(*resume, env=env)
    assert done.returncode == 0, done.stderr
    assert f"(this run: steps {again + 1}-{TOTAL})" in done.stdout, done.stdout
    assert re.search(rf"checkpoint\s+{re.escape(str(ckpt))} \(every {EVERY} steps", done.stdout)
    assert read_extra(ckpt)["steps_done"] == TOTAL
    finished = _command(*resume, env=env)
    assert finished.returncode == 0, finished.stderr
    assert "nothing left to train" in _last_line(finished.stderr), finished.stderr

    straight = _command(*SMALL, "--steps", str(TOTAL), "--checkpoint", str(tmp_path / "b"),
                        env=env)  # fmt: skip
    assert straight.returncode == 0, straight.stderr
    _assert_same(_checkpoint_tensors(ckpt), _checkpoint_tensors(tmp_path / "b"))


def test_resume_with_steps_trains_that_many_more(tmp_path: Path, capsys) -> None:
    """--steps given to a resumed run still counts from where it starts (and is recorded as
    the new end); --checkpoint given saves there instead."""
    from embcache.cli import main

    ckpt = tmp_path / "a"
    assert main([*SMALL, "--steps", "3", "--checkpoint", str(ckpt)]) == 0
    assert main([*SMALL, "--resume", str(ckpt), "--steps", "2"]) == 0
    extra = read_extra(ckpt)
    assert (extra["steps_done"], extra["target_steps"]) == (5, 5)
    other = tmp_path / "b"
    assert main([*SMALL, "--resume", str(ckpt), "--steps", "1", "--checkpoint", str(other)]) == 0
    assert read_extra(other)["steps_done"] == 6
    assert read_extra(ckpt)["steps_done"] == 5
    out = capsys.readouterr().out
    assert "(the checkpoint's run's; --checkpoint changes it)" in out


def test_a_full_disk_during_a_periodic_save_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The device fills during the second periodic save: the run ends with one line naming
    the path, saying the disk is full and that the checkpoint of the first save is kept (the
    failed save's files are removed)."""
    import embcache.checkpoint as checkpoint
    from embcache.cli import main

    real = checkpoint.write_tensors
    saves = [0]

    def write_tensors(root: Path, name: str, *args, **kwargs):
        if name == "dense.safetensors":
            saves[0] += 1
        if saves[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(root / name))
        return real(root, name, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_tensors", write_tensors)
    ckpt = tmp_path / "a"
    with pytest.raises(SystemExit) as info:
        main([*SMALL, "--steps", "10", "--checkpoint", str(ckpt), "--checkpoint-every", "2"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = _last_line(err)
    assert line == (
        f"embcache train: error: --checkpoint {ckpt}: saving step 4 failed (no space left on "
        "its device; the partial files were removed); the last good checkpoint, of step 2, is "
        f"kept in {ckpt} (continue with --resume {ckpt} once there is room)"
    ), line
    assert [line for line in err.splitlines() if "error" in line] == [line], err
    assert read_extra(ckpt)["steps_done"] == 2
    assert not list(ckpt.glob(".tmp-*")), list(ckpt.iterdir())


def test_the_same_command_again_says_only_the_rows_continue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --resume a second run on a Redis namespace starts from the rows the first left,
    with new MLPs and the data from its first batch: its summary says so, and how to continue
    the whole model; a --resume says the rows were restored, without that note."""
    from embcache.cli import main
    from tests.kv.redis_servers import running_server

    note = "only the rows continue: the MLPs, the dense optimizer and the data start over"
    with running_server(tmp_path) as server:
        argv = [*SMALL, "--steps", "2", "--store", f"{server.url}?namespace=again"]
        assert main([*argv, "--checkpoint", str(tmp_path / "a")]) == 0
        assert note not in capsys.readouterr().out
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert re.search(r"tier rows .*continued from [\d,]+ rows .*" + note, out), out
        assert main([*SMALL, "--resume", str(tmp_path / "a"), "--steps", "1"]) == 0
        assert note not in capsys.readouterr().out
