"""Helpers shared by the benchmark scripts: where results go (`add_output_options`,
`parse_args`), threads, skewed ids, timing, CSV, run header, and a tier with per-call latency
(`SlowStore`).

Imported as ``_common`` by scripts run from anywhere (``python benchmarks/bench_x.py``): Python
puts the script's folder first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import torch

# The embcache of this checkout, even where another one is installed (an editable install of a
# sibling worktree would otherwise be measured instead).
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from embcache.cli.bench import RESULTS_DIR, default_out_dir, update_refusal  # noqa: E402
from embcache.kv.base import Store, TableSpec  # noqa: E402 (after the path is set)


def set_threads(threads: int | None) -> int:
    """Set torch's CPU threads (default 1: stable numbers on a shared machine); returns it."""
    n = 1 if threads is None else threads
    torch.set_num_threads(n)
    return n


def keep_freed_memory() -> str:
    """Tell glibc's malloc to keep the memory a step frees for the next step (no trimming of
    the heap, and ``mmap`` only for blocks over 32 MB), as a CPU training job does by linking
    jemalloc or tcmalloc: with the defaults, a process whose impls free tens of MB a step
    (torchrec's sparse AdaGrad) has them returned to the system and faulted in again, which
    cost a prefetching impl up to 1.3x in one run and any impl some. Applies to every impl
    alike. Returns what was done, for the run's header."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        trim, mmap_threshold = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)
        ok = libc.mallopt(trim, 1 << 30) == 1 and libc.mallopt(mmap_threshold, 32 << 20) == 1
    except (OSError, AttributeError):
        ok = False
    return "malloc keeps freed memory" if ok else "malloc defaults (no glibc mallopt)"


# ----------------------------------------------------------------------------------------------
# where results go
# ----------------------------------------------------------------------------------------------


def add_output_options(parser: argparse.ArgumentParser, csv_name: str) -> None:
    """Add ``--out PATH`` and ``--update-results``; `parse_args` turns them into ``args.out``,
    the CSV to write (its PNG goes beside it, ``args.out.with_suffix(".png")``)."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"a folder to write {csv_name} into, or a path ending .csv for the CSV itself; "
        "a plot goes beside the CSV (default: ./embcache-bench/<timestamp>/ in the current "
        "directory)",
    )
    where.add_argument(
        "--update-results",
        action="store_true",
        help="overwrite the committed results in benchmarks/results/ (only from inside the "
        "checkout)",
    )
    parser.set_defaults(results_name=csv_name)


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``args.out`` resolved by `output_csv` (a refused
    ``--update-results`` exits 2 with one line)."""
    args = parser.parse_args(argv)
    try:
        args.out = output_csv(args.out, args.update_results, args.results_name)
    except ValueError as e:
        parser.error(str(e))
    return args


def output_csv(out: Path | None, update_results: bool, csv_name: str) -> Path:
    """The CSV a benchmark writes: ``out`` itself when it ends ``.csv``, else ``out/csv_name``;
    without ``out``, under ``./embcache-bench/<timestamp>/``; with ``update_results``, the
    committed ``benchmarks/results/csv_name``, refused (``ValueError``) unless the current
    directory is inside this git checkout. ``embcache bench`` follows the same rules (its
    `default_out_dir` and `update_refusal` are these)."""
    if update_results:
        refused = update_refusal()
        if refused:
            raise ValueError(refused)
        return RESULTS_DIR / csv_name
    if out is None:
        out = default_out_dir()
    return out if out.suffix == ".csv" else out / csv_name


# ----------------------------------------------------------------------------------------------
# CPU benchmarks
# ----------------------------------------------------------------------------------------------


def cpu_bench_parser(doc: str, out_name: str) -> argparse.ArgumentParser:
    """The options of a CPU benchmark: ``--quick``, ``--threads`` (1) and the output options
    (`add_output_options`, writing ``out_name``); a script adds its own before
    `start_cpu_bench`."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    add_output_options(parser, out_name)
    return parser


