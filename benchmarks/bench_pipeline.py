"""How much of a slow tier's time does the prefetch pipeline hide?

Question: steps per second of one training run with ``TrainPipeline(prefetch=True)`` against
the named baseline ``TrainPipeline(prefetch=False)`` (same model, same batches, same numbers),
when every call to the backing tier costs a fixed latency, as a remote tier would.

The model is a small DLRM-like one: a `CachedEmbeddingBagCollection` of ``--tables`` tables
(one feature each, Zipf(1.05) ids, bags of ~``--pooling`` ids) with its cache at ``--cache``
(10%) of the rows, so every step misses; the pooled embeddings and 13 dense features feed a
linear head; `SparseAdaGrad` updates the rows, ``torch.optim.SGD`` the head. The tier is a
`HostKV` behind `SlowStore`, a delegating wrapper that sleeps ``latency`` in each ``get`` and
``put`` call and sums the time spent inside the tier.

Reported per latency (0, 1 ms, 5 ms): steps/s each way over the steps after ``--warmup``, the
speedup, the tier time of each run, and the fraction of the tier's time hidden by the overlap,
``(t_sync - t_prefetch) / tier_time_sync`` clamped to [0, 1], beside its bound (a tier slower
than the rest of the step can hide only behind that rest). Before any timed run the process
runs each mode once, untimed, over every batch at no tier latency, so that its one-time costs
(Triton compiles, cuBLAS and the allocator's set-up) fall on neither mode's measurement. Then,
per latency, the two modes run ``--repeats`` times, alternated (the mode that goes first swaps
every repeat), and each mode's median-time run is reported, so a shared machine's load falls on
both alike. The final weights and optimizer state of both runs must be bit-identical
(invariant I5 of docs/design.md): the script asserts it and prints ``identical: True``. Prints
a table; writes ``pipeline.csv`` and ``pipeline.png``. ``--quick``: 25 steps, one run of each
mode; without a GPU also 4 tables x 20,000 rows, batch 256, 12 steps: a smoke test of the CPU
path, too small for conclusions.

    python benchmarks/bench_pipeline.py [--quick] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import (
    SlowStore,
    ZipfIds,
    add_output_options,
    parse_args,
    pick_device,
    pyplot,
    quick_note,
    run_header,
    set_threads,
    write_csv,
)
from torch import nn

import embcache
from embcache.kv.base import Store
from embcache.train.pipeline import PrefetchFallbackWarning, TrainPipeline

NUM_DENSE = 13
ALPHA = 1.05


# ----------------------------------------------------------------------------------------------
# model and data
# ----------------------------------------------------------------------------------------------


@dataclass
class Config:
    tables: int
    rows: int
    dim: int
    batch: int
    pooling: int
    cache: float
    steps: int
    warmup: int


@dataclass
class Batch:
    sparse: embcache.JaggedBatch
    dense: torch.Tensor  # float32 [B, NUM_DENSE]
    labels: torch.Tensor  # float32 [B]


# Each CLI option left out takes its value from one of these.
FULL = Config(tables=8, rows=100_000, dim=32, batch=1024, pooling=3, cache=0.1, steps=100,
              warmup=10)  # fmt: skip
QUICK = dataclasses.replace(FULL, steps=25, warmup=5)  # on a GPU (the GPU check's size)
# --quick without a GPU: a smoke test of the script, too small for conclusions.
QUICK_CPU = dataclasses.replace(FULL, tables=4, rows=20_000, batch=256, steps=12, warmup=3)


def feature_names(cfg: Config) -> list[str]:
    return [f"cat_{i}" for i in range(cfg.tables)]


def make_batches(cfg: Config, device: torch.device) -> list[Batch]:
    """``cfg.steps`` seeded batches: Zipf ids per table, bag lengths uniform in [1, 2p - 1]."""
    gen = torch.Generator().manual_seed(0)
    laws = [ZipfIds(cfg.rows, ALPHA, gen) for _ in range(cfg.tables)]
    batches = []
    for _ in range(cfg.steps):
        lengths = torch.randint(1, 2 * cfg.pooling, (cfg.tables, cfg.batch), generator=gen)
        values = torch.cat(
            [law.sample(int(n), gen) for law, n in zip(laws, lengths.sum(dim=1), strict=True)]
        )
        kjt = embcache.JaggedBatch.from_lengths(
            keys=feature_names(cfg), values=values, lengths=lengths.reshape(-1)
        )
        dense = torch.rand(cfg.batch, NUM_DENSE, generator=gen).to(device)
        labels = (torch.rand(cfg.batch, generator=gen) < 0.25).float().to(device)
        batches.append(Batch(kjt, dense, labels))
    return batches


class TinyDLRM(nn.Module):
    """Cached embeddings and dense features into one linear layer; BCE loss."""

    def __init__(self, cfg: Config, store: Store, device: torch.device) -> None:
        super().__init__()
        tables = [
            embcache.TableConfig(
                name=f"t{i}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f]
            )
            for i, f in enumerate(feature_names(cfg))
        ]
        self.sparse = embcache.CachedEmbeddingBagCollection(
            tables=tables,
            cache=embcache.CacheConfig(load_factor=cfg.cache),
            store=store,
            device=device,
            seed=0,
        )
        torch.manual_seed(0)
        self.head = nn.Linear(cfg.tables * cfg.dim + NUM_DENSE, 1).to(device)

    def forward(self, batch: Batch) -> torch.Tensor:
        x = torch.cat([self.sparse(batch.sparse).values(), batch.dense], dim=1)
        logits = self.head(x).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)


# ----------------------------------------------------------------------------------------------
# runs
# ----------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    seconds: float  # wall time of the steps after warm-up
    tier_seconds: float  # time spent inside the tier over those steps
    tier_calls: int
    waited_seconds: float  # training thread waiting between steps (for the prefetch)
    hit_rate: float
    fallbacks: int
    state: dict[str, torch.Tensor]  # final touched rows (weights | optimizer state), head


def train(
    cfg: Config, batches: list[Batch], latency_s: float, prefetch: bool, device: torch.device
) -> RunResult:
    store = SlowStore(embcache.HostKV(), latency_s)
    model = TinyDLRM(cfg, store, device)
    sparse_opt = embcache.SparseAdaGrad([model.sparse], lr=0.05)
    dense_opt = torch.optim.SGD(model.head.parameters(), lr=0.05)
    last_end = [0.0]
    waited = [0.0]  # training thread's time between a step's end and the next forward

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        if last_end[0]:
            waited[0] += time.perf_counter() - last_end[0]
        return m(b)

    pipe = TrainPipeline(
        model, sparse_opt, dense_opt, features=lambda b: b.sparse, loss=loss, prefetch=prefetch
    )
    marks: dict[int, tuple[float, int, float, int, float]] = {}

    def on_step(step: int, _: torch.Tensor) -> None:
        last_end[0] = time.perf_counter() if cfg.warmup <= step < cfg.steps else 0.0
        if step in (cfg.warmup, cfg.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            marks[step] = (time.perf_counter(), *store.snapshot())
            if step == cfg.warmup:
                model.sparse.reset_stats()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrefetchFallbackWarning)  # counted in pipe.fallbacks
        pipe.run(batches, on_step=on_step)
    (t0, c0, s0), (t1, c1, s1) = marks[cfg.warmup], marks[cfg.steps]
    hit_rate = model.sparse.cache_stats()["hit_rate"]
    store.latency_s = 0.0  # reading the final state back is not part of the question
    model.sparse.flush()
    state: dict[str, torch.Tensor] = {}
    for t in model.sparse.tables:  # every row ever touched; the others are still their init
        chunks = list(store.export_rows(t.name))
        state[f"ids.{t.name}"] = torch.cat([ids for ids, _ in chunks])
        state[f"rows.{t.name}"] = torch.cat([rows for _, rows in chunks])
    for k, v in model.head.state_dict().items():
        state[f"head.{k}"] = v.detach().cpu().clone()
    return RunResult(
        t1 - t0,
        s1 - s0,
        c1 - c0,
        waited[0],
        hit_rate,
        pipe.fallbacks,
        state,
    )


@dataclass
class Row:
    device: str
    latency_ms: float
    steps_timed: int
    repeats: int  # runs of each mode, alternated; the median-time run of each is reported
    sync_steps_per_s: float
    prefetch_steps_per_s: float
    tier_s_sync: float
    tier_s_prefetch: float
    tier_calls_per_step: float
    wait_ms_per_step_prefetch: float  # training thread idle, waiting for the next prefetch
    hit_rate: float
    fallbacks: int
    identical: bool

    @property
    def speedup(self) -> float:
        return self.prefetch_steps_per_s / self.sync_steps_per_s

    @property
    def hidden_fraction(self) -> float:
        """``(t_sync - t_prefetch) / tier_time_sync``, clamped to [0, 1]."""
        if self.tier_s_sync <= 0.0:
            return 0.0
        t_sync = self.steps_timed / self.sync_steps_per_s
        t_prefetch = self.steps_timed / self.prefetch_steps_per_s
        return min(1.0, max(0.0, (t_sync - t_prefetch) / self.tier_s_sync))

    @property
    def hideable_fraction(self) -> float:
        """Upper bound of ``hidden_fraction`` for a two-stage overlap: the synchronous run's
        time outside the tier over its tier time, at most 1 (a tier slower than the rest of the
        step can only hide behind that rest)."""
        if self.tier_s_sync <= 0.0:
            return 0.0
        t_sync = self.steps_timed / self.sync_steps_per_s
        return min(1.0, max(0.0, (t_sync - self.tier_s_sync) / self.tier_s_sync))

    @property
    def tier_share_sync(self) -> float:
        """Fraction of the synchronous run's wall time spent inside the tier."""
        return self.tier_s_sync * self.sync_steps_per_s / self.steps_timed


