"""`embcache train` on small real data with its default options (issue 37): a file smaller than
one batch trains with the batch shrunk to fit; the default cache holds one batch's unique rows
(at a small split's default batch, 256, and at --batch-size 1024);
warnings print above the progress bar as one line, attributed to the user's code in a library
call; --epochs, --eval-every's best step and --early-stop; the first step says when it compiles
the CPU kernels and the bar's rate leaves it out."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import embcache
from embcache.cache import CacheOverflowWarning
from embcache.cli import main
from tests.data import formats


@pytest.fixture(autouse=True)
def keep_threads():
    """`embcache train` sets torch's thread count (--threads); restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def criteo_200(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real-format Criteo file of 200 lines: fewer than one default batch of 1024."""
    return formats.write_criteo(tmp_path_factory.mktemp("criteo") / "small.txt", 200, seed=0)


@pytest.fixture(scope="module")
def ml_100k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ml-100k-shaped directory: as many users and items as a batch of 1024 touches."""
    root = tmp_path_factory.mktemp("ml") / "ml-100k"
    return formats.write_ml_100k(root, n_users=900, n_items=1600, n_ratings=12_000)


def _summary(out: str, key: str) -> str:
    found = re.search(rf"^  {key}\s+(.*)$", out, re.MULTILINE)
    assert found, out
    return found[1]


def test_a_file_smaller_than_one_batch_trains(
    criteo_200: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """200 lines, default options (a few steps): the batch, a small split's 256, shrinks to
    the training split's 180-odd lines, the last 10% stays held out, and the summary says so
    once."""
    assert main(["train", "--data", f"criteo:{criteo_200}", "--steps", "20", "--no-progress"]) == 0
    out = capsys.readouterr().out
    held_out = re.search(r"held-out\s+AUC ([\d.]+), logloss [\d.]+ on (\d+) samples", out)
    assert held_out, out
    assert 10 <= int(held_out[2]) <= 30, out  # about the last 10% of 200 lines
    batch = _summary(out, "batch")
    found = re.fullmatch(
        r"(\d+) samples, shrunk from 256, the default for a training split of fewer than "
        r"102,400 samples, to fit the training split \((\d+) samples\)",
        batch,
    )
    assert found and found[1] == found[2] and int(found[1]) + int(held_out[2]) == 200, out
    assert out.count("shrunk") == 1
    assert f"batch {found[1]}" in _summary(out, "data")


def test_a_file_too_small_to_hold_out_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line: nothing to hold out, a one-line error (exit 1)."""
    path = formats.write_criteo(tmp_path / "one.txt", 1, seed=0)
    with pytest.raises(SystemExit) as info:
        main(["train", "--data", f"criteo:{path}", "--steps", "2", "--no-progress"])
    assert info.value.code == 1
    assert capsys.readouterr().err == "embcache train: error: --data: the held-out split is empty\n"


