"""How fast are the cache-index ops against a plain torch baseline, at a few cache sizes?

Question: keys looked up per second (`cache_lookup`) and misses placed per second
(`assign_ways`), for the torch twin (the CPU path) and, where CUDA is present, the Triton
kernels, each as a ratio against a named baseline measured in the same run:

* lookup baseline ``sorted_keys``: every key of the table sorted once (not timed), then each
  batch is one ``torch.searchsorted`` over that array plus a gather.
* assign baseline ``sort_all_sets``: ``torch.sort`` over the keys of every set of the table
  (not only the touched ones), then the k-th miss of a set gathers the k-th way.

Both baselines give the same answers as the ops; the script checks that before timing. Prints a
table and writes ``cache_index.csv`` and ``cache_index.png``.

    python benchmarks/bench_cache_index.py [--quick | --tiny] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _common import add_output_options, parse_args, quick_note

from embcache.ops.plan.spec import assign_ways_ref, cache_lookup_ref, set_index_ref
from embcache.ops.plan.triton import assign_ways_triton, cache_lookup_triton

WAYS = 32


@dataclass
class Row:
    op: str
    device: str
    num_sets: int
    ways: int
    batch: int
    baseline: str
    baseline_per_s: float
    twin_per_s: float
    triton_per_s: float | None

    @property
    def twin_ratio(self) -> float:
        return self.twin_per_s / self.baseline_per_s

    @property
    def triton_ratio(self) -> float | None:
        return None if self.triton_per_s is None else self.triton_per_s / self.baseline_per_s


# ----------------------------------------------------------------------------------------------
# baselines
# ----------------------------------------------------------------------------------------------


def sorted_keys_index(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole table's keys sorted, with the flat slot of each (built once, not timed)."""
    return torch.sort(keys.reshape(-1))


def lookup_sorted_keys(
    sorted_keys: torch.Tensor, slot_of: torch.Tensor, ids: torch.Tensor, ways: int
) -> torch.Tensor:
    """Way of each id by binary search over all keys; valid because an id lives in one set."""
    pos = torch.searchsorted(sorted_keys, ids).clamp_(max=sorted_keys.numel() - 1)
    found = sorted_keys[pos] == ids
    return torch.where(found, slot_of[pos] % ways, torch.full_like(ids, -1))


def assign_sort_all_sets(
    scores: torch.Tensor, blocked: torch.Tensor, miss_sets: torch.Tensor
) -> torch.Tensor:
    """Sort every set's ways by (blocked, score, way), then rank each miss within its set."""
    key = torch.where(blocked, torch.iinfo(torch.int64).max, scores)
    order = torch.sort(key, dim=1, stable=True).indices  # [S, W]
    n_free = (~blocked).sum(dim=1)  # [S]
    rank = torch.arange(miss_sets.numel(), device=miss_sets.device)
    rank = rank - torch.searchsorted(miss_sets, miss_sets)
    way = order[miss_sets, rank.clamp(max=scores.shape[1] - 1)]
    return torch.where(rank < n_free[miss_sets], way, torch.full_like(way, -1))


# ----------------------------------------------------------------------------------------------
# inputs and timing
# ----------------------------------------------------------------------------------------------


