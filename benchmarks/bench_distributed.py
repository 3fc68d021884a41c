"""Does row-wise sharding over torch.distributed pay here? Training samples/s, and bytes sent.

One training step is forward + backward + a sparse AdaGrad step over the same global batches in
three runs, each in processes started by `embcache.distributed.launch.spawn` (gloo on CPU, one
torch thread per rank by default: on a shared machine more threads per process make OpenMP
contend with the neighbours and the numbers swing by 10x; ``--threads`` changes it):

* ``single``     one process, `CachedEmbeddingBagCollection` on the whole global batch: the
                 named baseline every ratio is against;
* ``sharded/1``  `ShardedEmbeddingBagCollection` on one rank (the exchange machinery, no peer;
                 not with ``--quick``);
* ``sharded/2``  two ranks, each on half of every global batch, each owning about half the rows;
* ``prefetch/2`` the same two ranks with prefetch: each step's id exchange and owner resolve
                 (tier I/O) run on the prefetch worker during the step before. ``vs sharded/2``
                 is its ratio to ``sharded/2``, and ``identical`` says that both trained to the
                 same bits.

Every run trains through `TrainPipeline` (``prefetch=False`` but for ``prefetch/2``). The tier
is a `HostKV`, behind `SlowStore` with ``--latency-ms`` per call (default 0: host memory).

samples/s is the global batch times the timed steps over the slowest rank's time (the ranks meet
at a barrier before and after); the runs take turns ``--repeats`` times and each keeps its best,
so a neighbour's load on a shared machine falls on all of them alike. Bytes are what each rank's
all_to_alls send per step (header, ids, rows, gradients:
`ShardedEmbeddingBagCollection.comm_stats`), in total and the part that leaves the rank. Ids
are Zipf(1.0) per table, scattered over the rows. Prints a table; writes
distributed.csv and distributed.png.

    .venv/bin/python benchmarks/bench_distributed.py                    # full
    .venv/bin/python benchmarks/bench_distributed.py --quick            # a smoke test
    .venv/bin/python benchmarks/bench_distributed.py --latency-ms 2     # a remote-like tier
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import (
    SlowStore,
    ZipfIds,
    add_output_options,
    parse_args,
    pyplot,
    quick_note,
    write_csv,
)

import embcache
from embcache.distributed.launch import spawn
from embcache.distributed.sharded import ShardedEmbeddingBagCollection
from embcache.train.pipeline import TrainPipeline

PARTS = 2  # a global batch is this many equal parts; rank r of W takes PARTS / W of them
BASELINE = "single"


@dataclass(frozen=True)
class Workload:
    tables: int
    rows: int
    dim: int
    bag: int  # ids per bag
    batch: int  # global batch (samples)
    steps: int  # timed
    warmup: int
    load_factor: float
    threads: int  # torch threads per rank
    repeats: int
    latency_ms: float = 0.0  # per tier call


@dataclass
class Row:
    run: str
    ranks: int
    global_batch: int
    steps: int
    samples_per_s: float
    vs_single: float
    bytes_sent_per_step: float  # per rank, mean over ranks
    bytes_to_peers_per_step: float
    all_to_alls_per_step: float
    hit_rate: float
    vs_sharded_2: float  # samples/s over sharded/2's
    identical: bool  # trained to the same tables as sharded/2


def table_configs(w: Workload) -> list[embcache.TableConfig]:
    return [
        embcache.TableConfig(
            name=f"t{i}", embedding_dim=w.dim, num_embeddings=w.rows, feature_names=[f"f{i}"]
        )
        for i in range(w.tables)
    ]


def part_kjt(w: Workload, step: int, parts: range) -> embcache.JaggedBatch:
    """The KJT of ``parts`` of a step's global batch (deterministic in (step, part))."""
    per_part = w.batch // PARTS
    values, lengths = [], []
    for t in range(w.tables):
        zipf = ZipfIds(w.rows, 1.0, torch.Generator().manual_seed(t))
        for p in parts:
            gen = torch.Generator().manual_seed(((step * PARTS + p) * 1000) + t)
            values.append(zipf.sample(per_part * w.bag, gen))
            lengths.append(torch.full((per_part,), w.bag))
    keys = [f"f{t}" for t in range(w.tables)]
    return embcache.JaggedBatch.from_lengths(keys, torch.cat(values), torch.cat(lengths))


