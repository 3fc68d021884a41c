"""How fast is a training step through the cache on the device, against torch's own sparse path?

Question: time per training step (forward, backward, sparse AdaGrad step) of
`CachedEmbeddingBagCollection` on the device with its cache holding every row (``embcache_100``)
and 10% of them (``embcache_10``, `HostKV` behind it), against the named baseline measured in
the same run on the same batches: ``torch_sparse``, one ``nn.EmbeddingBag(sparse=True)`` per
table, every table resident on the device, stepped by ``torch.optim.Adagrad``. Each row is
``baseline_time / our_time`` (> 1: ours is faster).

Every model starts from the same weights and trains on the same batches (Zipf(1.05) ids, bags of
1 to ``2 * pooling - 1`` ids, loss ``(pooled * coeff).sum()``); the pooled output of the first
batch and the final weights of the touched rows are checked against the baseline's before any
time is reported. Prints a table and ``summary:`` lines; writes ``--out`` (CSV) and a PNG beside it.

    python benchmarks/bench_gpu_step.py [--quick | --tiny] [--device cpu|cuda] [--out FILE.csv]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import (
    ZipfIds,
    add_output_options,
    parse_args,
    pick_device,
    pyplot,
    run_header,
    set_threads,
    write_csv,
)
from torch import nn

import embcache

ALPHA = 1.05
LR, EPS = 0.05, 1e-8


@dataclass
class Config:
    tables: int
    rows: int
    dim: int
    batch: int
    pooling: int
    steps: int
    warmup: int


SIZES = {  # tables, rows per table, dim, batch, mean bag length, steps, warm-up steps
    "full": Config(8, 1_000_000, 64, 4096, 20, 50, 10),
    "quick": Config(8, 200_000, 64, 2048, 20, 20, 5),
    "tiny": Config(2, 500, 8, 16, 3, 3, 1),
}


@dataclass
class Row:
    impl: str
    cached_fraction: float
    tables: int
    rows: int
    dim: int
    batch: int
    ms_per_step: float
    lookups_per_s: float  # ids looked up (forward) per second of whole steps
    baseline_ms: float  # torch_sparse's time in the same run

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.ms_per_step


def make_batches(
    cfg: Config, device: torch.device
) -> list[tuple[embcache.JaggedBatch, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    laws = [ZipfIds(cfg.rows, ALPHA, gen) for _ in range(cfg.tables)]
    batches = []
    for _ in range(cfg.steps):
        lengths = torch.randint(1, 2 * cfg.pooling, (cfg.tables, cfg.batch), generator=gen)
        values = torch.cat(
            [law.sample(int(n), gen) for law, n in zip(laws, lengths.sum(dim=1), strict=True)]
        )
        kjt = embcache.JaggedBatch.from_lengths(
            keys=[f"f{i}" for i in range(cfg.tables)], values=values, lengths=lengths.reshape(-1)
        )
        coeff = torch.randn(cfg.batch, cfg.tables * cfg.dim, generator=gen).to(device)
        batches.append((kjt, coeff))
    return batches


class TorchSparse(nn.Module):
    """The baseline: one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table."""

    def __init__(self, weights: list[torch.Tensor], device: torch.device) -> None:
        super().__init__()
        self.bags = nn.ModuleList(
            nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum", sparse=True).to(
                device
            )
            for w in weights
        )

    def forward(self, kjt: embcache.JaggedBatch, device: torch.device) -> torch.Tensor:
        values = kjt.values().to(device)
        lengths = kjt.lengths().to(device).reshape(len(self.bags), -1)
        outs, start = [], 0
        for bag, lens in zip(self.bags, lengths, strict=True):
            n = int(lens.sum())
            offsets = torch.cumsum(lens, 0) - lens
            outs.append(bag(values[start : start + n], offsets))
            start += n
        return torch.cat(outs, dim=1)


def _timed(step: Callable[[int], None], cfg: Config, device: torch.device) -> float:
    """Seconds per step over the steps after the warm-up ones."""
    t0 = 0.0
    for i in range(cfg.steps):
        if i == cfg.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / (cfg.steps - cfg.warmup)


def run(cfg: Config, device: torch.device) -> list[Row]:
    gen = torch.Generator().manual_seed(1)
    bound = (1.0 / cfg.rows) ** 0.5
    weights = [
        (torch.rand(cfg.rows, cfg.dim, generator=gen) * 2 - 1) * bound for _ in range(cfg.tables)
    ]
    batches = make_batches(cfg, device)
    lookups = sum(int(kjt.values().numel()) for kjt, _ in batches[cfg.warmup :])
    lookups /= cfg.steps - cfg.warmup

    base = TorchSparse(weights, device)
    base_opt = torch.optim.Adagrad(base.parameters(), lr=LR, eps=EPS)
    with torch.no_grad():
        first = base(batches[0][0], device)

    def base_step(i: int) -> None:
        kjt, coeff = batches[i]
        (base(kjt, device) * coeff).sum().backward()
        base_opt.step()
        base_opt.zero_grad(set_to_none=True)

    base_s = _timed(base_step, cfg, device)
    rows = [Row("torch_sparse", 1.0, cfg.tables, cfg.rows, cfg.dim, cfg.batch, 0, 0, 0)]
    rows[0].ms_per_step, rows[0].lookups_per_s = base_s * 1e3, lookups / base_s
    touched = torch.unique(torch.cat([kjt.values() for kjt, _ in batches]))

    for fraction in (1.0, 0.1):
        tables = [
            embcache.TableConfig(
                name=f"t{i}",
                embedding_dim=cfg.dim,
                num_embeddings=cfg.rows,
                feature_names=[f"f{i}"],
            )
            for i in range(cfg.tables)
        ]
        ours = embcache.CachedEmbeddingBagCollection(
            tables,
            cache=embcache.CacheConfig(load_factor=fraction),
            store=embcache.HostKV(),
            device=device,
            seed=0,
        )
        ours.load_state_dict({f"embedding_bags.t{i}.weight": w for i, w in enumerate(weights)})
        opt = embcache.SparseAdaGrad([ours], lr=LR, eps=EPS)
        with torch.no_grad():
            got = ours(batches[0][0]).values()
        torch.testing.assert_close(got, first, rtol=1e-5, atol=1e-6)

        def step(i: int, ours=ours, opt=opt) -> None:
            kjt, coeff = batches[i]
            (ours(kjt).values() * coeff).sum().backward()
            opt.step()

        seconds = _timed(step, cfg, device)
        state = ours.state_dict()
        for i, bag in enumerate(base.bags):  # every row either side touched, after all steps
            ids = touched[touched < cfg.rows]
            torch.testing.assert_close(
                state[f"embedding_bags.t{i}.weight"][ids].float().cpu(),
                bag.weight.detach()[ids.to(device)].cpu(),
                rtol=1e-4,
                atol=1e-5,
            )
        rows.append(
            Row(
                f"embcache_{round(fraction * 100)}",
                fraction,
                cfg.tables,
                cfg.rows,
                cfg.dim,
                cfg.batch,
                seconds * 1e3,
                lookups / seconds,
                base_s * 1e3,
            )
        )
    rows[0].baseline_ms = rows[0].ms_per_step
    return rows


def plot(rows: list[Row], path: Path, header: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r.impl for r in rows], [r.speedup for r in rows], color="tab:blue")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("torch_sparse time / ours (> 1: faster)")
    ax.set_title(header.lstrip("# ")[:90], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="8 x 200k rows, 20 steps")
    size.add_argument("--tiny", action="store_true", help="toy sizes (the Triton interpreter)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1)")
    add_output_options(parser, "gpu_step.csv")
    args = parse_args(parser, argv)
    set_threads(args.threads)
    device = pick_device(args.device)
    cfg = SIZES["tiny" if args.tiny else "quick" if args.quick else "full"]
    header = run_header(device)
    print(header)
    print(f"# {cfg}")
    rows = run(cfg, device)
    print(f"{'impl':<14} {'ms/step':>9} {'lookups/s':>11} {'vs torch_sparse':>16}")
    for r in rows:
        print(f"{r.impl:<14} {r.ms_per_step:9.3f} {r.lookups_per_s:11.3g} {r.speedup:15.2f}x")
    for r in rows[1:]:
        print(
            f"summary: step {r.impl} {r.ms_per_step:.2f} ms = x{r.speedup:.2f} vs torch_sparse "
            f"{r.baseline_ms:.2f} ms; {r.lookups_per_s:.3g} lookups/s; weights match"
        )
    write_csv(rows, args.out, extra=["speedup"])
    plot(rows, args.out.with_suffix(".png"), header)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
