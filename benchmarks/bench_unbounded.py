"""What do unbounded tables cost in accuracy of the id space and of LFU's counts?

Two measurements, each on its own data:

1. **Folding raw 64-bit ids into ``fusion_k`` bits.** An unbounded table's id at or above
   ``2**fusion_k`` is folded to ``mix64(id) & (2**fusion_k - 1)`` (the collection's id fusion,
   `embcache.kernels.ids.fuse_ids`), so two raw ids may share a row. For ``n`` distinct raw
   ids (hashes of a counter: any 63-bit pattern) fused by that very function, the collision
   rate is ``1 - distinct folded ids / n``, the share of ids that land on a row another id
   already took; beside it the rate of ``n`` ids thrown uniformly into ``2**fusion_k`` rows,
   ``1 - m (1 - exp(-n / m)) / n`` with ``m = 2**fusion_k``. For fusion_k 30 (the default)
   and 40, n of 1, 10 and 100 million (``--quick``: 0.1 and 1 million).

2. **LFU counted in a count-min sketch instead of per row.** The same Zipf(1.0) trace over
   1,000,000 rows (batches of 8,192 draws, deduplicated) through a `HotCache` of 16,384 slots
   whose LFU counts each row exactly (8 bytes a row: 8 MB), and through ones whose counts live
   in a 4-row sketch of 1,024 to 262,144 counters a row (16 KB to 4 MB); LRU on the same
   trace is the baseline. Hit rates over 200 batches after 300 warm-up batches
   (``--quick``: 100,000 rows, 2,048 slots, batches of 2,048 draws, 60 + 40 batches).

``--quick`` is a smoke test, too small for conclusions. Prints both tables and writes
``unbounded.csv`` and ``unbounded.png`` (the collision rates against uniform hashing's, the
baseline; the hit rates against exact counts').

    python benchmarks/bench_unbounded.py [--quick] [--threads N]
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import ZipfIds, cpu_bench_parser, pyplot, quick_note, start_cpu_bench, write_csv

from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.hashing import mix64
from embcache.kernels.ids import fuse_ids
from embcache.kv.base import TableSpec
from embcache.kv.host import HostKV

CHUNK = 10_000_000  # raw ids fused per call
SALT = 0x3C6EF372FE94F82B


@dataclass(frozen=True)
class Sizes:
    folded: tuple[int, ...]  # distinct raw ids folded, per fusion_k
    table_rows: int  # of the LFU trace
    slots: int
    draws: int  # per batch
    warmup: int  # batches
    measured: int  # batches


FULL = Sizes((1_000_000, 10_000_000, 100_000_000), 1_000_000, 16384, 8192, 300, 200)
QUICK = Sizes((100_000, 1_000_000), 100_000, 2048, 2048, 60, 40)  # a smoke test


@dataclass
class Row:
    measurement: str  # "folding" or "lfu"
    setting: str  # fusion_k=30 / exact / sketch 4x1024 / lru
    ids_or_rows: int  # distinct raw ids folded, or rows of the table
    measured: float  # collision rate, or hit rate
    expected: float  # uniform-hashing collision rate; NaN for hit rates
    counter_bytes: int  # LFU's counters (0 for folding and LRU)
    seconds: float


def folded_collisions(n: int, fusion_k: int) -> float:
    """Share of ``n`` distinct raw 64-bit ids that fold onto a row another one took."""
    folded = []
    one = torch.zeros(1, dtype=torch.int64)
    for lo in range(0, n, CHUNK):
        counter = torch.arange(lo, min(n, lo + CHUNK), dtype=torch.int64)
        raw = mix64(counter ^ SALT) >> 1 & 0x7FFFFFFFFFFFFFFF  # distinct but for ~n**2/2**64
        lengths = torch.tensor([raw.numel()])
        fused = fuse_ids(raw, lengths, one, one - 2, fusion_k, ["f"], ["t"])
        folded.append(fused)
    distinct = torch.unique(torch.cat(folded)).numel()
    return 1.0 - distinct / n


def uniform_collisions(n: int, fusion_k: int) -> float:
    """The same share for ``n`` ids thrown uniformly into ``2**fusion_k`` rows."""
    m = float(2**fusion_k)
    return 1.0 - m * -math.expm1(-n / m) / n


def lfu_hit_rate(
    trace: list[torch.Tensor], rows: int, config: CacheConfig, warmup: int
) -> tuple[float, int]:
    """(hit rate after ``warmup`` batches, bytes of LFU counters) of one cache on ``trace``."""
    store = HostKV(pin_memory=False)
    spec = TableSpec("t", 4, rows)
    store.init_table(spec)
    cache = HotCache([(0, spec)], config, store, "cpu", fusion_k=30)
    for k, ids in enumerate(trace):
        if k == warmup:
            cache.reset_stats()
        cache.resolve(ids, lock=False)
        cache.release()
    return cache.cache_stats()["hit_rate"], cache.counter_bytes


def main() -> None:
    args = start_cpu_bench(cpu_bench_parser(__doc__, "unbounded.csv"))
    note = quick_note(args.quick)
    rows: list[Row] = []

    print("\nraw 64-bit ids folded into fusion_k bits: share of ids sharing a row")
    print(f"{'fusion_k':>8} {'ids':>13} {'measured':>10} {'uniform':>10}")
    sizes = QUICK if args.quick else FULL
    for fusion_k in (30, 40):
        for n in sizes.folded:
            t0 = time.perf_counter()
            measured = folded_collisions(n, fusion_k)
            expected = uniform_collisions(n, fusion_k)
            rows.append(Row("folding", f"fusion_k={fusion_k}", n, measured, expected, 0,
                            time.perf_counter() - t0))  # fmt: skip
            print(f"{fusion_k:8d} {n:13,} {measured:10.3e} {expected:10.3e}", flush=True)

    table_rows, slots, draws = sizes.table_rows, sizes.slots, sizes.draws
    warmup, measured_batches = sizes.warmup, sizes.measured
    gen = torch.Generator().manual_seed(0)
    zipf = ZipfIds(table_rows, 1.0, gen)
    trace = [zipf.sample(draws, gen).unique() for _ in range(warmup + measured_batches)]
    configs = {"exact": CacheConfig(capacity=slots, policy="lfu", lfu_counters="exact")}
    for width in (1024, 4096, 16384, 65536, 262144):
        configs[f"sketch 4x{width}"] = CacheConfig(
            capacity=slots, policy="lfu", lfu_counters="sketch", sketch_width=width
        )
    configs["lru"] = CacheConfig(capacity=slots, policy="lru")
    print(f"\nLFU counts on Zipf(1.0) over {table_rows:,} rows, {slots:,} slots: hit rate")
    print(f"{'counts':>18} {'counter bytes':>14} {'hit rate':>9} {'vs exact':>9}")
    exact = math.nan
    for name, config in configs.items():
        t0 = time.perf_counter()
        rate, nbytes = lfu_hit_rate(trace, table_rows, config, warmup)
        exact = rate if name == "exact" else exact
        rows.append(Row("lfu", name, table_rows, rate, math.nan, nbytes,
                        time.perf_counter() - t0))  # fmt: skip
        print(f"{name:>18} {nbytes:14,} {rate:9.4f} {rate - exact:+9.4f}", flush=True)
    write_csv(rows, args.out)
    write_plot(rows, args.out.with_suffix(".png"), note)
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")


def write_plot(rows: list[Row], path: Path, note: str) -> None:
    """Left: collision rate against the ids folded, per fusion_k, measured (solid) and uniform
    hashing's (dashed, the baseline). Right: each LFU counter's hit rate minus exact counts'."""
    plt = pyplot()
    fig, (ax_fold, ax_lfu) = plt.subplots(1, 2, figsize=(10, 4))
    folding = [r for r in rows if r.measurement == "folding"]
    for j, setting in enumerate(dict.fromkeys(r.setting for r in folding)):
        mine = [r for r in folding if r.setting == setting]
        n = [r.ids_or_rows for r in mine]
        ax_fold.plot(n, [r.measured for r in mine], "o-", color=f"C{j}", label=f"{setting}")
        ax_fold.plot(n, [r.expected for r in mine], "--", color=f"C{j}",
                     label=f"{setting}, uniform hashing")  # fmt: skip
    ax_fold.set_xscale("log")
    ax_fold.set_yscale("symlog", linthresh=1e-6)  # fusion_k=40 may measure no collision
    ax_fold.set_ylim(bottom=0)
    ax_fold.set_xlabel("distinct raw 64-bit ids folded")
    ax_fold.set_ylabel("share of ids on a row another took")
    ax_fold.set_title("id folding against uniform hashing (baseline)")
    ax_fold.grid(alpha=0.3, which="both")
    ax_fold.legend(fontsize=7)
    lfu = [r for r in rows if r.measurement == "lfu"]
    exact = next(r.measured for r in lfu if r.setting == "exact")
    names = [r.setting for r in lfu]
    colors = ["gray" if r.setting in ("exact", "lru") else "C0" for r in lfu]
    ax_lfu.barh(names, [r.measured - exact for r in lfu], color=colors)
    ax_lfu.axvline(0.0, color="black", linewidth=0.8)
    low = min(min(r.measured - exact for r in lfu), -0.01)
    ax_lfu.set_xlim(1.05 * low, -0.45 * low)  # room right of 0 for the counters' sizes
    ax_lfu.invert_yaxis()
    ax_lfu.set_xlabel(f"hit rate - exact counts' ({exact:.3f})")
    ax_lfu.xaxis.set_major_locator(plt.MaxNLocator(5))
    ax_lfu.set_title(f"LFU counts against exact (baseline), {lfu[0].ids_or_rows:,} rows")
    for y, r in enumerate(lfu):
        kb = f"{r.counter_bytes / 1024:,.0f} KB" if r.counter_bytes else "no counters"
        ax_lfu.annotate(kb, (0, y), xytext=(3, 0), textcoords="offset points", va="center",
                        fontsize=7)  # fmt: skip
    fig.suptitle("unbounded tables: collisions of folded ids, LFU in a sketch"
                 + (f"\n{note}" if note else ""), fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
