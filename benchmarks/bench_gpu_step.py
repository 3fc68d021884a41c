"""How fast is a training step through the cache on the device, against torch's own sparse path?

Question: time per training step (forward, backward, sparse AdaGrad step) of
`CachedEmbeddingBagCollection` on the device with its cache holding every row (``embcache_100``)
and 10% of them (``embcache_10``, `HostKV` behind it), against the named baseline measured in
the same run on the same batches: ``torch_sparse``, one ``nn.EmbeddingBag(sparse=True)`` per
table, every table resident on the device, stepped by ``torch.optim.Adagrad``. Each row is
``baseline_time / our_time`` (> 1: ours is faster).

Every model starts from the same weights and trains on the same batches (Zipf(1.05) ids, bags of
1 to ``2 * pooling - 1`` ids, loss ``(pooled * coeff).sum()``), already on the device, as a
training loop's input pipeline leaves them; the pooled output of the first batch and the final
weights of the touched rows are checked against the baseline's before any time is reported.
The baseline is the strongest plain-torch step: the per-table split of the values is computed
on the host when the batch is made (its lengths are known there), so its step makes no
per-table host sync. Each impl first trains one pass over every batch (the pass whose weights
are checked), then is timed over the batches after the first ``warmup`` in a pass that compiled
no Triton kernel (``triton.knobs.runtime.jit_post_compile_hook``; passes that compiled one are
repeated); ``warmup_steps`` says how many steps ran before the timed pass. ``lookups_per_s``
counts every id of a step, ``unique_per_s`` the distinct (table, id) rows. Prints a table and
``summary:`` lines; writes ``--out`` (CSV) and a PNG beside it. ``--quick``: 8 x 200k rows
and 20 steps on a GPU (the GPU check's size); without one, 4 x 20k rows x dim 32, batch 256,
8 steps: a smoke test of the CPU path, too small for conclusions.

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
    quick_note,
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
    "quick": Config(8, 200_000, 64, 2048, 20, 20, 5),  # on a GPU (the GPU check's size)
    # --quick without a GPU: a smoke test of the CPU path (the GPU size took about 6 GB and 39
    # CPU-seconds there), too small for conclusions.
    "quick_cpu": Config(4, 20_000, 32, 256, 8, 8, 2),
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
    unique_per_s: float  # distinct (table, id) rows per second of whole steps
    baseline_ms: float  # torch_sparse's time in the same run
    warmup_steps: int  # steps before timing: until 3 steps in a row compiled nothing

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.ms_per_step


@dataclass
class Batch:
    kjt: embcache.JaggedBatch  # on the device
    coeff: torch.Tensor  # [batch, tables * dim] on the device
    sizes: list[int]  # values per table, known on the host when the batch was made
    unique: int  # distinct (table, id) rows


def make_batches(cfg: Config, device: torch.device) -> list[Batch]:
    gen = torch.Generator().manual_seed(0)
    laws = [ZipfIds(cfg.rows, ALPHA, gen) for _ in range(cfg.tables)]
    batches = []
    for _ in range(cfg.steps):
        lengths = torch.randint(1, 2 * cfg.pooling, (cfg.tables, cfg.batch), generator=gen)
        sizes = lengths.sum(dim=1).tolist()
        parts = [law.sample(int(n), gen) for law, n in zip(laws, sizes, strict=True)]
        kjt = embcache.JaggedBatch.from_lengths(
            keys=[f"f{i}" for i in range(cfg.tables)],
            values=torch.cat(parts),
            lengths=lengths.reshape(-1),
        )
        coeff = torch.randn(cfg.batch, cfg.tables * cfg.dim, generator=gen).to(device)
        unique = sum(int(torch.unique(p).numel()) for p in parts)
        batches.append(Batch(kjt.to(device), coeff, sizes, unique))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
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

    def forward(self, batch: Batch) -> torch.Tensor:
        """No host sync: the split sizes came with the batch."""
        lengths = batch.kjt.lengths().view(len(self.bags), -1)
        offsets = torch.cumsum(lengths, 1) - lengths  # [tables, batch], on the device
        values = torch.split(batch.kjt.values(), batch.sizes)
        outs = [bag(v, o) for bag, v, o in zip(self.bags, values, offsets, strict=True)]
        return torch.cat(outs, dim=1)


def torch_step(weights: list[torch.Tensor], batches: list[Batch], device: torch.device):
    """The baseline's model and its training step on ``batches[i]``."""
    base = TorchSparse(weights, device)
    opt = torch.optim.Adagrad(base.parameters(), lr=LR, eps=EPS)

    def step(i: int) -> None:
        b = batches[i]
        (base(b) * b.coeff).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return base, step


