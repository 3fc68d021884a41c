"""``embcache bench``: run the scripts in a checkout's ``benchmarks/`` (all, or some by name).

The scripts are not part of the installed package: they measure against torchrec and FBGEMM
and write plots, so they live beside the tests in the repository. Results go to ``--out DIR``,
by default ``./embcache-bench/<timestamp>/`` under the current directory, one folder for the
whole run; the committed ``benchmarks/results/`` change only with ``--update-results``, run
inside the checkout. The scripts (``benchmarks/_common.py``) take the same defaults and
refusal from here when run directly. ``--quick`` passes each script its smoke-test sizes (every
impl, check, CSV and plot; figures too small for conclusions): benchmarks/README.md, "Quick
runs", says what all of them together cost.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
BENCHMARKS_DIR = CHECKOUT / "benchmarks"
RESULTS_DIR = BENCHMARKS_DIR / "results"  # committed: only --update-results writes here


def available_benchmarks(directory: Path = BENCHMARKS_DIR) -> dict[str, Path]:
    """``{name: path}`` of the ``bench_NAME.py`` scripts in ``directory``; empty unless it is a
    checkout's benchmarks folder (an installed package's parent, site-packages, may hold some
    other project's ``benchmarks``)."""
    if not (directory / "_common.py").is_file():
        return {}
    return {p.stem.removeprefix("bench_"): p for p in sorted(directory.glob("bench_*.py"))}


def description(path: Path) -> str:
    """The first paragraph of a script's module docstring, on one line (read without
    importing the script)."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (OSError, SyntaxError):
        return ""
    return " ".join(doc.split("\n\n")[0].split()) if doc else ""


def print_list(found: dict[str, Path]) -> None:
    """One entry per benchmark: its name, then its whole description wrapped to the terminal."""
    width = max(len(n) for n in found) + 2
    columns = max(60, min(shutil.get_terminal_size().columns, 100))
    for name, path in found.items():
        text = textwrap.fill(
            description(path),
            width=columns,
            initial_indent=f"{name:<{width}}",
            subsequent_indent=" " * width,
        )
        print(text or name)


def default_out_dir() -> Path:
    """``./embcache-bench/<timestamp>/`` under the current directory."""
    return Path.cwd() / "embcache-bench" / time.strftime("%Y%m%d-%H%M%S")


def update_refusal() -> str | None:
    """Why ``--update-results`` is refused here, or None when the current directory is inside
    the git checkout: a run from anywhere else never writes into the checkout."""
    if not (CHECKOUT / ".git").exists():
        return f"--update-results rewrites a git checkout's {RESULTS_DIR}; {CHECKOUT} is not one"
    cwd = Path.cwd().resolve()
    if cwd != CHECKOUT and CHECKOUT not in cwd.parents:
        return (
            f"--update-results rewrites the committed results in {RESULTS_DIR}; run it from "
            f"inside that checkout, not from {cwd} (or give --out DIR)"
        )
    return None


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    found = available_benchmarks(BENCHMARKS_DIR)
    if not found:
        parser.exit(
            2,
            f"{parser.prog}: error: embcache bench runs the scripts in a checkout's benchmarks/ "
            f"folder, and this embcache ({CHECKOUT}) has none: clone the embcache repository "
            "and run it there\n",
        )
    if args.list:
        print_list(found)
        return 0
    unknown = [n for n in args.names if n not in found]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {', '.join(found)}")
    if args.update_results:
        refused = update_refusal()
        if refused:
            parser.error(refused)
        where = ["--update-results"]
        out = RESULTS_DIR
    else:
        out = args.out or default_out_dir()
        out.mkdir(parents=True, exist_ok=True)
        where = ["--out", str(out)]
    status = 0
    for name in args.names or list(found):
        cmd = [sys.executable, str(found[name]), *where]
        if args.quick:
            cmd.append("--quick")
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run(cmd, check=False).returncode
        print(f"== {name}: exit {rc} after {time.perf_counter() - start:.1f} s", flush=True)
        status = status or rc
    print(f"results in {out}")
    return status
