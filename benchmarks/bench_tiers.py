"""How fast do rows cross each backing tier? HostKV (the named baseline) vs RedisKV vs TieredKV.

For embedding dims 16/64/128, batches of distinct ids drawn from Zipf(1.0) traffic over the table
(hot ids scattered by a fixed permutation) are read (`get`) and written back (`put`) through:

* ``host``   HostKV, in-process memory: the baseline every ratio is against;
* ``redis``  RedisKV on a single redis-server this script starts on a free loopback port;
* ``tiered`` TieredKV (host row cache of ``--cache-frac`` of the table) in front of that RedisKV.

Every row the run touches is created first (untimed); TieredKV's cache is then warmed by one set
of batches and timed on another, fresh draws of the same traffic. Reads are timed, then writes
of the rows read; "write+flush" adds TieredKV's final `flush`, so every row has reached Redis
when its clock stops (the ratio to HostKV uses it). Prints a table; writes tiers.csv and
tiers.png (rows/s relative to HostKV) where ``--out`` says (default ./embcache-bench/<timestamp>/).

    .venv/bin/python benchmarks/bench_tiers.py            # full
    .venv/bin/python benchmarks/bench_tiers.py --quick    # < 20 s
"""

from __future__ import annotations

import argparse
import csv
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _common import add_output_options, parse_args, quick_note

from embcache.kv.base import Store, TableSpec
from embcache.kv.host import HostKV
from embcache.kv.redis_kv import RedisKV
from embcache.kv.tiered import TieredKV

DIMS = (16, 64, 128)
BASELINE = "host"


@dataclass
class Row:
    store: str
    dim: int
    batch: int
    rows_timed: int
    read_rows_per_s: float
    write_rows_per_s: float  # puts alone
    write_flushed_rows_per_s: float  # puts and TieredKV's final flush: every row reached Redis
    read_vs_host: float
    write_vs_host: float  # of write_flushed_rows_per_s
    hit_rate: float | None  # TieredKV only: fraction of read ids served from host memory


