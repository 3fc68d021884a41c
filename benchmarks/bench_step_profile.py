"""Where does one training step's time go? A per-phase profile of forward + backward + sparse
step through the cache.

Question: for each workload, the share of a step spent in each phase of the data path, read
from the ``torch.profiler`` ranges the library marks (`embcache.profiling.profiled`):

* ``engine.fuse`` (validate and fuse ids), ``engine.dedup``, ``engine.direct`` (a cache that
  maps every row directly, on the TBE step: ids checked and counted, no dedup and no
  resolve), ``cache.resolve`` (split into
  ``cache.plan``: set lookup and victim choice; ``cache.tier_io``: write-backs and reads;
  ``cache.copy_in``: rows into slots; ``cache.release_scratch``; and the rest of the resolve),
  ``engine.pool`` (forward pooling), ``engine.grad_rows`` (backward), ``engine.trace``,
  ``optim.check_gradients``, ``engine.locate``, ``engine.apply_rule`` (the optimizer's row
  update), ``engine.tbe_update`` (the TBE step: FBGEMM's TBE backward, which sums each
  row's gradient and applies the optimizer in one pass; ``engine.pool`` is then its forward),
  ``engine.release``, and ``other`` (the step's time outside every range: Python,
  autograd, the loss).

The named baseline is the step itself: each phase is a fraction of it. Step times are measured
without the profiler (which adds its own cost), shares with it.

Workloads (1 torch thread, Zipf ids, the same batches for every phase):

* ``long_bags``: 8 tables x 200k rows x dim 64, batch 2048, 20 ids per bag, Zipf(1.05);
* ``batch256``: the same tables at batch 256;
* ``criteo``: 26 tables of the Criteo Kaggle sizes x 0.01, dim 16, batch 2048, 1 id per bag;

(the workloads of `bench_e2e.py`, which times the same steps against torchrec and FBGEMM)

each with the whole table cached and with 10% cached (LRU), `SparseRowWiseAdaGrad` on `HostKV`;
and the 10% cache trained through ``TrainPipeline(prefetch=True)``, profiled per thread
(`embcache.profiling.phase_times`: the torch profiler records only the thread that started
it): the training thread's check and dedup of the next batch (``engine.dedup``), FBGEMM's
forward (``engine.pool``) and update (``engine.tbe_update``), its wait for the worker
(``pipeline.wait``) and ``other``; the worker's resolve (plan, tier reads, copy-in, rest), its
deferred write-back of the victims (``cache.deferred_write``) and ``idle``. Each thread's phases
add up to the step.

``--quick`` is a smoke test, too small for conclusions: 2 tables x 20,000 rows x dim 32 (batch
256), Criteo sizes x 0.001 at batch 512, 3 steps per case.

Prints a table; writes ``step_profile.csv`` and ``step_profile.png``.

    python benchmarks/bench_step_profile.py [--quick] [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import (
    ZipfIds,
    add_output_options,
    parse_args,
    pyplot,
    quick_note,
    run_header,
    set_threads,
    write_csv,
)

import embcache
from embcache.data.synthetic import SyntheticConfig, SyntheticCriteo
from embcache.profiling import phase_times

PHASES = [
    "engine.fuse",
    "engine.dedup",
    "engine.direct",
    "cache.plan",
    "cache.tier_io",
    "cache.copy_in",
    "cache.release_scratch",
    "cache.resolve (rest)",
    "engine.pool",
    "engine.grad_rows",
    "engine.trace",
    "optim.check_gradients",
    "engine.locate",
    "engine.apply_rule",
    "engine.tbe_update",
    "engine.release",
    "other",
]
_RESOLVE_PARTS = ("cache.plan", "cache.tier_io", "cache.copy_in", "cache.release_scratch")
# A prefetching step, per thread (`embcache.profiling.phase_times`): the training thread's
# timed phases (its wait for the worker included; the rest of its step is "other"), and the
# worker's (the rest of its resolve is "cache.resolve (rest)", the rest of its step "idle").
TRAINING_PHASES = ("engine.dedup", "engine.pool", "engine.tbe_update", "optim.check_gradients",
                   "pipeline.wait")  # fmt: skip
WORKER_PHASES = (*_RESOLVE_PARTS, "cache.deferred_write")
WORKER = "embcache-prefetch"  # the prefetch worker's thread name
_TOP = [p for p in PHASES if p not in (*_RESOLVE_PARTS, "cache.resolve (rest)", "other")]


@dataclass
class Row:
    workload: str
    cached: str
    ms_per_step: float
    phase: str
    ms: float
    share: float


@dataclass
class Workload:
    name: str
    tables: list[embcache.TableConfig]
    batches: list[embcache.JaggedBatch]
    batch_size: int


@dataclass(frozen=True)
class Sizes:
    """The workloads' sizes and the steps each case runs."""

    bag_tables: int  # long_bags and batch256
    bag_rows: int  # per table
    bag_dim: int
    long_batch: int  # long_bags; batch256 is 256
    criteo_scale: float  # of the Criteo Kaggle cardinalities
    criteo_batch: int
    steps: int  # measured per case
    warm: int  # at least this many warm-up batches,
    fill: int  # up to this many more until the caches are full (`profile`)