EXTRA = ["speedup", "hidden_fraction", "hideable_fraction", "tier_share_sync"]


def _same(a: RunResult, b: RunResult) -> bool:
    return a.state.keys() == b.state.keys() and all(
        torch.equal(a.state[k], b.state[k]) for k in a.state
    )


def warm_up(cfg: Config, batches: list[Batch], device: torch.device) -> float:
    """Run each mode once over every batch at no tier latency, untimed: the process's one-time
    costs (Triton compiles of every variant these batches need, cuBLAS and the allocator's
    set-up) land here, not in the first timed run. Returns its seconds."""
    t0 = time.perf_counter()
    for prefetch in (False, True):
        train(cfg, batches, 0.0, prefetch, device)
    return time.perf_counter() - t0


def bench_latency(
    cfg: Config, batches: list[Batch], latency_ms: float, repeats: int, device: torch.device
) -> Row:
    """Alternate synchronous and prefetch runs ``repeats`` times, the first mode swapping each
    repeat (sync first on even repeats); report each mode's run of median wall time (a
    neighbour's load and any drift over the runs then fall on both modes alike). Call after
    `warm_up`."""
    runs: dict[bool, list[RunResult]] = {False: [], True: []}
    for repeat in range(repeats):
        for prefetch in (False, True) if repeat % 2 == 0 else (True, False):
            runs[prefetch].append(train(cfg, batches, latency_ms * 1e-3, prefetch, device))
    first = runs[False][0]
    identical = all(_same(first, r) for r in runs[False][1:] + runs[True])
    sync, pre = (
        sorted(runs[p], key=lambda r: r.seconds)[(repeats - 1) // 2] for p in (False, True)
    )
    timed = cfg.steps - cfg.warmup
    return Row(
        device.type,
        latency_ms,
        timed,
        repeats,
        timed / sync.seconds,
        timed / pre.seconds,
        sync.tier_seconds,
        pre.tier_seconds,
        sync.tier_calls / timed,
        1e3 * pre.waited_seconds / timed,
        sync.hit_rate,
        pre.fallbacks,
        identical,
    )


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------

HEAD = (
    f"{'latency':>8}{'sync st/s':>11}{'prefetch st/s':>15}{'speedup':>9}{'tier s sync':>13}"
    f"{'(share)':>9}{'tier s pref':>13}{'calls/st':>10}{'wait ms':>9}"
    f"{'hidden':>8}"
    f"{'(bound)':>9}{'hit rate':>10}{'fallbk':>8}{'identical':>11}"
)


def print_row(r: Row) -> None:
    print(
        f"{r.latency_ms:>6.1f}ms{r.sync_steps_per_s:>11.2f}{r.prefetch_steps_per_s:>15.2f}"
        f"{r.speedup:>9.2f}{r.tier_s_sync:>13.2f}{r.tier_share_sync:>9.2f}"
        f"{r.tier_s_prefetch:>13.2f}{r.tier_calls_per_step:>10.1f}"
        f"{r.wait_ms_per_step_prefetch:>9.1f}{r.hidden_fraction:>8.2f}{r.hideable_fraction:>9.2f}{r.hit_rate:>10.3f}"
        f"{r.fallbacks:>8d}{r.identical!s:>11}",
        flush=True,
    )


def write_plot(rows: list[Row], path: Path, title: str) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = list(range(len(rows)))
    labels = [f"{r.latency_ms:g} ms" for r in rows]
    ax1.bar([i - 0.2 for i in x], [r.sync_steps_per_s for r in rows], 0.4,
            label="prefetch=False (baseline)")  # fmt: skip
    ax1.bar([i + 0.2 for i in x], [r.prefetch_steps_per_s for r in rows], 0.4,
            label="prefetch=True")  # fmt: skip
    for i, r in enumerate(rows):
        ax1.annotate(f"x{r.speedup:.2f}", (i + 0.2, r.prefetch_steps_per_s), ha="center",
                     va="bottom", fontsize=8)  # fmt: skip
    ax1.set_xticks(x, labels)
    ax1.set_xlabel("tier latency per get/put call")
    ax1.set_ylabel("steps / s")
    top = max(max(r.sync_steps_per_s, r.prefetch_steps_per_s) for r in rows)
    ax1.set_ylim(0, 1.3 * top)
    ax1.legend(fontsize=8, loc="upper center", ncol=2)
    ax2.bar([i - 0.2 for i in x], [r.hidden_fraction for r in rows], 0.4, label="hidden")
    ax2.bar([i + 0.2 for i in x], [r.hideable_fraction for r in rows], 0.4, color="lightgrey",
            label="bound: min(1, non-tier time / tier time)")  # fmt: skip
    ax2.axhline(0.8, color="grey", lw=0.8, ls="--", label="GPU target 0.8")
    ax2.set_xticks(x, labels)
    ax2.set_ylim(0, 1.3)
    ax2.set_xlabel("tier latency per get/put call")
    ax2.set_ylabel("fraction of tier time hidden")
    ax2.legend(fontsize=8, loc="upper center", ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer steps (25, one run of each mode); on the CPU also 4 tables x 20k rows, "
        "batch 256, 12 steps: a smoke test",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1)")
    parser.add_argument("--latencies-ms", type=float, nargs="+", default=[0.0, 1.0, 5.0])
    parser.add_argument("--tables", type=int, default=None, help="default 8")
    parser.add_argument("--rows", type=int, default=None, help="rows per table (default 100k)")
    parser.add_argument("--dim", type=int, default=None, help="default 32")
    parser.add_argument("--batch", type=int, default=None, help="default 1024")
    parser.add_argument("--pooling", type=int, default=None, help="mean bag length (default 3)")
    parser.add_argument("--cache", type=float, default=None, help="cache load factor (0.1)")
    parser.add_argument(
        "--steps", type=int, default=None, help="default 100 (quick: 25; 12 on the CPU)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="default 10 (quick: 5; 3 on the CPU)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of each mode, alternated (default 3; quick 1)",
    )
    add_output_options(parser, "pipeline.csv")
    args = parse_args(parser, argv)

    set_threads(args.threads)
    device = pick_device(args.device)
    sizes = (QUICK if device.type == "cuda" else QUICK_CPU) if args.quick else FULL
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)}
    cfg = dataclasses.replace(sizes, **{k: v for k, v in given.items() if v is not None})
    repeats = args.repeats or (1 if args.quick else 3)
    if not 0 < cfg.warmup < cfg.steps:
        raise SystemExit(f"--warmup must be in [1, steps), got {cfg.warmup} for {cfg.steps}")
    t0 = time.perf_counter()
    header = run_header(device)
    print(header)
    note = quick_note(args.quick and device.type != "cuda")
    batches = make_batches(cfg, device)
    print(
        f"# model: {cfg.tables} tables x {cfg.rows} rows, dim {cfg.dim}, cache {cfg.cache:.0%}; "
        f"B={cfg.batch}, pooling~{cfg.pooling}; {cfg.steps} steps, first {cfg.warmup} untimed; "
        f"{repeats} alternated run(s) of each mode (the first swapping each repeat), median "
        "reported; baseline: prefetch=False"
    )
    warm_s = warm_up(cfg, batches, device)
    print(
        f"# warm-up: one untimed run of each mode (prefetch=False, then True; {cfg.steps} steps, "
        f"tier latency 0) in {warm_s:.1f} s before any timed run, so Triton compiles, cuBLAS and "
        "allocator set-up fall outside every latency's measurement"
    )
    print(
        "# tier s: wall time with a tier call in flight (concurrent calls count once); share: "
        "of the synchronous run's time spent in the tier; wait ms: per step, the "
        "prefetch run's training thread idle, waiting for the next batch's prefetch; hidden: "
        "(t_sync - t_prefetch) / tier s sync; bound: the most an overlap could hide, "
        "min(1, (t_sync - tier s sync) / tier s sync)"
    )
    print(HEAD)
    print("-" * len(HEAD))
    rows = []
    for latency in args.latencies_ms:
        row = bench_latency(cfg, batches, latency, repeats, device)
        print_row(row)
        rows.append(row)
    identical = all(r.identical for r in rows)
    print(f"identical: {identical}")
    for r in rows:
        print(
            f"summary: pipeline latency={r.latency_ms:g}ms speedup={r.speedup:.2f} "
            f"hidden={r.hidden_fraction:.2f} identical={r.identical}"
        )
    write_csv(rows, args.out, EXTRA)
    write_plot(rows, args.out.with_suffix(".png"), header[2:] + (f"\n{note}" if note else ""))
    elapsed = time.perf_counter() - t0
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {elapsed:.0f} s")
    assert identical, "prefetch changed the numbers: final rows differ from the synchronous run"


if __name__ == "__main__":
    main()
