"""How do checkpoint bytes and time grow with the fraction of rows trained? embcache.save against
torch.save(state_dict()) (the named baseline), with and without reading every row first.

A collection of 26 tables x 65,536 rows, dim 16, SparseAdaGrad, 10% of the rows cached (the
issue's model), trains on batches that touch exactly a fraction ``f`` of every table's rows.
Then, side by side in this process:

* ``embcache.save``: streams the rows the tier holds (weights and AdaGrad state), which are the
  rows trained: the others are re-created from the initialiser's seed on load;
* ``embcache.save`` after ``state_dict()``, ``table_rows`` of every table and a
  ``load_state_dict`` of the same weights, i.e. after every row was read: reads create no row,
  so it writes what the first save wrote;
* baseline ``torch.save(ebc.state_dict())``: every table whole (weights only, no optimizer
  state), the torchrec way to share or keep weights.

"all rows" is what a checkpoint of every row with its state would hold. Prints a table; writes
checkpoint.csv and checkpoint.png (bytes and seconds against ``f``).

    .venv/bin/python benchmarks/bench_checkpoint.py            # full (about a minute)
    .venv/bin/python benchmarks/bench_checkpoint.py --quick    # 3 small tables: a smoke test
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import _common
import torch

import embcache

FRACTIONS = (0.001, 0.01, 0.1, 0.5, 1.0)
ROWS, DIM, BATCH = 65_536, 16, 4096


@dataclass(frozen=True)
class Sizes:
    tables: int
    rows: int  # per table
    reps: int  # saves timed, the median kept
    batch: int  # ids per table and step


FULL = Sizes(26, ROWS, 3, BATCH)
QUICK = Sizes(3, 16_384, 1, 1024)  # a smoke test of the script: too small for conclusions


@dataclass
class Row:
    fraction: float
    rows_touched: int
    rows_saved: int
    save_bytes: int
    save_s: float
    save_after_reads_bytes: int
    save_after_reads_s: float
    state_dict_bytes: int  # the baseline
    state_dict_s: float  # state_dict() + torch.save (median of 3, --quick 1, as each save)
    all_rows_bytes: int

    @property
    def bytes_vs_baseline(self) -> float:
        return self.save_bytes / self.state_dict_bytes

    @property
    def bytes_vs_all_rows(self) -> float:
        return self.save_bytes / self.all_rows_bytes

    @property
    def time_vs_baseline(self) -> float:
        return self.save_s / self.state_dict_s


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _trained(n_tables: int, rows: int, fraction: float, gen: torch.Generator, per_step: int):
    """A collection and its optimizer after training on exactly ``fraction`` of each table."""
    tables = [
        embcache.TableConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=rows,
                             feature_names=[f"f{i}"])
        for i in range(n_tables)
    ]  # fmt: skip
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=tables, cache=embcache.CacheConfig(load_factor=0.1)
    )
    opt = embcache.SparseAdaGrad(ebc, lr=0.05)
    touched = max(1, round(fraction * rows))
    pools = [torch.randperm(rows, generator=gen)[:touched] for _ in range(n_tables)]
    keys = [f"f{i}" for i in range(n_tables)]
    for lo in range(0, touched, per_step):  # every pooled id once, one id per bag
        values = torch.cat([p[lo : lo + per_step] for p in pools])
        n = min(per_step, touched - lo)
        batch = embcache.JaggedBatch.from_lengths(
            keys, values, torch.ones(n * n_tables, dtype=torch.int64)
        )
        ebc(batch).values().square().sum().backward()
        opt.step()
    ebc.flush()
    return ebc, opt, touched * n_tables


def _timed(fn, reps: int = 3) -> float:
    """Median seconds of ``reps`` calls (a save replaces the previous snapshot)."""
    return _common.seconds(fn, torch.device("cpu"), reps, warmup=False)


def measure(fraction: float, sizes: Sizes, root: Path, gen: torch.Generator) -> Row:
    n_tables, rows, reps = sizes.tables, sizes.rows, sizes.reps
    ebc, opt, touched = _trained(n_tables, rows, fraction, gen, sizes.batch)
    quiet, read, dense = root / "quiet", root / "read", root / "state_dict.pt"
    save_s = _timed(lambda: embcache.save(quiet, ebc, [opt]), reps)

    def read_everything() -> None:
        state = ebc.state_dict()
        for t in ebc.tables:
            ebc.table_rows(t.name)
        ebc.load_state_dict(state)

    read_everything()
    after_s = _timed(lambda: embcache.save(read, ebc, [opt]), reps)
    state_s = _timed(lambda: torch.save(ebc.state_dict(), dense), reps)
    saved = sum(ids.numel() for t in ebc.tables for ids, _ in ebc.store.export_rows(t.name))
    row = Row(
        fraction=fraction,
        rows_touched=touched,
        rows_saved=saved,
        save_bytes=_dir_bytes(quiet),
        save_s=save_s,
        save_after_reads_bytes=_dir_bytes(read),
        save_after_reads_s=after_s,
        state_dict_bytes=dense.stat().st_size,
        state_dict_s=state_s,
        all_rows_bytes=n_tables * rows * (2 * DIM * 4 + 8),  # rows with state, and their ids
    )
    for p in (quiet, read, dense):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
    return row


def write_plot(rows: list[Row], path: Path, title: str) -> None:
    plt = _common.pyplot()
    x = [r.fraction for r in rows]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_b.plot(x, [r.save_bytes for r in rows], "o-", label="embcache.save")
    ax_b.plot(x, [r.save_after_reads_bytes for r in rows], "x--", label="... after reading all")
    ax_b.plot(x, [r.state_dict_bytes for r in rows], "s-", label="torch.save(state_dict())")
    ax_b.plot(x, [r.all_rows_bytes for r in rows], ":", color="gray", label="all rows + state")
    ax_b.set_ylabel("checkpoint bytes")
    ax_t.plot(x, [r.save_s for r in rows], "o-", label="embcache.save")
    ax_t.plot(x, [r.save_after_reads_s for r in rows], "x--", label="... after reading all")
    ax_t.plot(x, [r.state_dict_s for r in rows], "s-", label="torch.save(state_dict())")
    ax_t.set_ylabel("seconds")
    for ax in (ax_b, ax_t):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("fraction of rows trained")
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="3 tables x 16,384 rows, one save each: a smoke test"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1)")
    _common.add_output_options(parser, "checkpoint.csv")
    args = _common.parse_args(parser)
    _common.set_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    n_tables, n_rows = sizes.tables, sizes.rows
    header = _common.run_header(torch.device("cpu"))
    print(header)
    print(f"# {n_tables} tables x {n_rows:,} rows, dim {DIM}, SparseAdaGrad, 10% cached")
    note = _common.quick_note(args.quick)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fraction in FRACTIONS:
            rows.append(measure(fraction, sizes, Path(tmp), gen))
    print(
        f"{'trained':>8} {'rows saved':>11} {'save MB':>9} {'after reads':>12} "
        f"{'state_dict MB':>14} {'bytes vs sd':>12} {'vs all rows':>12} {'save s':>7} "
        f"{'sd s':>6} {'time vs sd':>11}"
    )
    for r in rows:
        print(
            f"{r.fraction:>8.1%} {r.rows_saved:>11,} {r.save_bytes / 1e6:>9.2f} "
            f"{r.save_after_reads_bytes / 1e6:>12.2f} {r.state_dict_bytes / 1e6:>14.1f} "
            f"{r.bytes_vs_baseline:>11.3f}x {r.bytes_vs_all_rows:>11.4f}x {r.save_s:>7.2f} "
            f"{r.state_dict_s:>6.2f} {r.time_vs_baseline:>10.3f}x"
        )
    one = next(r for r in rows if math.isclose(r.fraction, 0.01))
    print(
        f"summary: 1% trained -> embcache.save {one.bytes_vs_all_rows:.2%} of all rows' bytes, "
        f"{one.bytes_vs_baseline:.3f}x torch.save(state_dict()) bytes, "
        f"{one.time_vs_baseline:.3f}x its time; unchanged after reading every row: "
        f"{all(r.save_bytes == r.save_after_reads_bytes for r in rows)}"
    )
    extra = ["bytes_vs_baseline", "bytes_vs_all_rows", "time_vs_baseline"]
    _common.write_csv(rows, args.out, extra)
    title = f"{header[2:]}\n{n_tables} tables x {n_rows:,} rows, dim {DIM}, AdaGrad, 10% cached"
    title += f"; baseline torch.save(state_dict()){f'; {note}' if note else ''}"
    write_plot(rows, args.out.with_suffix(".png"), title)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
