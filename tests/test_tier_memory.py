"""`embcache train` remembers its Redis tier between runs (`embcache.cli.tier_record`): the
same command run again continues from the rows the last run left, and is refused with the
one-line `TierDataLossError` when the server came back empty in between; ``--resume DIR``
restores the rows from the checkpoint instead, and ``--fresh-tier`` starts over."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from embcache.cli.tier_record import record_path, tier_location
from tests.kv.redis_servers import running_server

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [
    "train",
    "--steps", "20",
    "--scale", "0.0005",
    "--batch-size", "64",
    "--dim", "8",
    "--eval-batches", "0",
    "--no-progress",
]  # fmt: skip


def _train(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """``embcache train`` as its own process in ``cwd``, its local run record in
    ``cwd/state`` (as ``$XDG_STATE_HOME``, for a user's ``~/.local/state``)."""
    return subprocess.run(
        [sys.executable, "-m", "embcache.cli", *TRAIN, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **{k: v for k, v in os.environ.items() if k != "EMBCACHE_TIER_RECORDS"},
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "XDG_STATE_HOME": str(cwd / "state"),
        },
    )


def _ok(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _tier_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip().startswith("tier rows")]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("scheme", ["redis", "tiered+redis"])
def test_a_tier_restarted_empty_between_two_runs_is_refused(tmp_path: Path, scheme: str) -> None:
    with running_server(tmp_path) as server:
        url = server.url.replace("redis", scheme, 1)
        first = _tier_line(_ok(_train(tmp_path, "--store", url)))
        assert "started on an empty namespace" in first
        server.restart()  # no persistence: back empty
        second = _train(tmp_path, "--store", url)
        assert second.returncode == 1, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr  # one line, no traceback
        assert "namespace record" in lines[0] and "missing" in lines[0], lines[0]
        assert "--resume DIR" in lines[0] and "--fresh-tier" in lines[0], lines[0]
        assert "summary" not in second.stdout  # nothing trained
        assert server.client().dbsize() == 0  # refused before writing anything

        third = _tier_line(_ok(_train(tmp_path, "--store", url, "--fresh-tier")))
        assert "started on an empty namespace" in third


def test_the_same_command_again_continues_from_the_rows_left(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with running_server(tmp_path) as server:
        url = server.url + "?namespace=memory"
        _ok(_train(tmp_path, "--store", url, "--checkpoint", str(ckpt)))
        record = record_path(url, directory=tmp_path / "state" / "embcache" / "tiers")
        assert record is not None and record.is_file()
        saved = json.loads(record.read_text())["state"]
        rows = sum(t["rows"] for t in saved["tables"].values())
        assert rows > 0 and saved["namespace"] == "memory"

        second = _tier_line(_ok(_train(tmp_path, "--store", url)))
        match = re.search(r"continued from ([\d,]+) rows", second)
        assert match is not None, second
        assert int(match.group(1).replace(",", "")) == rows

        server.restart()
        resumed = _ok(_train(tmp_path, "--store", url, "--resume", str(ckpt)))
        line = _tier_line(resumed)
        assert "rows restored from the checkpoint" in line and "was empty" in line, line
        assert "lost rows since the checkpoint" in line, line
        # The resumed run records the tier anew: the same command now continues.
        _tier_line(_ok(_train(tmp_path, "--store", url)))


@pytest.mark.parametrize(
    ("url", "same_as"),
    [
        ("redis://:pw@127.0.0.1:6379/0?namespace=a", "redis://127.0.0.1:6379/0?namespace=a"),
        ("tiered+redis://127.0.0.1:6379/0?namespace=a&capacity_rows=9", "redis://127.0.0.1:6379/0?namespace=a"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0?namespace=embcache&owner=x"),
    ],
    ids=["password", "tiered", "default-namespace"],
)  # fmt: skip
def test_the_record_is_keyed_by_server_and_namespace(url: str, same_as: str) -> None:
    assert record_path(url) == record_path(same_as)
    assert record_path(url) != record_path(url.replace("6379", "6380"))
    assert "pw" not in "".join(tier_location(url) or ())
    assert record_path("host") is None
