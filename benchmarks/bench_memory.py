"""Does memory stay bounded when training streams far more distinct ids than the tier may hold?

Setup: a `CachedEmbeddingBagCollection` of two unbounded tables (``num_embeddings=None``, raw
64-bit ids, dim 16, row-wise AdaGrad), one feature each, bags of 8 ids, batches of 4,096
samples, a device cache of 131,072 slots (the CPU here). Each bag draws 55% of its ids
Zipf(1.05) from a head of 2,000,000 recurring ids per table and 45% from a long tail of one-off
ids never seen again (fresh 64-bit hashes), so 1,000 steps stream about 33 million distinct ids
(``--quick``: 40 steps of 1,024 samples, a head of 100,000, a tier capacity of 20,000 rows:
a smoke test, too small for conclusions).

Three cases, each in a fresh process of its own (one after the other, forked from a server
that imported the libraries once), fed the same stream:

* ``bounded``: the host tier bounded to 1,000,000 rows per table (LRU scores), ids admitted at
  their second sighting (`CacheConfig.admit_after=2`), sightings counted in a count-min sketch
  of 4 x 2**23 counters (128 MiB), every counter halved each 2**23 sightings (the default
  `CacheConfig.admission_window`: TinyLFU's aging);
* ``never-aged``: the same with a window longer than the run (the sketch is never halved, as
  before aging existed): on an endless stream its collisions admit more and more one-off ids;
* ``baseline``: no tier capacity and no admission, as before either existed: every distinct id
  becomes a row of the tier.

Measured per step in each: the process's resident memory (``VmRSS``), the rows each table holds
in the tier, the bytes the tier has allocated, tier evictions, admissions refused (unique ids of
a batch not admitted yet: every distinct id's first sighting should be one, so a shortfall is
the sketch's false admissions; with aging, an id that does not come back within a window is
refused again, so they may exceed the distinct ids) and the cache hit rate (hits over admitted
lookups). "Flat after warm-up": the growth of resident memory from the step where a bounded
tier first filled up to the end, against the baseline's growth over the same steps.

Prints a table and writes ``memory.csv`` and ``memory.png``.

    python benchmarks/bench_memory.py [--quick] [--steps N] [--threads N]
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import cpu_bench_parser, pyplot, quick_note, set_threads, start_cpu_bench, write_csv

import embcache
from embcache.hashing import mix64

DIM = 16
BAG = 8
HEAD_SHARE = 0.55
ALPHA = 1.05
TABLES = ("user", "item")
CASES = ("bounded", "never-aged", "baseline")
NEVER = 1 << 62  # an admission window no run reaches
MIB = 2**20


@dataclass(frozen=True)
class Setup:
    steps: int
    batch: int
    head: int
    tier_capacity: int
    cache_capacity: int
    sketch_width: int
    window: int  # steps per point of the windowed rates


FULL = Setup(steps=1000, batch=4096, head=2_000_000, tier_capacity=1_000_000,
             cache_capacity=131_072, sketch_width=1 << 23, window=50)  # fmt: skip
# A smoke test of the script: too small for conclusions.
QUICK = Setup(steps=40, batch=1024, head=100_000, tier_capacity=20_000, cache_capacity=8192,
              sketch_width=1 << 18, window=10)  # fmt: skip


@dataclass
class Row:
    case: str
    step: int
    distinct_ids: int
    rss_mib: float
    tier_rows_user: int
    tier_rows_item: int
    tier_mib: float
    tier_evictions: int
    admissions_refused: int
    hits: int
    misses: int
    hit_rate: float
    seconds: float

    @property
    def tier_rows(self) -> int:
        return max(self.tier_rows_user, self.tier_rows_item)


def rss_mib() -> float:
    """This process's resident memory, MiB (Linux ``/proc``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Stream:
    """Bags of raw 64-bit ids of one table: a Zipf head of recurring ids, a tail of one-offs.

    Counts its distinct ids in fixed memory (a flag per head id; the tail ids are all distinct).
    """

    def __init__(self, head: int, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        mass = torch.arange(1, head + 1, dtype=torch.float64).pow_(-ALPHA)
        self.cdf = torch.cumsum(mass, 0) / mass.sum()
        self.salt = seed * 0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF
        self.head_seen = torch.zeros(head, dtype=torch.bool)
        self.tails = 0

    def ids(self, n: int) -> torch.Tensor:
        """int64 ``[n]`` raw ids (any 64-bit pattern)."""
        head = torch.rand(n, generator=self.gen, dtype=torch.float64) < HEAD_SHARE
        u = torch.rand(n, generator=self.gen, dtype=torch.float64)
        ranks = torch.searchsorted(self.cdf, u).clamp_(max=self.head_seen.numel() - 1)
        self.head_seen[ranks[head]] = True
        is_tail = ~head
        tail = self.tails + torch.cumsum(is_tail, 0) - 1 + (1 << 40)  # above every head rank
        self.tails += int(is_tail.sum())
        return mix64(torch.where(head, ranks, tail) ^ self.salt)

    def distinct(self) -> int:
        return self.tails + int(self.head_seen.sum())


def run_case(case: str, setup: Setup, steps: int, threads: int) -> list[Row]:
    """Train ``steps`` steps of the stream under ``case``'s tier; one `Row` per step."""
    set_threads(threads)
    bounded = case != "baseline"
    config = embcache.CacheConfig(
        capacity=setup.cache_capacity,
        tier_capacity=setup.tier_capacity if bounded else None,
        admit_after=2 if bounded else None,
        sketch_width=setup.sketch_width,
        admission_window=NEVER if case == "never-aged" else None,
    )
    tables = [embcache.TableConfig(name=t, embedding_dim=DIM, num_embeddings=None,
                                   feature_names=[t]) for t in TABLES]  # fmt: skip
    ebc = embcache.CachedEmbeddingBagCollection(tables, cache=config, seed=0)
    opt = embcache.SparseRowWiseAdaGrad([ebc], lr=0.05)
    streams = [Stream(setup.head, seed=s) for s in range(len(TABLES))]
    lengths = torch.full((len(TABLES) * setup.batch,), BAG)
    coeff = torch.randn(len(TABLES) * DIM, generator=torch.Generator().manual_seed(1))
    rows: list[Row] = []
    t_start = time.perf_counter()
    for step in range(1, steps + 1):
        ids = torch.cat([s.ids(setup.batch * BAG) for s in streams])
        out = ebc(embcache.JaggedBatch.from_lengths(list(TABLES), ids, lengths)).values()
        (out @ coeff).sum().backward()
        opt.step()
        stats, io = ebc.cache_stats(), ebc.store.io_stats()
        counts = [ebc.store.row_count(t) for t in TABLES]
        rows.append(Row(
            case=case,
            step=step,
            distinct_ids=sum(s.distinct() for s in streams),
            rss_mib=rss_mib(),
            tier_rows_user=counts[0],
            tier_rows_item=counts[1],
            tier_mib=ebc.store.memory_bytes() / MIB,
            tier_evictions=io["tier_evictions"],
            admissions_refused=int(stats.get("admissions_refused", 0)),
            hits=int(stats["hits"]),
            misses=int(stats["misses"]),
            hit_rate=stats["hit_rate"],
            seconds=time.perf_counter() - t_start,
        ))  # fmt: skip
        if step % setup.window == 0 or step == steps:
            r = rows[-1]
            print(f"{case:12s} step {step:4d}: {r.distinct_ids / 1e6:6.2f}M distinct ids, RSS "
                  f"{r.rss_mib:7.1f} MiB, tier rows {r.tier_rows_user:,}/{r.tier_rows_item:,}, "
                  f"{r.seconds:6.1f} s", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = cpu_bench_parser(__doc__, "memory.csv")
    parser.add_argument("--steps", type=int, default=None)
    args = start_cpu_bench(parser)
    setup = QUICK if args.quick else FULL
    steps = args.steps or setup.steps
    note = quick_note(args.quick)
    runs: dict[str, list[Row]] = {}
    # One case at a time, each in a fresh process (its RSS is its own), forked from a server
    # that imported torch and embcache once (not three times, as "spawn" would).
    fresh = multiprocessing.get_context("forkserver")
    for case in CASES:
        with ProcessPoolExecutor(max_workers=1, mp_context=fresh) as pool:
            runs[case] = pool.submit(run_case, case, setup, steps, args.threads).result()
    report(runs, setup, args.out, note)


def report(runs: dict[str, list[Row]], setup: Setup, out: Path, note: str = "") -> None:
    bounded, baseline = runs["bounded"], runs["baseline"]
    # Warm-up ends where a bounded tier first fills (the aged sketch may keep it from filling).
    full = min((next((r for r in rows if min(r.tier_rows_user, r.tier_rows_item) >= 0.95
                      * setup.tier_capacity), rows[-1])
                for case, rows in runs.items() if case != "baseline"),
               key=lambda r: r.step)  # fmt: skip
    base_grew = baseline[-1].rss_mib - baseline[full.step - 1].rss_mib
    last = bounded[-1]
    print(f"\ndistinct ids streamed: {last.distinct_ids:,} over {last.step} steps "
          f"({last.step * setup.batch * BAG * len(TABLES):,} lookups); tier capacity "
          f"{setup.tier_capacity:,} rows/table; bounded tier full (warm-up end) at step "
          f"{full.step}")  # fmt: skip
    print(f"{'case':>12} {'most rows':>11} {'RSS then':>9} {'RSS end':>8} {'growth':>9} "
          f"{'vs base':>8} {'tier MiB':>9} {'evictions':>11} {'refused':>11} {'refused':>8} "
          f"{'hit rate':>9} {'last ' + str(setup.window):>8} {'seconds':>8}")  # fmt: skip
    for case, rows in runs.items():
        then, end = rows[full.step - 1], rows[-1]
        grew = end.rss_mib - then.rss_mib
        window = windowed(rows, setup.window)[-1]
        print(f"{case:>12} {max(r.tier_rows for r in rows):11,} {then.rss_mib:9.0f} "
              f"{end.rss_mib:8.0f} {grew:+9.1f} {grew / base_grew:8.3f} {end.tier_mib:9.0f} "
              f"{end.tier_evictions:11,} {end.admissions_refused:11,} "
              f"{end.admissions_refused / end.distinct_ids:8.1%} {end.hit_rate:9.3f} "
              f"{window[1]:8.3f} {end.seconds:8.0f}")  # fmt: skip
    print(f"(RSS in MiB at the warm-up end and at the last step; refused: unique ids of a batch "
          f"not admitted, per distinct id (above 100%: ids refused again after a halving); hit "
          f"rate over the run and over the last {setup.window} steps)")  # fmt: skip
    write_csv([r for rows in runs.values() for r in rows], out)
    plot(runs, full.step, setup, out.with_suffix(".png"), note)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def windowed(rows: list[Row], width: int) -> list[tuple[int, float, float]]:
    """``(last step, hit rate, refusals per distinct id)`` of each ``width`` steps."""
    out = []
    for lo in range(0, len(rows) - width + 1, width):
        a = rows[lo - 1] if lo else None
        b = rows[lo + width - 1]
        hits = b.hits - (a.hits if a else 0)
        looked_up = hits + b.misses - (a.misses if a else 0)
        refused = b.admissions_refused - (a.admissions_refused if a else 0)
        first = b.distinct_ids - (a.distinct_ids if a else 0)
        out.append((b.step, hits / max(looked_up, 1), refused / max(first, 1)))
    return out


def plot(
    runs: dict[str, list[Row]], full_step: int, setup: Setup, path: Path, note: str = ""
) -> None:
    plt = pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    labels = {
        "bounded": f"tier {setup.tier_capacity:,} rows/table, admit after 2, sketch "
        f"4x2^{setup.sketch_width.bit_length() - 1} halved each 2^"
        f"{setup.sketch_width.bit_length() - 1} sightings",
        "never-aged": "the same, sketch never halved",
        "baseline": "baseline: unbounded tier, no admission",
    }
    colors = {"bounded": "C0", "never-aged": "C2", "baseline": "C1"}
    for case, rows in runs.items():
        steps, color = [r.step for r in rows], colors[case]
        ax1.plot(steps, [r.rss_mib for r in rows], color=color, label=labels[case])
        ax2.plot(steps, [r.tier_rows / 1e6 for r in rows], color=color,
                 label=f"tier rows/table, {case}")  # fmt: skip
        window = windowed(rows, setup.window)
        ax3.plot([w[0] for w in window], [w[1] for w in window], color=color, marker=".",
                 label=f"cache hit rate, {case}")  # fmt: skip
        if case != "baseline":
            ax3.plot([w[0] for w in window], [w[2] for w in window], color=color,
                     linestyle="--", label=f"refused per distinct id, {case}")  # fmt: skip
    for ax in (ax1, ax2, ax3):
        ax.axvline(full_step, color="gray", linestyle=":")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("process RSS, MiB")
    ax1.legend(loc="upper left", fontsize=8, title="dotted: a bounded tier full (warm-up end)",
               title_fontsize=8)  # fmt: skip
    rows = runs["bounded"]
    ax2.plot([r.step for r in rows], [r.distinct_ids / 1e6 for r in rows], "k",
             label="distinct ids streamed (both tables)")  # fmt: skip
    ax2.axhline(setup.tier_capacity / 1e6, color="red", linestyle="--", label="tier capacity")
    ax2.set_ylabel("millions")
    ax2.legend(loc="upper left", fontsize=8)
    ax3.set_ylabel(f"fraction, per {setup.window} steps")
    ax3.set_ylim(0, 1.4)  # room for the legend above the curves
    ax3.set_xlabel("step")
    ax3.legend(loc="upper center", fontsize=7, ncol=2)
    fig.suptitle("Bounded tier against an unbounded one (baseline): memory flat while distinct "
                 "ids grow" + (f"\n{note}" if note else ""))  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
