"""The README's shell commands run as written, in a copy of the checkout.

Every ```bash block of README.md is run line by line (a line ending in ``\\`` continues), with
the venv's ``embcache`` on PATH, in a copy of the repository's tracked files, as a new user
would run them in a fresh clone. A block preceded by ``<!-- not run by tests: REASON -->`` is
left out, and must say why (the suite itself, a second machine, an install into another
environment). A Redis URL on the default port is pointed at a ``redis-server`` this test
starts on a free loopback port: the only change made to a command.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kv.redis_servers import running_server

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP = re.compile(r"<!-- not run by tests: (.+?) -->\s*$")


def _blocks() -> list[tuple[int, list[str], str | None]]:
    """(line number, commands, skip reason) of each bash block."""
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start = i + 1
            previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            reason = m[1] if (m := SKIP.search(previous)) else None
            body = []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            commands, pending = [], ""
            for line in body:
                line = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""
                if not line.strip():
                    continue
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                commands.append((pending + line).strip())
                pending = ""
            blocks.append((start, commands, reason))
        i += 1
    return blocks


BLOCKS = _blocks()


def test_every_bash_block_is_run_or_says_why_not() -> None:
    assert BLOCKS, "the README has no bash block"
    for start, commands, reason in BLOCKS:
        assert commands, f"README.md:{start}: an empty bash block"
        assert reason is None or len(reason) > 10, f"README.md:{start}: say why it is not run"
    assert sum(reason is None for _, _, reason in BLOCKS) >= 2, "most blocks must run"


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's tracked files (and untracked ones not ignored), as a clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    dest = tmp_path_factory.mktemp("clone")
    for name in filter(None, listed):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


RUN = [(start, commands) for start, commands, reason in BLOCKS if reason is None]


@pytest.mark.slow
@pytest.mark.parametrize(("start", "commands"), RUN, ids=[f"line{s}" for s, _ in RUN])
def test_readme_block_runs_as_written(
    clone: Path, tmp_path: Path, start: int, commands: list[str]
) -> None:
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    with running_server(tmp_path) as server:
        port = server.url.rsplit(":", 1)[1].split("/", 1)[0]
        for command in commands:
            command = command.replace("127.0.0.1:6379", f"127.0.0.1:{port}")
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=clone,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, (
                f"README.md:{start}: `{command}` exited {done.returncode}\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            )