def start_cpu_bench(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the options, set torch's threads and print the run header."""
    args = parse_args(parser)
    set_threads(args.threads)
    print(run_header(torch.device("cpu")))
    return args


QUICK_NOTE = "quick: sizes too small for conclusions"


def quick_note(quick: bool) -> str:
    """Print and return `QUICK_NOTE` for a ``--quick`` run (a smoke test of the script, not a
    measurement), else return "": scripts add it to their plot's title too."""
    if not quick:
        return ""
    print(f"# {QUICK_NOTE}")
    return QUICK_NOTE


def pick_device(name: str | None) -> torch.device:
    """``name`` when given (refusing ``cuda`` without a GPU), else CUDA when present."""
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device here")
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def cpu_model() -> str:
    """The CPU's model name (Linux), or "unknown CPU". With the vector ISA beside it in
    `run_header`: FBGEMM's CPU kernels run 2-3x faster with AVX-512 than with AVX2, so ratios
    against them depend on the machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def run_header(device: torch.device) -> str:
    """One line naming what the numbers were measured on."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        load = os.getloadavg()[0]
        where = (
            f"{platform.processor() or platform.machine()}, {cpu_model()}, vector ISA "
            f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} torch "
            f"thread(s), {os.cpu_count()} cores, load average {load:.1f}"
        )
    try:
        import triton

        tri = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        tri = "absent"
    return f"# device: {device.type} ({where}); torch {torch.__version__}; triton {tri}"


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Force ``EMBCACHE_BACKEND`` (read at every call) inside the block."""
    old = os.environ.get("EMBCACHE_BACKEND")
    os.environ["EMBCACHE_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("EMBCACHE_BACKEND", None)
        else:
            os.environ["EMBCACHE_BACKEND"] = old


# ----------------------------------------------------------------------------------------------
# skewed ids
# ----------------------------------------------------------------------------------------------


class ZipfIds:
    """Ids of a table of ``num_rows`` rows, rank ``k`` drawn with mass ``∝ (k + 1)**-alpha``.

    Ranks map to ids through a fixed affine bijection ``(a * k + b) % num_rows`` (``a`` coprime
    with ``num_rows``), so the hot ids are scattered over the table, not packed at its start.
    """

    def __init__(self, num_rows: int, alpha: float, gen: torch.Generator) -> None:
        self.num_rows = num_rows
        mass = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-alpha)
        self.cdf = torch.cumsum(mass, 0)
        self.cdf /= self.cdf[-1].item()
        a = int(torch.randint(1, max(num_rows, 2), (1,), generator=gen))
        while math.gcd(a, num_rows) != 1:
            a += 1
        self.a, self.b = a, int(torch.randint(0, num_rows, (1,), generator=gen))

    def sample(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """int64 ``[n]`` ids in ``[0, num_rows)``."""
        u = torch.rand(n, dtype=torch.float64, generator=gen)
        ranks = torch.searchsorted(self.cdf, u, right=True).clamp_(max=self.num_rows - 1)
        return (ranks * self.a + self.b) % self.num_rows


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def interleaved_seconds(
    fns: Sequence[Callable[[], object]], device: torch.device, reps: int
) -> list[float]:
    """Seconds per call of each of ``fns``, measured side by side.

    On CPU the calls take turns (one warm-up round, then ``reps`` rounds of one call each), and
    each gets the median of its ``reps`` times: a neighbour's load that comes and goes then
    falls on every function alike, so ratios between them stay fair on a shared machine. On
    CUDA each is timed by `seconds` (``triton.testing.do_bench``).
    """
    if device.type == "cuda":
        return [seconds(fn, device, reps) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(reps + 1):
        for fn, acc in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            if round_:
                acc.append(time.perf_counter() - t0)
    return [statistics.median(acc) for acc in times]


def seconds(
    fn: Callable[[], object], device: torch.device, reps: int, warmup: bool = True
) -> float:
    """Seconds per call of ``fn``: ``triton.testing.do_bench`` (its median) on CUDA; on CPU one
    warm-up call (unless ``warmup`` is False: a call that is slow to repeat, such as a save),
    then the median of ``reps`` timed calls."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    if warmup:
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------


def write_csv(rows: Iterable[Any], path: Path, extra: Iterable[str] = ()) -> None:
    """One CSV line per dataclass row: its fields, then the named properties in ``extra``."""
    rows = list(rows)
    if not rows or not is_dataclass(rows[0]):
        raise ValueError("write_csv needs a non-empty list of dataclass rows")
    extra = list(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in fields(rows[0])] + extra
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in rows:
            writer.writerow({**asdict(r), **{name: getattr(r, name) for name in extra}})


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class SlowStore(Store):
    """A `Store` that forwards to ``inner`` after sleeping ``latency_s`` in each get/read/put call.

    Thread-safe: the prefetch thread, the training thread and the cache's per-table I/O
    threads may all call it. ``tier_seconds`` is the wall time during which at least one call
    was in flight (concurrent calls count once), ``calls`` counts them. ``parallel_io`` tells
    the cache that concurrent calls overlap their latency, as a remote tier's do.
    """

    parallel_io = True

    def __init__(self, inner: Store, latency_s: float) -> None:
        self.inner = inner
        self.latency_s = latency_s
        self.calls = 0
        self.tier_seconds = 0.0
        self._active = 0  # calls in flight
        self._busy_since = 0.0
        self._lock = threading.Lock()

    def _timed(self, fn, *args):
        with self._lock:
            if not self._active:
                self._busy_since = time.perf_counter()
            self._active += 1
        if self.latency_s:
            time.sleep(self.latency_s)
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.calls += 1
                self._active -= 1
                if not self._active:
                    self.tier_seconds += time.perf_counter() - self._busy_since

    def get(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self._timed(self.inner.get, table, ids)

    def read(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self._timed(self.inner.read, table, ids)

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._timed(self.inner.put, table, ids, rows)

    def snapshot(self) -> tuple[int, float]:
        """``(calls, tier_seconds)`` so far."""
        with self._lock:
            return self.calls, self.tier_seconds

    def init_table(self, spec: TableSpec) -> None:
        self.inner.init_table(spec)

    def table_spec(self, table: str) -> TableSpec:
        return self.inner.table_spec(table)

    def tables(self) -> list[str]:
        return self.inner.tables()

    def export_rows(
        self, table: str, chunk_rows: int = 65536
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.inner.export_rows(table, chunk_rows)

    def import_rows(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.inner.import_rows(table, ids, rows)

    def close(self) -> None:
        self.inner.close()