def cached_step(cfg: Config, fraction: float, batches: list[Batch], device: torch.device):
    """`CachedEmbeddingBagCollection` holding ``fraction`` of ``cfg``'s tables over `HostKV`,
    and its training step (sparse AdaGrad) on ``batches[i]``."""
    tables = [
        embcache.TableConfig(
            name=f"t{i}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f"f{i}"]
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
    opt = embcache.SparseAdaGrad([ours], lr=LR, eps=EPS)

    def step(i: int) -> None:
        b = batches[i]
        (ours(b.kjt).values() * b.coeff).sum().backward()
        opt.step()

    return ours, step


class Compiles:
    """Counts Triton compiles in this process (0 where Triton has no such hook)."""

    def __init__(self) -> None:
        self.count = 0
        try:
            import triton

            knobs = triton.knobs.runtime
            previous = knobs.jit_post_compile_hook

            def hook(*args, **kwargs):
                self.count += 1
                return previous(*args, **kwargs) if previous else False

            knobs.jit_post_compile_hook = hook
        except (ImportError, AttributeError):
            pass


COMPILES = Compiles()


def _timed(step: Callable[[int], None], cfg: Config, device: torch.device) -> tuple[float, int]:
    """Seconds per step over the batches after the first ``cfg.warmup``, timed in a pass that
    compiled no Triton kernel; the passes before it (the first is the one whose weights are
    checked) warm up. Returns the time and the number of steps run before the timed pass."""
    warm = 0
    for _ in range(4):
        before = COMPILES.count
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for j in range(cfg.warmup, cfg.steps):
            step(j)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - t0) / (cfg.steps - cfg.warmup)
        if COMPILES.count == before:
            return seconds, warm
        warm += cfg.steps - cfg.warmup
    raise RuntimeError(f"still compiling after {warm} steps: no honest time to give")


def _progress(what: str, t0: float) -> None:
    print(f"# {time.perf_counter() - t0:6.1f} s  {what}", flush=True)


def run(cfg: Config, device: torch.device) -> list[Row]:
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(1)
    bound = (1.0 / cfg.rows) ** 0.5
    weights = [
        (torch.rand(cfg.rows, cfg.dim, generator=gen) * 2 - 1) * bound for _ in range(cfg.tables)
    ]
    batches = make_batches(cfg, device)
    timed = batches[cfg.warmup :]
    lookups = sum(int(b.kjt.values().numel()) for b in timed) / len(timed)
    unique = sum(b.unique for b in timed) / len(timed)
    _progress(f"{cfg.steps} batches made on {device}", t0)

    base, base_step = torch_step(weights, batches, device)
    with torch.no_grad():
        first = base(batches[0])

    for i in range(cfg.steps):  # the pass whose weights are checked
        base_step(i)
    touched = torch.unique(torch.cat([b.kjt.values().cpu() for b in batches]))
    ids = touched[touched < cfg.rows]
    expected = [bag.weight.detach()[ids.to(device)].cpu() for bag in base.bags]
    base_s, base_warm = _timed(base_step, cfg, device)
    base_warm += cfg.steps
    rows = [
        Row("torch_sparse", 1.0, cfg.tables, cfg.rows, cfg.dim, cfg.batch, base_s * 1e3,
            lookups / base_s, unique / base_s, base_s * 1e3, base_warm)
    ]  # fmt: skip
    _progress(f"torch_sparse {base_s * 1e3:.2f} ms/step after {base_warm} warm-up steps", t0)

    for fraction in (1.0, 0.1):
        ours, step = cached_step(cfg, fraction, batches, device)
        ours.load_state_dict({f"embedding_bags.t{i}.weight": w for i, w in enumerate(weights)})
        with torch.no_grad():
            got = ours(batches[0].kjt).values()
        torch.testing.assert_close(got, first, rtol=1e-5, atol=1e-6)
        _progress(f"embcache_{round(fraction * 100)} built and loaded", t0)

        for i in range(cfg.steps):  # the pass whose weights are checked
            step(i)
        state = ours.state_dict()
        for i, rows_i in enumerate(expected):  # every row either side touched, after all steps
            torch.testing.assert_close(
                state[f"embedding_bags.t{i}.weight"][ids].float().cpu(),
                rows_i,
                rtol=1e-4,
                atol=1e-5,
            )
        del state
        _progress(f"embcache_{round(fraction * 100)} weights match torch_sparse's", t0)
        seconds, warm = _timed(step, cfg, device)
        warm += cfg.steps
        _progress(
            f"embcache_{round(fraction * 100)} {seconds * 1e3:.2f} ms/step after {warm} "
            "warm-up steps",
            t0,
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
                unique / seconds,
                base_s * 1e3,
                warm,
            )
        )
        del ours, step
    return rows


def plot(rows: list[Row], path: Path, header: str, note: str = "") -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r.impl for r in rows], [r.speedup for r in rows], color="tab:blue")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("torch_sparse time / ours (> 1: faster)")
    ax.set_title(header.lstrip("# ")[:90] + (f"\n{note}" if note else ""), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="8 x 200k rows, 20 steps on a GPU; on the CPU 4 x 20k rows, 8 steps (a smoke test)",
    )
    size.add_argument("--tiny", action="store_true", help="toy sizes (the Triton interpreter)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1)")
    add_output_options(parser, "gpu_step.csv")
    args = parse_args(parser, argv)
    set_threads(args.threads)
    device = pick_device(args.device)
    quick = "quick" if device.type == "cuda" else "quick_cpu"
    cfg = SIZES["tiny" if args.tiny else quick if args.quick else "full"]
    header = run_header(device)
    print(header)
    print(f"# {cfg}")
    note = quick_note(args.quick and device.type != "cuda")
    rows = run(cfg, device)
    print(
        f"{'impl':<14} {'ms/step':>9} {'lookups/s':>11} {'unique/s':>11} {'warm-up':>8} "
        f"{'vs torch_sparse':>16}"
    )
    for r in rows:
        print(
            f"{r.impl:<14} {r.ms_per_step:9.3f} {r.lookups_per_s:11.3g} {r.unique_per_s:11.3g} "
            f"{r.warmup_steps:8d} {r.speedup:15.2f}x"
        )
    for r in rows[1:]:
        print(
            f"summary: step {r.impl} {r.ms_per_step:.2f} ms = x{r.speedup:.2f} vs torch_sparse "
            f"{r.baseline_ms:.2f} ms; {r.lookups_per_s:.3g} lookups/s ({r.unique_per_s:.3g} "
            f"unique); timed after {r.warmup_steps} warm-up steps; weights match"
        )
    write_csv(rows, args.out, extra=["speedup"])
    plot(rows, args.out.with_suffix(".png"), header, note)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