FULL = Sizes(8, 200_000, 64, 2048, 0.01, 2048, 10, 12, 30)
QUICK = Sizes(2, 20_000, 32, 256, 0.001, 512, 3, 2, 2)  # a smoke test: too small for conclusions


def long_bags(num_batches: int, sizes: Sizes, batch: int, name: str) -> Workload:
    tables, rows, dim, bag = sizes.bag_tables, sizes.bag_rows, sizes.bag_dim, 20
    gen = torch.Generator().manual_seed(0)
    zipf = [ZipfIds(rows, 1.05, gen) for _ in range(tables)]
    keys = [f"f{i}" for i in range(tables)]
    batches = []
    for _ in range(num_batches):
        values = torch.cat([z.sample(batch * bag, gen) for z in zipf])
        lengths = torch.full((tables * batch,), bag, dtype=torch.int64)
        batches.append(embcache.JaggedBatch.from_lengths(keys, values, lengths))
    configs = [
        embcache.TableConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                             feature_names=[k])
        for i, k in enumerate(keys)
    ]  # fmt: skip
    return Workload(name, configs, batches, batch)


def criteo(num_batches: int, batch: int, scale: float, name: str) -> Workload:
    data = SyntheticCriteo(SyntheticConfig(scale=scale, batch_size=batch, zipf=1.05, seed=0))
    batches = [data.batch(i).sparse_features for i in range(num_batches)]
    return Workload(name, data.tables(16), batches, batch)


def _collection(w: Workload, load_factor: float) -> tuple:
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=w.tables, cache=embcache.CacheConfig(load_factor=load_factor), seed=0
    )
    # Every row in the tier from the start, as in bench_e2e (whose baselines hold whole tables):
    # the profile then shows steady-state traffic, not rows initialised at their first touch.
    # The rows loaded differ from the initialiser's: rows equal to their initial values are
    # not stored (loading the collection's own state_dict would store none).
    gen = torch.Generator().manual_seed(2)
    ebc.load_state_dict(
        {k: (torch.rand(v.shape, generator=gen) - 0.5) * 0.1 for k, v in ebc.state_dict().items()}
    )
    opt = embcache.SparseRowWiseAdaGrad([ebc], lr=0.05)
    width = sum(t.embedding_dim * len(t.feature_names) for t in w.tables)
    coeff = torch.randn(w.batch_size, width, generator=torch.Generator().manual_seed(1))
    return ebc, opt, coeff


def _step(ebc, opt, coeff, batch) -> None:
    out = ebc(batch).values()
    ((out * coeff).sum() + 0.5 * out.square().sum()).backward()
    opt.step()


