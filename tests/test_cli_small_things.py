"""A new user's small findings about ``embcache train`` (issue 48): a held-out AUC without
torchmetrics, a plot whose single evaluation shows both metrics, a bad ``--data`` refused in
one line before torch loads, and ``--help`` naming each data kind's files."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from embcache.cli import data_problem, main

TINY = [
    "train",
    "--scale", "0.0005",
    "--steps", "3",
    "--batch-size", "64",
    "--dim", "8",
    "--eval-batches", "2",
    "--no-progress",
]  # fmt: skip


def test_the_summary_shows_an_auc_without_torchmetrics(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torchmetrics", None)
    monkeypatch.setitem(sys.modules, "torchmetrics.functional.classification", None)
    assert main(TINY) == 0
    out = capsys.readouterr().out
    held = next(line for line in out.splitlines() if line.strip().startswith("held-out"))
    assert re.search(r"AUC 0\.\d{4} \(hidden model 0\.\d{4}\)", held), held
    assert "nan" not in out.lower() and "n/a" not in held, out


def test_an_undefined_auc_says_why_not_nan() -> None:
    from embcache.cli.report import _auc

    assert _auc(float("nan")) == "n/a (the held-out labels are all one class)"
    assert _auc(0.71234) == "0.7123"


def test_one_evaluation_shows_both_markers_apart() -> None:
    """A lone AUC point and a lone log-loss point were drawn at one spot on twin axes, the
    log loss's marker over the AUC's."""
    import matplotlib.pyplot as plt

    from embcache.cli.report import plot_figure
    from embcache.train.loop import TrainResult

    result = TrainResult([0.6, 0.5, 0.4], [0.2, 0.5, 0.7], 1.0, 3, {}, None)
    result.eval = {"auc": 0.7, "logloss": 0.5, "samples": 100.0}
    fig = plot_figure(result)
    try:
        fig.canvas.draw()
        marked = {}
        for ax in fig.axes:
            for line in ax.get_lines():
                if line.get_label() in ("held-out AUC", "held-out log loss"):
                    (x,), (y,) = line.get_xdata(), line.get_ydata()
                    pixel = ax.transData.transform((x, y))
                    assert ax.bbox.contains(*pixel), f"{line.get_label()} is outside its panel"
                    marked[line.get_label()] = (pixel, line.get_markersize())
                    texts = [t.get_text() for t in ax.texts]
                    assert f"{y:.4f}" in texts, texts  # the value, written by its point
        (auc, size), (loss, _) = marked["held-out AUC"], marked["held-out log loss"]
        assert math.dist(auc, loss) > 4 * size  # points; pixels at 100 dpi are more
    finally:
        plt.close(fig)


BAD_DATA = [
    ("parquet:/x", "expected KIND:PATH with KIND one of criteo, criteo-npy, movielens"),
    ("criteo:", "expected KIND:PATH"),
    ("criteo:/nonexistent/train.txt", "/nonexistent/train.txt: no such file or directory"),
    ("movielens:{empty}", "neither u.data (ml-100k) nor ratings.dat (ml-1m) is there"),
    ("criteo-npy:{file}", "not a directory of .npy day files"),
    ("criteo-npy:{empty}", "no day_<d>_dense.npy files"),
    ("criteo:{empty}", "no Criteo day files (day_0, day_1.gz, ...)"),
]


@pytest.mark.parametrize(
    ("spec", "message"),
    BAD_DATA,
    ids=["kind", "no-path", "missing", "not-movielens", "npy-file", "npy-empty", "criteo-dir"],
)
def test_a_bad_data_path_is_seen_before_torch(tmp_path: Path, spec: str, message: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    spec = spec.format(empty=tmp_path / "empty", file=tmp_path / "file")
    problem = data_problem(spec)
    assert problem is not None and message in problem, problem


def test_a_bad_data_path_is_one_line_without_torch(tmp_path: Path) -> None:
    """One process, as a user runs it: exit 2 with one line, no usage, and torch never
    imported (it takes tens of seconds on a busy machine)."""
    spec = f"movielens:{tmp_path}"
    probe = (
        "import sys\n"
        "from embcache.cli import main\n"
        "try:\n"
        f"    main(['train', '--data', {spec!r}])\n"
        "except SystemExit as stop:\n"
        "    print(stop.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr)
    assert done.stderr.startswith(f"embcache train: error: --data {spec}: {tmp_path}: neither")
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_a_good_data_path_is_left_to_its_reader(tmp_path: Path) -> None:
    (tmp_path / "u.data").write_text("")
    (tmp_path / "day_0.gz").write_text("")
    (tmp_path / "day_0_dense.npy").write_text("")
    for kind in ("movielens", "criteo", "criteo-npy"):
        assert data_problem(f"{kind}:{tmp_path}") is None
    assert data_problem(f"criteo:{tmp_path / 'day_0.gz'}") is None


def test_help_names_each_kinds_files(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("u.data", "u.user", "u.item", "ratings.dat", "users.dat", "movies.dat"):
        assert name in text
    assert "I1..I13" in text and "C1..C26" in text and "day_N_dense" in text