def make_cache(
    num_sets: int, batch: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A full cache of ``num_sets * WAYS`` ids and a batch with about half hits.

    Returns keys [S, W], ids [batch], their sets [batch], and LRU-like scores [S, W].
    """
    pool = torch.unique(torch.randint(0, 2**62, (num_sets * WAYS * 3,), generator=gen))
    pool = pool[torch.randperm(pool.numel(), generator=gen)]
    sets = set_index_ref(pool, num_sets)
    order = torch.argsort(sets, stable=True)
    pool, sets = pool[order], sets[order]
    counts = torch.bincount(sets, minlength=num_sets)
    rank = torch.arange(pool.numel()) - (torch.cumsum(counts, 0) - counts)[sets]
    keep = rank < WAYS
    keys = torch.full((num_sets, WAYS), -1, dtype=torch.int64)
    keys[sets[keep], rank[keep]] = pool[keep]
    held = keys[keys != -1]
    hits = held[torch.randint(0, held.numel(), (batch // 2,), generator=gen)]
    misses = torch.randint(2**62, 2**63 - 1, (batch - batch // 2,), generator=gen)
    ids = torch.cat([hits, misses])[torch.randperm(batch, generator=gen)]
    scores = torch.randint(0, 1_000_000, (num_sets, WAYS), generator=gen)
    scores[keys == -1] = -1
    return (
        keys.to(device),
        ids.to(device),
        set_index_ref(ids, num_sets).to(device),
        scores.to(device),
    )


def per_second(fn: Callable[[], object], items: int, device: torch.device, reps: int) -> float:
    """Items per second of ``fn``: triton's do_bench on CUDA, a median of timed calls on CPU."""
    if device.type == "cuda":
        import triton.testing

        return items / (triton.testing.do_bench(fn, warmup=25, rep=100) * 1e-3)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return items / statistics.median(times)


def bench_size(
    num_sets: int, batch: int, device: torch.device, reps: int, gen: torch.Generator
) -> list[Row]:
    keys, ids, sets, scores = make_cache(num_sets, batch, device, gen)
    on_gpu = device.type == "cuda"

    sorted_keys, slot_of = sorted_keys_index(keys)
    want = cache_lookup_ref(keys, ids, sets)
    assert torch.equal(lookup_sorted_keys(sorted_keys, slot_of, ids, WAYS), want)
    if on_gpu:
        assert torch.equal(cache_lookup_triton(keys, ids, sets), want)
    lookup = Row(
        op="cache_lookup",
        device=device.type,
        num_sets=num_sets,
        ways=WAYS,
        batch=batch,
        baseline="sorted_keys",
        baseline_per_s=per_second(
            lambda: lookup_sorted_keys(sorted_keys, slot_of, ids, WAYS), batch, device, reps
        ),
        twin_per_s=per_second(lambda: cache_lookup_ref(keys, ids, sets), batch, device, reps),
        triton_per_s=(
            per_second(lambda: cache_lookup_triton(keys, ids, sets), batch, device, reps)
            if on_gpu
            else None
        ),
    )

    # The misses of the batch, sorted by set; the hit ways are blocked, as the cache does.
    miss = want == -1
    miss_sets = torch.sort(sets[miss]).values
    blocked = torch.zeros_like(keys, dtype=torch.bool)
    blocked[sets[~miss], want[~miss]] = True
    m = miss_sets.numel()
    want_ways = assign_ways_ref(scores, blocked, miss_sets)
    assert torch.equal(assign_sort_all_sets(scores, blocked, miss_sets), want_ways)
    if on_gpu:
        assert torch.equal(assign_ways_triton(scores, blocked, miss_sets), want_ways)
    assign = Row(
        op="assign_ways",
        device=device.type,
        num_sets=num_sets,
        ways=WAYS,
        batch=m,
        baseline="sort_all_sets",
        baseline_per_s=per_second(
            lambda: assign_sort_all_sets(scores, blocked, miss_sets), m, device, reps
        ),
        twin_per_s=per_second(lambda: assign_ways_ref(scores, blocked, miss_sets), m, device, reps),
        triton_per_s=(
            per_second(lambda: assign_ways_triton(scores, blocked, miss_sets), m, device, reps)
            if on_gpu
            else None
        ),
    )
    return [lookup, assign]


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    head = (
        f"{'op':<13}{'dev':<5}{'sets':>8}{'batch':>9}  {'baseline':<14}"
        f"{'base/s':>10}{'twin/s':>10}{'triton/s':>10}{'twin x':>8}{'triton x':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        tri = "-" if r.triton_per_s is None else f"{r.triton_per_s:.3g}"
        tri_x = "-" if r.triton_ratio is None else f"{r.triton_ratio:.2f}"
        print(
            f"{r.op:<13}{r.device:<5}{r.num_sets:>8}{r.batch:>9}  {r.baseline:<14}"
            f"{r.baseline_per_s:>10.3g}{r.twin_per_s:>10.3g}{tri:>10}{r.twin_ratio:>8.2f}{tri_x:>9}"
        )
    print("(per second: ids looked up / misses placed; x: ratio against the baseline)")


def write_csv(rows: list[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = [*asdict(rows[0]).keys(), "twin_ratio", "triton_ratio"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {**asdict(r), "twin_ratio": r.twin_ratio, "triton_ratio": r.triton_ratio}
            )


def write_plot(rows: list[Row], path: Path, note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = ["cache_lookup", "assign_ways"]
    fig, axes = plt.subplots(1, len(ops), figsize=(10, 4))
    for ax, op in zip(axes, ops, strict=True):
        sel = [r for r in rows if r.op == op]
        x = [r.num_sets for r in sel]
        ax.plot(x, [r.twin_ratio for r in sel], "o-", label="torch twin")
        if any(r.triton_ratio is not None for r in sel):
            ax.plot(x, [r.triton_ratio for r in sel], "s-", label="triton")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--", label=sel[0].baseline if sel else "baseline")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"sets (x{WAYS} ways)")
        ax.set_ylabel("throughput / baseline")
        ax.set_title(op)
        ax.legend()
    if note:
        fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# (sets, batch): a cache of sets x 32 ways, looked up by a batch of ids; timed calls per median.
SIZES = {
    "tiny": [(64, 256)],
    "quick": [(1024, 4096), (8192, 32768)],
    "full": [(1024, 4096), (8192, 32768), (65536, 131072), (262144, 524288)],
}
REPS = {"tiny": 2, "quick": 5, "full": 20}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small sizes, a few seconds")
    parser.add_argument(
        "--tiny", action="store_true", help="one toy size (the GPU check's dry run)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    add_output_options(parser, "cache_index.csv")
    args = parse_args(parser, argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    sizes, reps = SIZES[size], REPS[size]
    gen = torch.Generator().manual_seed(0)
    rows = [row for s, b in sizes for row in bench_size(s, b, device, reps, gen)]
    rows.sort(key=lambda r: (r.op != "cache_lookup", r.num_sets))
    print_table(rows)
    note = quick_note(args.quick and device.type != "cuda")
    for op in ("cache_lookup", "assign_ways"):
        r = max((r for r in rows if r.op == op), key=lambda r: r.num_sets)
        ratio = r.triton_ratio if r.triton_ratio is not None else r.twin_ratio
        who = "triton" if r.triton_ratio is not None else "twin"
        print(f"summary: {op} sets={r.num_sets} {who} x{ratio:.2f} vs {r.baseline}")
    write_csv(rows, args.out)
    write_plot(rows, args.out.with_suffix(".png"), note)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
