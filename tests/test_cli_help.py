"""``embcache --help`` answers at once: the parser imports neither torch nor triton (each
``--help`` took 15-22 s on a busy 2-core machine when it did). The facts the parser shows are
copies in `embcache.cli`, checked here against their homes."""

from __future__ import annotations

import subprocess
import sys

import pytest

import embcache.cli as cli
from embcache.cli import settings
from embcache.data import DEFAULT_BUCKETS, KINDS
from embcache.engine import interface
from embcache.kv.base import ScorePolicy
from embcache.train.loop import SPARSE_OPTIMIZERS

# Modules whose import takes seconds; parsing must not need them.
HEAVY = ("torch", "triton", "numpy", "numba", "torchrec", "matplotlib", "redis")

# What the `embcache` console script runs (pyproject.toml, [project.scripts]).
CONSOLE_SCRIPT = "import sys; from embcache.cli import main; sys.exit(main())"


def _imported_modules(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime ARGV`` and name every module it imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    names = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    return done, names


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "embcache.cli", "--help"],
        ["-m", "embcache.cli", "train", "--help"],
        ["-m", "embcache.cli", "bench", "--help"],
        ["-c", CONSOLE_SCRIPT, "train", "--help"],
        ["-c", CONSOLE_SCRIPT, "train", "--no-such-option"],
    ],
    ids=["top", "train", "bench", "console-script", "bad-option"],
)
def test_help_imports_neither_torch_nor_triton(argv: list[str]) -> None:
    done, names = _imported_modules(argv)
    assert done.returncode == (2 if "--no-such-option" in argv else 0), done.stderr[-2000:]
    assert "embcache.cli" in names, "the probe did not see the parser's imports"
    assert not names & set(HEAVY), f"parsing imported {sorted(names & set(HEAVY))}"
    if "--help" in argv:
        assert "usage: embcache" in done.stdout


def test_import_embcache_is_lazy() -> None:
    """The public names are imported on first use; ``import embcache`` alone stays light."""
    probe = (
        "import sys, embcache; "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules)); "
        "embcache.JaggedBatch; embcache.kv.HostKV; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["[]", "True"]


def test_the_parsers_copies_match_their_homes() -> None:
    for name in (
        "DEFAULT_SCALE",
        "DEFAULT_ZIPF",
        "DEFAULT_DIM",
        "DEFAULT_STEPS",
        "DEFAULT_EPOCHS",
        "DEFAULT_MIN_STEPS",
        "DEFAULT_MAX_EPOCHS",
        "DEFAULT_BATCH",
        "SMALL_SPLIT_BATCHES",
        "SMALL_BATCH",
        "SMALL_EPOCHS",
        "SMALL_BATCH_EPOCHS",
        "DEFAULT_LOAD_FACTOR",
        "DEFAULT_EVAL_BATCHES",
        "DEFAULT_LR",
        "DEFAULT_DENSE_LR",
    ):
        assert getattr(cli, name) == getattr(settings, name), name
    assert cli.DEFAULT_BUCKETS == DEFAULT_BUCKETS
    assert cli.KINDS == KINDS
    assert cli.FUSION_K == interface.FUSION_K
    assert cli.MAX_FUSION_K == interface.MAX_FUSION_K
    assert list(cli.SPARSE_OPTIMIZERS) == list(SPARSE_OPTIMIZERS)
    assert tuple(p.value for p in ScorePolicy) == cli.TIER_POLICIES


def test_lazy_reexports_still_resolve() -> None:
    from embcache.cli.job import save_checkpoint
    from embcache.cli.report import write_plot

    assert cli.save_checkpoint is save_checkpoint
    assert cli.write_plot is write_plot
    with pytest.raises(AttributeError):
        _ = cli.no_such_name