@contextmanager
def redis_server() -> Iterator[str]:
    """A redis-server on a free loopback port (no persistence), stopped on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: install it (apt-get install -y redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--daemonize", "no", "--dir", workdir]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 10
            while True:
                try:
                    RedisKV(url).close()
                    break
                except ConnectionError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise
                    time.sleep(0.02)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=10)


def zipf_batches(num_embeddings: int, batch: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` batches of ``batch`` distinct ids, Zipf(1.0) by rank, ranks scattered."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_embeddings + 1, dtype=torch.float64)
    scatter = torch.randperm(num_embeddings, generator=g)
    return [
        scatter[torch.multinomial(weights, batch, replacement=False, generator=g)]
        for _ in range(count)
    ]


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Speeds:
    read: float  # rows/s of get
    write: float  # rows/s of put
    write_flushed: float  # rows/s of put, with TieredKV's final flush counted in
    hit_rate: float | None


def measure(
    store: Store, dim: int, warm: list[torch.Tensor], timed_batches: list[torch.Tensor], n: int
) -> Speeds:
    """Read then write ``timed_batches`` through ``store``.

    Every row the run touches is created first (through the back store for TieredKV, so its
    cache starts cold), then TieredKV's cache is warmed by the ``warm`` batches: the timed
    batches are fresh draws of the same traffic, never a replay of what the cache just saw.
    """
    table = f"bench{dim}"
    store.init_table(TableSpec(table, dim=dim, num_embeddings=n))
    creator = store.back if isinstance(store, TieredKV) else store
    for ids in warm + timed_batches:
        creator.get(table, ids)
    for ids in warm:
        store.get(table, ids)
    if isinstance(store, TieredKV):
        store.reset_io_stats()
    rows = [store.get(table, ids) for ids in timed_batches[:1]]  # values to write back
    total = sum(ids.numel() for ids in timed_batches)

    def read() -> None:
        for ids in timed_batches:
            rows.append(store.get(table, ids))

    def write() -> None:
        for ids, values in zip(timed_batches, rows[1:], strict=True):
            store.put(table, ids, values)

    hit_rate = None
    if isinstance(store, TieredKV):
        store.reset_io_stats()
    read_s = timed(read)
    if isinstance(store, TieredKV):
        stats = store.io_stats()
        hit_rate = stats["hits"] / max(1, stats["hits"] + stats["misses"])
    write_s = timed(write)
    flush_s = timed(store.flush) if isinstance(store, TieredKV) else 0.0
    return Speeds(total / read_s, total / write_s, total / (write_s + flush_s), hit_rate)


def run(args: argparse.Namespace) -> list[Row]:
    batches = zipf_batches(args.num_embeddings, args.batch, 2 * args.batches)
    warm, timed_batches = batches[: args.batches], batches[args.batches :]
    capacity = max(1, int(args.cache_frac * args.num_embeddings))
    results: list[Row] = []
    with redis_server() as url:
        for dim in DIMS:
            stores: dict[str, Store] = {
                "host": HostKV(pin_memory=False),
                "redis": RedisKV(url, namespace=f"redis{dim}", chunk_rows=args.chunk_rows),
                "tiered": TieredKV(
                    RedisKV(url, namespace=f"tiered{dim}", chunk_rows=args.chunk_rows),
                    capacity_rows=capacity,
                ),
            }
            speeds = {
                name: measure(store, dim, warm, timed_batches, args.num_embeddings)
                for name, store in stores.items()
            }
            base = speeds[BASELINE]
            for name, got in speeds.items():
                results.append(
                    Row(
                        store=name,
                        dim=dim,
                        batch=args.batch,
                        rows_timed=args.batch * args.batches,
                        read_rows_per_s=got.read,
                        write_rows_per_s=got.write,
                        write_flushed_rows_per_s=got.write_flushed,
                        read_vs_host=got.read / base.read,
                        write_vs_host=got.write_flushed / base.write_flushed,
                        hit_rate=got.hit_rate,
                    )
                )
                stores[name].close()
    return results


def report(results: list[Row], args: argparse.Namespace) -> None:
    print(
        f"# tiers: {args.batches} batches x {args.batch} ids, Zipf(1.0) over "
        f"{args.num_embeddings} rows; TieredKV holds {args.cache_frac:.0%} of the table; "
        f"torch threads {torch.get_num_threads()}; baseline {BASELINE}"
    )
    header = f"{'store':>7} {'dim':>4} {'read rows/s':>12} {'write rows/s':>13}"
    print(header + f" {'write+flush':>12} {'read/host':>10} {'write/host':>11} {'hit rate':>9}")
    for r in results:
        hit = f"{r.hit_rate:9.3f}" if r.hit_rate is not None else f"{'-':>9}"
        print(
            f"{r.store:>7} {r.dim:>4} {r.read_rows_per_s:12.4g} {r.write_rows_per_s:13.4g} "
            f"{r.write_flushed_rows_per_s:12.4g} {r.read_vs_host:10.4f} "
            f"{r.write_vs_host:11.4f} {hit}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)
    plot(results, args.out.with_suffix(".png"), quick_note(args.quick))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(results: list[Row], path: Path, note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    stores = [s for s in dict.fromkeys(r.store for r in results) if s != BASELINE]
    width = 0.8 / len(stores)
    for ax, field, title in zip(
        axes, ("read_vs_host", "write_vs_host"), ("read", "write"), strict=True
    ):
        for k, store in enumerate(stores):
            mine = [r for r in results if r.store == store]
            xs = [DIMS.index(r.dim) + k * width for r in mine]
            ax.bar(xs, [getattr(r, field) for r in mine], width, label=store)
        ax.set_xticks([i + width * (len(stores) - 1) / 2 for i in range(len(DIMS))])
        ax.set_xticklabels([f"dim {d}" for d in DIMS])
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{title} rows/s relative to HostKV")
    axes[0].legend()
    if note:
        fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


FULL = (1_000_000, 40)  # rows (--num-embeddings), batches (--batches)
QUICK = (50_000, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="50k rows, 3 batches: a smoke test")
    parser.add_argument("--num-embeddings", type=int, default=None)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--chunk-rows", type=int, default=4096)
    parser.add_argument("--cache-frac", type=float, default=0.1)
    # A tier call is a few small gathers around a round trip: intra-op threads buy nothing
    # there, and on a small shared CPU their spinning slows every store (HostKV most) manyfold.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_output_options(parser, "tiers.csv")
    args = parse_args(parser)
    torch.set_num_threads(args.threads)
    rows, batches = QUICK if args.quick else FULL
    if args.num_embeddings is None:
        args.num_embeddings = rows
    if args.batches is None:
        args.batches = batches
    report(run(args), args)


if __name__ == "__main__":
    main()