def _filled(ebc) -> bool:
    """Every slot of every cache holds a row: each miss now evicts one (steady state)."""
    return all(bool((c.slot_keys[: c.num_slots] >= 0).all()) for c in ebc.caches())


def profile(
    w: Workload, load_factor: float, warm: int, steps: int
) -> tuple[float, dict[str, float]]:
    """``(ms per step without the profiler, ms per phase per step with it)``, over ``steps``
    batches each, after at least ``warm`` warm-up batches and until the caches are full (a
    cache still filling evicts less than it will), as far as the batches go."""
    ebc, opt, coeff = _collection(w, load_factor)
    for b in w.batches[:warm]:
        _step(ebc, opt, coeff, b)
    while warm < len(w.batches) - 2 * steps and not _filled(ebc):
        _step(ebc, opt, coeff, w.batches[warm])
        warm += 1
    half = steps
    timed = w.batches[warm : warm + half]
    start = time.perf_counter()
    for b in timed:
        _step(ebc, opt, coeff, b)
    step_ms = (time.perf_counter() - start) * 1e3 / len(timed)

    profiled = w.batches[warm + half : warm + 2 * half]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for b in profiled:
            _step(ebc, opt, coeff, b)
        wall_ms = (time.perf_counter() - start) * 1e3 / len(profiled)
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith(("engine.", "cache.", "optim.")):
            totals[event.key] = event.cpu_time_total / 1e3 / len(profiled)
    phases = {p: totals.get(p, 0.0) for p in PHASES if p in _TOP or p in _RESOLVE_PARTS}
    # A prefetch-free step: resolves run inside engine.prepare, outside the engine.* ranges.
    phases["cache.resolve (rest)"] = max(
        totals.get("cache.resolve", 0.0) - sum(phases[p] for p in _RESOLVE_PARTS), 0.0
    )
    top = sum(phases[p] for p in _TOP) + totals.get("cache.resolve", 0.0)
    phases["other"] = max(wall_ms - top, 0.0)
    scale = step_ms / wall_ms  # shares from the profiled run, in unprofiled milliseconds
    return step_ms, {p: phases[p] * scale for p in PHASES}


def profile_prefetch(w: Workload, warm: int, steps: int) -> tuple[float, dict[str, dict]]:
    """A 10% cache trained through ``TrainPipeline(prefetch=True)``: ``(ms per step, {thread:
    {phase: ms per step}})`` for the training thread and the prefetch worker, the phases
    timed on each thread by `embcache.profiling.phase_times` (the torch profiler sees only
    the training thread). Each thread's phases sum to the step: the training thread's rest is
    ``other``, the worker's ``idle``."""
    ebc, opt, coeff = _collection(w, 0.1)

    def loss(model, batch):
        out = model(batch).values()
        return (out * coeff).sum() + 0.5 * out.square().sum()

    pipe = embcache.TrainPipeline(ebc, opt, None, features=lambda b: b, loss=loss, prefetch=True)
    pipe.run(w.batches[:warm])
    while warm < len(w.batches) - 2 * steps and not _filled(ebc):
        pipe.run(w.batches[warm : warm + 4])
        warm += 4
    timed = w.batches[warm : warm + steps]
    start = time.perf_counter()
    pipe.run(timed)
    step_ms = (time.perf_counter() - start) * 1e3 / len(timed)
    profiled = w.batches[warm + steps : warm + 2 * steps]
    with phase_times() as times:
        start = time.perf_counter()
        pipe.run(profiled)
        wall_ms = (time.perf_counter() - start) * 1e3 / len(profiled)
    main = threading.current_thread().name

    def ms(thread: str, phase: str) -> float:
        return times.seconds.get((thread, phase), 0.0) * 1e3 / len(profiled)

    training = {p: ms(main, p) for p in TRAINING_PHASES}
    training["other"] = max(wall_ms - sum(training.values()), 0.0)
    worker = {p: ms(WORKER, p) for p in WORKER_PHASES}
    resolve = ms(WORKER, "cache.resolve")  # the parts of the resolve are inside it
    worker["cache.resolve (rest)"] = max(resolve - sum(ms(WORKER, p) for p in _RESOLVE_PARTS), 0.0)
    worker["idle"] = max(wall_ms - resolve - worker["cache.deferred_write"], 0.0)
    scale = step_ms / wall_ms
    return step_ms, {
        "training thread": {p: v * scale for p, v in training.items()},
        "worker": {p: v * scale for p, v in worker.items()},
    }


