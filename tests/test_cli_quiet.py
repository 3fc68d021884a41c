"""A successful ``embcache train --nproc 2`` prints no warnings it cannot act on: the ranks once
left tqdm's multiprocessing lock registered with the resource tracker ("leaked semaphore
objects" at exit), and torch warned about its own ``is_fx_tracing`` call."""

from __future__ import annotations

import subprocess
import sys

import pytest

SMALLEST = [
    "train",
    "--scale", "0.0005",
    "--steps", "2",
    "--batch-size", "64",
    "--dim", "8",
    "--eval-batches", "0",
    "--no-progress",
]  # fmt: skip


@pytest.mark.slow
def test_two_ranks_end_without_leaked_semaphores() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "embcache.cli", *SMALLEST, "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "embcache train: summary" in done.stdout
    assert "leaked semaphore" not in done.stderr, done.stderr
    assert "resource_tracker" not in done.stderr, done.stderr
    assert "is_fx_tracing" not in done.stderr, done.stderr
