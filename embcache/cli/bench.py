"""``embcache bench``: run the scripts in ``benchmarks/`` (all, or some by name)."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def available_benchmarks(directory: Path = BENCHMARKS_DIR) -> dict[str, Path]:
    """``{name: path}`` of the ``bench_NAME.py`` scripts in ``directory``."""
    if not directory.is_dir():
        return {}
    return {p.stem.removeprefix("bench_"): p for p in sorted(directory.glob("bench_*.py"))}


def _summary_line(path: Path) -> str:
    """First line of a script's module docstring (read without importing it)."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (OSError, SyntaxError):
        return ""
    return doc.strip().splitlines()[0] if doc else ""


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    found = available_benchmarks()
    if not found:
        parser.exit(
            2,
            f"{parser.prog}: error: no benchmarks found in {BENCHMARKS_DIR} (they ship with a "
            "source checkout, not with an installed wheel)\n",
        )
    if args.list:
        width = max(len(n) for n in found)
        for name, path in found.items():
            print(f"{name:<{width}}  {_summary_line(path)}")
        return 0
    unknown = [n for n in args.names if n not in found]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {', '.join(found)}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for name in args.names or list(found):
        cmd = [sys.executable, str(found[name])]
        if args.quick:
            cmd.append("--quick")
        if args.out is not None:
            if '"--out"' in found[name].read_text():
                cmd += ["--out", str(args.out / f"{name}.csv")]
            else:
                print(f"== {name}: takes no --out; its results stay where it writes them")
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run(cmd, check=False).returncode
        print(f"== {name}: exit {rc} after {time.perf_counter() - start:.1f} s", flush=True)
        status = status or rc
    return status