@pytest.mark.parametrize(
    ("extra", "batch"), [([], 256), (["--batch-size", "1024"], 1024)], ids=["default", "1024"]
)
def test_default_cache_holds_one_batch(
    ml_100k: Path, extra: list[str], batch: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """MovieLens: the default load factor (10%) is under one batch's unique rows, at the small
    split's default batch and at --batch-size 1024; the default cache is raised to hold them,
    so no batch overflows it."""
    argv = ["train", "--data", f"movielens:{ml_100k}", "--steps", "4", "--eval-batches", "0",
            *extra]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert not [w for w in caught if issubclass(w.category, CacheOverflowWarning)]
    assert f"batch {batch}" in _summary(out, "data")
    cache = _summary(out, "cache")
    assert "default sized to hold one batch's unique ids" in cache, cache
    rows = int(re.match(r"([\d,]+) rows", cache)[1].replace(",", ""))
    assert rows >= batch  # a batch's users and items alone: more unique ids than a batch
    # A size the user chose stays as given (and does overflow).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*argv, "--no-progress", "--load-factor", "0.1"]) == 0
    assert [w for w in caught if issubclass(w.category, CacheOverflowWarning)]
    assert "default sized" not in capsys.readouterr().out


def _bar_lines(err: str) -> list[str]:
    """stderr as the terminal's lines: tqdm redraws with carriage returns."""
    return [part for line in err.split("\n") for part in line.split("\r") if part.strip()]


def test_warnings_print_above_the_bar(ml_100k: Path) -> None:
    """A cache smaller than a batch, with the progress bar on: the overflow warning is one
    line of its own (no source file, no stray source line), never inside a bar line."""
    done = subprocess.run(
        [sys.executable, "-m", "embcache.cli", "train", "--data", f"movielens:{ml_100k}",
         "--steps", "4", "--eval-batches", "0", "--cache-capacity", "64"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = _bar_lines(done.stderr)
    said = [line for line in lines if "CacheOverflowWarning" in line]
    assert len(said) == 1, done.stderr
    assert said[0].startswith("warning: CacheOverflowWarning: a batch has"), said[0]
    assert "step/s" not in said[0] and "%|" not in said[0]
    for stray in ("profiling.py", "warnings.warn", "sizing.py", "Warning:\n"):
        assert stray not in done.stderr, done.stderr
    assert "embcache train: summary" in done.stdout


def test_overflow_warning_points_at_the_callers_line() -> None:
    """In a library call, the warning names the user's line (the forward), not embcache's."""
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=[
            embcache.TableConfig(name="t", embedding_dim=4, num_embeddings=100, feature_names=["f"])
        ],
        cache=embcache.CacheConfig(capacity=4),
    )
    batch = embcache.JaggedBatch.from_lengths(["f"], torch.arange(10), torch.ones(10, dtype=int))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        ebc(batch)
    found = [w for w in caught if issubclass(w.category, CacheOverflowWarning)]
    assert len(found) == 1
    assert (found[0].filename, found[0].lineno) == (__file__, line)


def test_epochs_and_the_best_step(ml_100k: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--epochs N: N passes over the training split's full batches; --eval-every: the best
    held-out step in the summary."""
    argv = ["train", "--data", f"movielens:{ml_100k}", "--batch-size", "1024", "--dim", "8",
            "--no-progress"]  # fmt: skip
    assert main([*argv, "--epochs", "2", "--eval-every", "5"]) == 0
    out = capsys.readouterr().out
    batches = 12_000 * 9 // 10 // 1024  # the training split's full batches
    assert _summary(out, "training").startswith(
        f"{2 * batches} steps (2 epochs of {batches} batches) in"
    )
    during = _summary(out, "during run")
    assert re.match(r"3 evaluations \(every 5 steps\); best AUC 0\.\d+ at step \d+", during)


def test_early_stop_keeps_the_best_model(
    ml_100k: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--early-stop 1: training ends at the first evaluation that is no better than the best
    before it, and the model kept, evaluated at the end and checkpointed is the best one (the
    evaluation before), not the last; its checkpoint's run ends there."""
    from embcache.checkpoint import read_extra

    ckpt = tmp_path / "ckpt"
    argv = ["train", "--data", f"movielens:{ml_100k}", "--batch-size", "256", "--dim", "8",
            "--lr", "0.5", "--steps", "300", "--eval-every", "3", "--early-stop", "1",
            "--checkpoint", str(ckpt), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    steps = int(re.match(r"(\d+) steps", _summary(out, "training"))[1])
    assert steps < 300 and steps % 3 == 0, out
    during = _summary(out, "during run")
    best = re.search(r"best AUC (0\.\d+) at step (\d+)", during)
    assert best and int(best[2]) == steps - 3, during
    assert during.endswith(
        f"; stopped early: 1 evaluations without a better AUC; kept the model of step "
        f"{steps - 3} (the best), not the last"
    ), during
    evaluations = int(re.match(r"(\d+) evaluations", during)[1])
    assert evaluations == steps // 3
    held_out = _summary(out, "held-out")
    assert held_out.startswith(f"AUC {best[1]}, "), held_out  # the kept model's own numbers
    assert held_out.endswith(f"(the model of step {steps - 3})"), held_out
    extra = read_extra(ckpt)
    assert extra["steps_done"] == extra["target_steps"] == steps - 3
    assert not list(ckpt.glob(".best-*"))  # the best model's scratch copy is gone
    # --resume of an early-stopped run has nothing left to do.
    assert main(["train", "--data", f"movielens:{ml_100k}", "--batch-size", "256", "--dim",
                 "8", "--resume", str(ckpt), "--no-progress"]) == 0  # fmt: skip
    assert "nothing left to train" in capsys.readouterr().err


def test_a_full_disk_while_keeping_the_best_model_is_one_line(
    ml_100k: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    import embcache.cli.saving as saving

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(saving, "embcache_save", full)
    argv = ["train", "--data", f"movielens:{ml_100k}", "--batch-size", "256", "--dim", "8",
            "--steps", "6", "--eval-every", "3", "--early-stop", "1", "--no-progress"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.fullmatch(
        r"embcache train: error: --early-stop: saving the best model so far \(step 3 of this "
        r"run\) into \S+ failed \(no space left on its device\)\n",
        err,
    ), err


def test_the_default_length_is_epochs(ml_100k: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--data without --steps or --epochs on a small split (10,800 training ratings): batches
    of 256 at the default learning rates times 256/1024, five passes, or with a --batch-size
    leaving fewer than 20 batches the passes that make 20 steps at the rates unscaled; the
    summary says how many epochs ran and why the rates are what they are. --steps on a file
    says how many epochs those steps were. (The rule at its boundary:
    tests/test_default_length.py.)"""
    argv = ["train", "--data", f"movielens:{ml_100k}", "--dim", "8", "--eval-batches", "0",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    batches = 12_000 * 9 // 10 // 256  # 42 full batches of a small split's 256
    out = capsys.readouterr().out
    assert _summary(out, "training").startswith(
        f"{5 * batches} steps (5 epochs of {batches} batches) in"
    )
    assert _summary(out, "optimizer") == (
        "adagrad, lr 0.0125 (sparse), 0.0025 (dense), the defaults times 256/1024 for the batch "
        "of 256"
    )
    assert _summary(out, "batch") == (
        "256 samples, the default for a training split of fewer than 102,400 samples (this "
        "one: 10,800)"
    )
    assert main([*argv, "--batch-size", "2048"]) == 0  # 5 batches: 4 epochs make 20 steps
    out = capsys.readouterr().out
    assert _summary(out, "training").startswith("20 steps (4 epochs of 5 batches) in")
    assert "  batch  " not in out  # the batch asked for, as given
    assert _summary(out, "optimizer") == "adagrad, lr 0.05 (sparse), 0.01 (dense)"
    assert main([*argv, "--steps", "21"]) == 0
    assert _summary(capsys.readouterr().out, "training").startswith(
        f"21 steps (0.5 epochs of {batches} batches) in"
    )


def test_over_training_is_said(criteo_200: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Hundreds of passes over a small file: training loss near 0, held-out log loss high:
    one warning line in the summary. The default length does not get there."""
    argv = ["train", "--data", f"criteo:{criteo_200}", "--no-progress"]
    assert main([*argv, "--steps", "200"]) == 0
    out = capsys.readouterr().out
    warning = _summary(out, "warning")
    assert warning.startswith("over-trained: training loss 0.0"), warning
    assert "(--epochs)" in warning and "--early-stop" in warning, warning
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "over-trained" not in out
    assert "(5 epochs of 1 batch)" in _summary(out, "training"), out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "5", "--epochs", "1"], "--steps and --epochs: give one"),
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--early-stop", "2"], "--early-stop 2 counts evaluations during the run"),
        (["--early-stop", "-1"], "--early-stop must be >= 0"),
    ],
)
def test_bad_schedules_exit_2(
    extra: list[str], message: str, ml_100k: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--data", f"movielens:{ml_100k}", *extra, "--no-progress"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_epochs_of_synthetic_data_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--epochs", "1", "--no-progress"])
    assert info.value.code == 2
    assert "--epochs needs --data" in capsys.readouterr().err


def test_the_first_compilation_is_said(
    ml_100k: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """When numba compiles in the first step, the bar's stream says so, then the first
    step's time, and the bar's count starts after it; the summary gives that time."""
    from embcache import native

    @contextmanager
    def compiles_now(callback):
        callback()  # as numba's compile event at the first kernel call
        yield

    monkeypatch.setattr(native, "on_compile", compiles_now)
    argv = ["train", "--data", f"movielens:{ml_100k}", "--steps", "3", "--eval-batches", "0"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    lines = _bar_lines(captured.err)
    said = [k for k, line in enumerate(lines) if line == "compiling CPU kernels (once, cached)..."]
    took = [k for k, line in enumerate(lines) if line.startswith("compiled CPU kernels: the ")]
    assert len(said) == 1 and len(took) == 1 and said[0] < took[0], captured.err
    assert re.search(r"the first step took [\d.]+ s$", lines[took[0]])
    assert any(re.search(r"1/3 \[00:00<\?", line) for line in lines[took[0] :]), captured.err
    assert "compiling CPU kernels, once)" in _summary(captured.out, "training")


def test_on_compile_sees_a_compilation_not_a_cached_call() -> None:
    """Only embcache's kernels count: numba's own helpers (a typed list's, compiled afresh in
    every process) once made every run say "compiling CPU kernels"."""
    import numpy as np
    from numba import njit, typed

    from embcache import native

    seen: list[int] = []

    def twice(x):
        return 2 * x

    twice.__module__ = "embcache.native.probe"  # as a kernel of the package
    twice = njit(twice)

    @njit
    def thrice(x):  # a function of this test module: not embcache's
        return 3 * x

    with native.on_compile(lambda: seen.append(1)):
        assert twice(3) == 6
        assert seen == [1]
        assert twice(4) == 8  # compiled already
        assert seen == [1]
        assert thrice(2) == 6
        assert len(typed.List([np.zeros((2, 3), dtype=np.uint16)])) == 1  # a type seen nowhere else
        assert seen == [1]
    twice(5.0)  # outside the block: not reported
    assert seen == [1]