def _rank_main(rank: int, run: str, w: Workload) -> dict:
    """One rank of one run: build, warm up, time ``w.steps`` steps."""
    world = torch.distributed.get_world_size()
    share = PARTS // world
    tables = table_configs(w)
    cache = embcache.CacheConfig(load_factor=w.load_factor)
    store = SlowStore(embcache.HostKV(), w.latency_ms * 1e-3)
    if run == BASELINE:
        ebc = embcache.CachedEmbeddingBagCollection(tables, cache=cache, store=store, seed=0)
    else:
        ebc = ShardedEmbeddingBagCollection(tables, cache=cache, store=store, seed=0)
    opt = embcache.SparseAdaGrad([ebc], lr=0.05)
    batches = [
        part_kjt(w, step, range(rank * share, (rank + 1) * share))
        for step in range(w.warmup + w.steps)
    ]
    pipe = TrainPipeline(
        ebc,
        opt,
        None,
        features=lambda kjt: kjt,
        loss=lambda m, kjt: m(kjt).values().square().sum(),
        prefetch=run == "prefetch",
    )
    pipe.run(batches[: w.warmup])
    if run != BASELINE:
        ebc.reset_comm_stats()
    ebc.reset_stats()
    torch.distributed.barrier()
    start = time.perf_counter()
    pipe.run(batches[w.warmup :])
    torch.distributed.barrier()
    elapsed = time.perf_counter() - start
    comm = ebc.comm_stats() if run != BASELINE else {}
    hit_rate = ebc.cache_stats()["hit_rate"]
    checksum = [float(v.double().sum()) for v in ebc.state_dict().values()]
    return {"seconds": elapsed, "comm": comm, "hit_rate": hit_rate, "checksum": checksum}


FULL = Workload(tables=8, rows=100_000, dim=64, bag=4, batch=4096, steps=20, warmup=3,
                load_factor=0.25, threads=1, repeats=3)  # fmt: skip
# A smoke test of the script: too small for conclusions.
QUICK = Workload(tables=4, rows=20_000, dim=32, bag=4, batch=512, steps=4, warmup=2,
                 load_factor=0.25, threads=1, repeats=1)  # fmt: skip

RUNS = ((BASELINE, 1), ("sharded", 1), ("sharded", 2), ("prefetch", 2))
QUICK_RUNS = (RUNS[0], *RUNS[2:])  # --quick leaves out sharded/1: one process fewer


def run(w: Workload, runs: tuple[tuple[str, int], ...] = RUNS) -> list[Row]:
    best: dict[tuple[str, int], list[dict]] = {}
    for _ in range(w.repeats):
        for name, ranks in runs:
            results = spawn(
                _rank_main, ranks, args=(name, w), timeout=600, threads_per_rank=w.threads
            )
            seconds = max(r["seconds"] for r in results)
            kept = best.get((name, ranks))
            if kept is None or seconds < max(r["seconds"] for r in kept):
                best[(name, ranks)] = results
    rows: list[Row] = []
    base = None
    sharded_2 = best[("sharded", 2)]
    sharded_speed = w.batch * w.steps / max(r["seconds"] for r in sharded_2)
    for name, ranks in runs:
        results = best[(name, ranks)]
        speed = w.batch * w.steps / max(r["seconds"] for r in results)
        base = base or speed

        def per_step(key: str, results=results) -> float:
            return sum(r["comm"].get(key, 0) for r in results) / len(results) / w.steps

        rows.append(
            Row(
                run=name if name == BASELINE else f"{name}/{ranks}",
                ranks=ranks,
                global_batch=w.batch,
                steps=w.steps,
                samples_per_s=speed,
                vs_single=speed / base,
                bytes_sent_per_step=per_step("bytes_sent"),
                bytes_to_peers_per_step=per_step("bytes_to_peers"),
                all_to_alls_per_step=per_step("collectives"),
                hit_rate=sum(r["hit_rate"] for r in results) / len(results),
                vs_sharded_2=speed / sharded_speed,
                identical=ranks == 2 and results[0]["checksum"] == sharded_2[0]["checksum"],
            )
        )
    return rows


