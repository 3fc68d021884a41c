"""Each ```python block of README.md runs alone, as a reader pastes it: in a namespace of its
own (every name it uses imported or made in the block), in an empty directory that it leaves
empty. All blocks run in one subprocess (one torch import), each in a fresh namespace, so a
block that leans on a name an earlier block made fails with its NameError.

A block that cannot run in one plain process says so in a comment: ``# needs: torchrun`` (or a
first-line comment that runs it with torchrun) is left out; ``# needs: redis-server`` runs
against a ``redis-server`` this test starts, its ``redis://127.0.0.1:6379`` pointed there. A
block that imports torchrec is skipped where torchrec is not installed.

The README's shell commands: `tests/test_readme.py` runs them; here, every ``redis-server``
command the README gives leaves no file where it is started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NEEDS = re.compile(r"^\s*#\s*needs:\s*(.+?)\s*$", re.MULTILINE)


def _blocks() -> list[tuple[int, str, set[str]]]:
    """(first line number, code, what it needs) of each python block."""
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 2, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            code = "\n".join(body) + "\n"
            needs = {n.strip() for m in NEEDS.findall(code) for n in m.split(",")}
            if body and body[0].lstrip().startswith("#") and "torchrun" in body[0]:
                needs.add("torchrun")
            blocks.append((start, code, needs))
        i += 1
    return blocks


BLOCKS = _blocks()
IDS = [f"line{start}" for start, _, _ in BLOCKS]

# Runs each block of a JSON list in a fresh namespace; prints one result line per block, marked
# apart from what the blocks print.
RUNNER = """
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
for start, code in blocks:
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, f"README.md:{start}", "exec"), namespace)
        result = None
    except BaseException:
        result = traceback.format_exc(limit=-3)
    print("README-BLOCK", json.dumps([start, result]), flush=True)
"""


def _skip_reason(code: str, needs: set[str]) -> str | None:
    if "torchrun" in needs:
        return "the block needs torchrun (several ranks): tests/dmp/test_readme_recipe.py runs it"
    if re.search(r"^\s*(from|import) torchrec\b", code, re.MULTILINE) and (
        importlib.util.find_spec("torchrec") is None
    ):
        return "torchrec is not installed"
    return None


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str | None]:
    """Each runnable block's traceback (None: it ran), from one subprocess."""
    work = tmp_path_factory.mktemp("readme-snippets")
    cwd = work / "cwd"
    cwd.mkdir()
    runnable = [(s, c, n) for s, c, n in BLOCKS if _skip_reason(c, n) is None]
    with ExitStack() as stack:
        if any("redis-server" in n for _, _, n in runnable):
            from tests.kv.redis_servers import running_server

            server = stack.enter_context(running_server(work))
            runnable = [
                (s, c.replace("redis://127.0.0.1:6379", server.url.rsplit("/", 1)[0]), n)
                for s, c, n in runnable
            ]
        (work / "blocks.json").write_text(json.dumps([[s, c] for s, c, _ in runnable]))
        (work / "runner.py").write_text(RUNNER)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
        done = subprocess.run(
            [sys.executable, str(work / "runner.py"), str(work / "blocks.json")],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("README-BLOCK "):
            start, result = json.loads(line.removeprefix("README-BLOCK "))
            results[start] = result
    assert len(results) == len(runnable), f"the runner stopped early:\n{done.stderr[-3000:]}"
    left = sorted(p.name for p in cwd.iterdir())
    assert not left, f"README python blocks left files where they ran: {left}"
    return results


def test_the_readme_has_python_blocks_and_most_run() -> None:
    assert len(BLOCKS) >= 5
    assert sum("torchrun" not in n for _, _, n in BLOCKS) >= len(BLOCKS) - 1


@pytest.mark.slow
@pytest.mark.parametrize(("start", "code", "needs"), BLOCKS, ids=IDS)
def test_each_python_block_runs_alone(
    outcomes: dict[int, str | None], start: int, code: str, needs: set[str]
) -> None:
    reason = _skip_reason(code, needs)
    if reason is not None:
        pytest.skip(reason)
    assert outcomes[start] is None, f"README.md:{start} fails run alone:\n{outcomes[start]}"


def test_redis_server_commands_leave_no_files() -> None:
    """``redis-server`` writes ``dump.rdb`` (and with appendonly an AOF directory) into the
    directory it starts in, a checkout's when pasted there: each command the README gives
    turns both off or points them elsewhere."""
    commands = re.findall(r"`(redis-server[^`]*)`", README.read_text())
    started = [c for c in commands if c.strip() != "redis-server"]  # not the package name
    assert started, "the README gives no redis-server command"
    for command in started:
        assert "--dir" in command or ("--save ''" in command and "--appendonly no" in command), (
            f"README: `{command}` leaves dump.rdb in the directory it is run from"
        )