def plot(rows: list[Row], path: Path, note: str = "") -> None:
    plt = pyplot()
    cases = sorted({(r.workload, r.cached) for r in rows}, key=lambda c: (c[0], c[1]))
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(cases) + 3.5))
    left = [0.0] * len(cases)
    colors = plt.cm.tab20.colors
    phases = list(dict.fromkeys(r.phase for r in rows))  # every case's, in order of first use
    for k, phase in enumerate(phases):
        widths = [
            next((r.ms for r in rows if (r.workload, r.cached) == c and r.phase == phase), 0.0)
            for c in cases
        ]
        ax.barh([f"{w} ({c})" for w, c in cases], widths, left=left, color=colors[k % 20],
                label=phase)  # fmt: skip
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("ms per step (1 torch thread; with prefetch, a bar per thread of one step)")
    ax.set_title("Where a training step's time goes, per phase (SparseRowWiseAdaGrad, HostKV)"
                 + (f"\n{note}" if note else ""))  # fmt: skip
    # Below the axes: inside, it would hide the shortest bars.
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.07))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps: a smoke test")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per case")
    parser.add_argument("--threads", type=int, default=1)
    add_output_options(parser, "step_profile.csv")
    args = parse_args(parser)
    set_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    steps = args.steps or sizes.steps
    # At least `warm` warm-up batches, up to `fill` more until the caches are full (`profile`).
    warm, fill = sizes.warm, sizes.fill
    n = warm + fill + 2 * steps
    workloads = [
        long_bags(n, sizes, sizes.long_batch, "long_bags"),
        long_bags(n, sizes, 256, "batch256"),
        criteo(n, sizes.criteo_batch, sizes.criteo_scale, "criteo"),
    ]
    print(run_header(torch.device("cpu")))
    note = quick_note(args.quick)
    rows: list[Row] = []
    for w in workloads:
        for cached, lf in (("whole", 1.0), ("10%", 0.1)):
            step_ms, phases = profile(w, lf, warm, steps)
            print(f"\n{w.name} ({cached} cached): {step_ms:.1f} ms/step")
            for phase in PHASES:
                share = phases[phase] / step_ms if step_ms else 0.0
                rows.append(Row(w.name, cached, step_ms, phase, phases[phase], share))
                if phases[phase] >= 0.005 * step_ms:
                    print(f"  {phase:<24} {phases[phase]:8.2f} ms  {share:6.1%}")
        step_ms, threads = profile_prefetch(w, warm, steps)
        print(f"\n{w.name} (10% cached, prefetch): {step_ms:.1f} ms/step, per thread")
        for thread, phases in threads.items():
            cached = f"10%, prefetch: {thread}"
            for phase, value in phases.items():
                share = value / step_ms if step_ms else 0.0
                rows.append(Row(w.name, cached, step_ms, phase, value, share))
                if value >= 0.005 * step_ms:
                    print(f"  {thread:<15} {phase:<24} {value:8.2f} ms  {share:6.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out)
    png = args.out.with_suffix(".png")
    plot(rows, png, note)
    worst = max((r for r in rows if r.phase not in ("other", "idle")), key=lambda r: r.share)
    print(
        f"\nsummary: largest phase {worst.phase} {worst.share:.0%} of "
        f"{worst.workload} ({worst.cached})"
    )
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