def report(rows: list[Row], w: Workload) -> None:
    print(
        f"# distributed: {w.tables} tables x {w.rows} rows x dim {w.dim}, bags of {w.bag} "
        f"Zipf(1.0) ids, global batch {w.batch}, {w.steps} timed steps after {w.warmup}, best "
        f"of {w.repeats}; "
        f"cache load factor {w.load_factor} (per rank: of its rows); SparseAdaGrad; gloo; "
        f"{w.threads} torch thread(s) per rank, {os.cpu_count()} cores; load average "
        f"{os.getloadavg()[0]:.1f}; tier latency {w.latency_ms} ms per call; baseline {BASELINE}"
    )
    head = (
        f"{'run':<11}{'ranks':>6}{'samples/s':>12}{'vs single':>11}{'vs sharded/2':>14}"
        f"{'MB sent/step':>14}{'MB to peers':>13}{'a2a/step':>10}{'hit rate':>10}{'identical':>11}"
    )
    print(head)
    for r in rows:
        print(
            f"{r.run:<11}{r.ranks:>6}{r.samples_per_s:>12.0f}{r.vs_single:>11.2f}"
            f"{r.vs_sharded_2:>14.2f}{r.bytes_sent_per_step / 1e6:>14.3f}"
            f"{r.bytes_to_peers_per_step / 1e6:>13.3f}{r.all_to_alls_per_step:>10.1f}"
            f"{r.hit_rate:>10.3f}{str(r.identical) if r.ranks == 2 else '':>11}"
        )
    prefetch = next(r for r in rows if r.run == "prefetch/2")
    print(
        f"summary: distributed prefetch speedup={prefetch.vs_sharded_2:.2f} "
        f"identical={prefetch.identical} latency_ms={w.latency_ms}"
    )


def write_plot(rows: list[Row], path: Path, note: str = "") -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r.run for r in rows]
    left.bar(names, [r.vs_single for r in rows], color="tab:blue")
    left.axhline(1.0, color="gray", lw=0.8, ls="--")
    left.set_ylabel(f"samples/s relative to {BASELINE}")
    left.set_title("training throughput")
    right.bar(names, [r.bytes_to_peers_per_step / 1e6 for r in rows], color="tab:orange")
    right.set_ylabel("MB per step per rank")
    right.set_title("all_to_all bytes leaving a rank")
    fig.suptitle("row-wise sharding over gloo against one process (baseline)"
                 + (f"\n{note}" if note else ""), fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one round: a smoke test")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 3, quick 1)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="tier latency per call")
    add_output_options(parser, "distributed.csv")
    args = parse_args(parser)
    note = quick_note(args.quick)
    w = dataclasses.replace(
        QUICK if args.quick else FULL,
        threads=args.threads,
        repeats=args.repeats or (QUICK if args.quick else FULL).repeats,
        latency_ms=args.latency_ms,
    )
    rows = run(w, QUICK_RUNS if args.quick else RUNS)
    report(rows, w)
    prefetch = next(r for r in rows if r.run == "prefetch/2")
    assert prefetch.identical, "prefetch changed the numbers: the tables differ from sharded/2"
    write_csv(rows, args.out)
    write_plot(rows, args.out.with_suffix(".png"), note)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
