"""How many host syncs, launches and new compile keys does a training step make on the device path?

Question: per training step (forward, backward, sparse AdaGrad step) of
`CachedEmbeddingBagCollection` on the device path (``EMBCACHE_BACKEND=triton``, Triton's
interpreter standing in for the GPU, so it runs on a CPU), for 2 and 26 tables of one dim and
for 1 and 3 distinct dims, with the whole table cached and with 10% cached (LRU, over
`HostKV`): the host reads that would synchronise a GPU (`tests.sync_count.SyncCounter`; the
interpreter takes the GPU's branches, so no CPU-only read is counted), the kernel launches
(`tests.launch_count.LaunchCounter`: Triton launches plus the aten ops that would run a
kernel, not the interpreter's copies of a kernel's arguments), and the Triton compile keys
first seen after step 2
(`compile_kernels.compile_key`, Triton's own specialisation). No baseline: these are counts,
compared with the targets of docs/design.md (syncs <= 2 whole table, <= 4 at 10%; launches
<= 40 and <= 70; no new key after step 2; all flat in tables and dims). Counts, not times, so
they are exact on any machine. Prints a table; writes ``--out`` (CSV).

    python benchmarks/device_counts.py [--out FILE.csv]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
os.environ["EMBCACHE_BACKEND"] = "triton"

from dataclasses import dataclass

import torch
from _common import add_output_options, parse_args, write_csv
from compile_kernels import compile_key

STEPS, WARMUP = 6, 2


@dataclass
class Row:
    tables: int
    dims: int
    cached_fraction: float
    rows: int  # per table
    syncs_forward: int
    syncs_backward: int
    syncs_step: int
    launches_forward: int
    launches_backward: int
    launches_step: int
    triton_launches: int
    new_compile_keys: int  # first seen after step 2
    new_keys: str  # their kernels


def count(num_tables: int, num_dims: int, load_factor: float, rows: int = 1000) -> Row:
    from triton.runtime import interpreter

    from tests.launch_count import LaunchCounter, counted_collection
    from tests.sync_count import SyncCounter

    ebc, opt, make_batch = counted_collection(num_tables, num_dims, load_factor, rows)
    gen = torch.Generator().manual_seed(0)
    first: dict[tuple, int] = {}
    step_now = [0]
    run = interpreter.InterpretedFunction.run

    def keyed(fn, *args, grid, warmup, **kwargs):
        first.setdefault(compile_key(fn, args, kwargs)[2], step_now[0])
        return run(fn, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = keyed
    try:
        for step in range(STEPS):
            step_now[0] = step
            kjt = make_batch([1, 16, 7, 33, 16, 48][step % 6], gen)
            last = step == STEPS - 1
            with SyncCounter() as sf, LaunchCounter() as lf:
                out = ebc(kjt).values()
            with SyncCounter() as sb, LaunchCounter() as lb:
                out.sum().backward()
            with SyncCounter() as ss, LaunchCounter() as ls:
                opt.step()
            if last:
                row = Row(
                    num_tables, num_dims, load_factor, rows, sf.total, sb.total, ss.total,
                    lf.total, lb.total, ls.total, lf.triton + lb.triton + ls.triton,
                    sum(s >= WARMUP for s in first.values()),
                    " ".join(sorted(f"{k[1]}@{s}" for k, s in first.items() if s >= WARMUP)),
                )  # fmt: skip
    finally:
        interpreter.InterpretedFunction.run = run
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_options(parser, "device_counts.csv")
    args = parse_args(parser, argv)
    torch.set_num_threads(1)
    rows = [
        count(t, d, lf)
        for lf in (1.0, 0.1)
        for t, d in ((2, 1), (26, 1), (6, 3))
    ]  # fmt: skip
    # A tenth of 1,000 rows is less than the largest batch's unique rows (the scratch
    # area's overflow path, which warns); a tenth of 10,000 holds any batch here.
    rows += [count(2, 1, 0.1, 10_000), count(6, 3, 0.1, 10_000)]
    print(f"# device path (Triton interpreter), step {STEPS} after {STEPS - 1} varied batches")
    head = "tables dims cached   rows  syncs f/b/s   launches f/b/s   triton  new keys after step 2"
    print(head)
    for r in rows:
        print(
            f"{r.tables:6d} {r.dims:4d} {r.cached_fraction:5.0%} {r.rows:6d}  "
            f"{r.syncs_forward:3d}/{r.syncs_backward}/{r.syncs_step}  "
            f"{r.launches_forward:5d}/{r.launches_backward}/{r.launches_step}"
            f"{'':>6}{r.triton_launches:4d}  {r.new_compile_keys:4d} {r.new_keys}"
        )
    for r in rows:
        print(
            f"summary: {r.tables} tables x {r.dims} dims, {r.cached_fraction:.0%} of {r.rows} "
            "rows cached: syncs "
            f"{r.syncs_forward + r.syncs_backward + r.syncs_step}, launches "
            f"{r.launches_forward + r.launches_backward + r.launches_step}, new compile keys "
            f"{r.new_compile_keys}"
        )
    write_csv(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
