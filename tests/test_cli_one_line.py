"""Issue 45, finding 10 (the CLI's part): a tier whose table was made with another dim is a
one-line error naming the table, the dim it holds and the dim asked for (exit 2, no
traceback), on Redis and on a host row cache in front of Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embcache.cli import main
from tests.kv.redis_servers import running_server

TINY = [
    "train",
    "--scale", "0.0005",
    "--steps", "2",
    "--batch-size", "64",
    "--eval-batches", "0",
    "--no-progress",
]  # fmt: skip


@pytest.fixture(autouse=True)
def keep_threads():
    """`embcache train` sets torch's thread count (--threads); restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("scheme", ["redis", "tiered+redis"])
def test_another_dim_on_a_namespace_is_one_line(
    scheme: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_server(tmp_path) as server:
        url = f"{server.url}?namespace=dims".replace("redis", scheme, 1)
        assert main([*TINY, "--dim", "16", "--store", url]) == 0
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            main([*TINY, "--dim", "8", "--store", url])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"embcache train: error: --store {url}: table 't_cat_0' "), line
    assert "dim=16" in line and "dim=8" in line, line
