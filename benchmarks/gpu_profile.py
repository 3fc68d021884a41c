"""Where does a training step's time go on the device? Kernels, launches, host syncs and
compiles per step, read with torch's profiler.

Question: for the training step that `bench_gpu_step.py` times (forward, backward, sparse
AdaGrad through `CachedEmbeddingBagCollection`, the whole table resident and 10% cached over
`HostKV`, batches already on the device), and for its named baseline in the same run
(``torch_sparse``: one ``nn.EmbeddingBag(sparse=True)`` per table + ``torch.optim.Adagrad``,
no per-table host sync), how much of a step is
the device busy, how many kernels does a step launch, how often does the host wait for the
device, and does Triton compile anything after the warm-up?

Per impl, after ``--warmup`` steps, ``--steps`` steps are measured three ways:

* wall time per step, unprofiled;
* under ``torch.profiler`` (CPU and CUDA activities): the summed duration of the device's
  kernels and copies (``gpu_busy_ms``), kernel launches, and the runtime calls that block the
  host (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``) and
  copies (``cudaMemcpy*``), each per step;
* under ``torch.cuda.set_sync_debug_mode("warn")``: the syncing torch ops per step;

and Triton's compiles are counted per step over the whole run (``triton.knobs.runtime
.jit_post_compile_hook``). Last, on CUDA, it tries to capture the whole-table step in a
``torch.cuda.CUDAGraph`` and says whether it captured (a host read inside the step refuses the
capture: the error is printed) and, if so, its replay time against the eager step's. The try
comes last because a refused capture can leave the process's CUDA context unusable. The top
kernels by device time and the top host ops by self time go to ``gpu_profile_top.txt``.
Prints a table and ``summary:`` lines; writes ``--out`` (CSV).

    python benchmarks/gpu_profile.py [--quick | --tiny] [--device cuda] [--out FILE.csv]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _common import (
    add_output_options,
    parse_args,
    pick_device,
    run_header,
    set_threads,
    write_csv,
)
from bench_gpu_step import SIZES, cached_step, make_batches, torch_step

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass
class Row:
    impl: str
    ms_per_step: float
    gpu_busy_ms: float
    kernels_per_step: float
    syncs_per_step: float  # blocking runtime calls (profiler)
    syncing_ops_per_step: float  # torch ops that sync (sync debug mode)
    memcpy_per_step: float
    compiles_after_warmup: int
    compiles_per_step: str  # the first steps' compile counts, "a b c ..."


class CompileCounter:
    """Counts Triton compiles (in-process cache misses) as they happen, by step."""

    def __init__(self) -> None:
        self.step = -1
        self.by_step: Counter[int] = Counter()
        self.names: list[tuple[int, str]] = []
        try:
            import triton

            self._knobs = triton.knobs.runtime
        except (ImportError, AttributeError):
            self._knobs = None
        self._previous = None

    def __enter__(self) -> CompileCounter:
        if self._knobs is not None:
            self._previous = self._knobs.jit_post_compile_hook
            self._knobs.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.jit_post_compile_hook = self._previous

    def _hook(self, *args, **kwargs) -> bool:
        self.by_step[self.step] += 1
        self.names.append((self.step, str(kwargs.get("repr", "?"))[:400]))
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    impl: str,
    step: Callable[[int], None],
    steps: int,
    warmup: int,
    device: torch.device,
    compiles: CompileCounter,
    top: list[str],
) -> Row:
    for i in range(warmup):
        compiles.step = i
        step(i)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        compiles.step = i
        step(i)
    _sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / steps

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(warmup + steps, warmup + 2 * steps):
            compiles.step = i
            step(i)
        _sync(device)
    events = prof.events()
    busy_us, kernels, syncs, copies = 0.0, 0, 0, 0
    for e in events:
        kind = str(getattr(e, "device_type", "")).rsplit(".", 1)[-1]
        if kind == "CUDA":
            busy_us += e.device_time
            kernels += 1
        elif e.name in SYNC_CALLS:
            syncs += 1
        elif e.name.startswith("cudaMemcpy"):
            copies += 1
    if device.type == "cuda":
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=20)
        top.append(f"== {impl}: top ops by device time, {steps} steps\n{table}")
    top.append(
        f"== {impl}: top host ops by self time\n"
        + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    )

    syncing = 0
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i in range(warmup + 2 * steps, warmup + 3 * steps):
                    compiles.step = i
                    step(i)
                _sync(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncing = sum("synchroniz" in str(w.message) for w in caught)
    total = warmup + 3 * steps
    counts = [compiles.by_step.get(i, 0) for i in range(total)]
    return Row(
        impl,
        ms,
        busy_us / 1e3 / steps,
        kernels / steps,
        syncs / steps,
        syncing / steps,
        copies / steps,
        sum(counts[2:]),
        " ".join(map(str, counts)),
    )


def try_graph(step: Callable[[int], None], at: int, device: torch.device, reps: int = 10) -> str:
    """Whether ``step`` (warm) captures into a CUDA graph, and the replay's time per step
    against the eager step's; a sentence either way. Run last: a refused capture can poison
    the CUDA context."""
    if device.type != "cuda":
        return "not tried (no CUDA device)"
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # as torch's docs ask: warm on a side stream first
        step(at)
    torch.cuda.current_stream(device).wait_stream(side)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(reps):
        step(at + 1 + i)
    _sync(device)
    eager_ms = (time.perf_counter() - t0) * 1e3 / reps
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step(at + 1 + reps)
    except Exception as e:  # the refusal is the finding
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"not captured ({type(e).__name__}: {first[:200]})"
    graph.replay()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    _sync(device)
    replay_ms = (time.perf_counter() - t0) * 1e3 / reps
    return f"captured: replay {replay_ms:.3f} ms/step against {eager_ms:.3f} eager"


def run(cfg_name: str, device: torch.device, steps: int, warmup: int) -> tuple[list[Row], str, str]:
    cfg = SIZES[cfg_name]
    total = warmup + 3 * steps
    cfg = type(cfg)(cfg.tables, cfg.rows, cfg.dim, cfg.batch, cfg.pooling, total, warmup)
    gen = torch.Generator().manual_seed(1)
    bound = (1.0 / cfg.rows) ** 0.5
    weights = [
        (torch.rand(cfg.rows, cfg.dim, generator=gen) * 2 - 1) * bound for _ in range(cfg.tables)
    ]
    batches = make_batches(cfg, device)
    rows: list[Row] = []
    top: list[str] = []

    _, base_step = torch_step(weights, batches, device)

    whole_table = None
    with CompileCounter() as compiles:
        rows.append(measure("torch_sparse", base_step, steps, warmup, device, compiles, top))
        for fraction in (1.0, 0.1):
            _, step = cached_step(cfg, fraction, batches, device)
            if fraction == 1.0:
                whole_table = step
            compiles.by_step.clear()
            impl = f"embcache_{round(fraction * 100)}"
            rows.append(measure(impl, step, steps, warmup, device, compiles, top))
            first = [name for s, name in compiles.names if s >= 2]
            if first:
                top.append(f"== {impl}: compiles after step 2:\n" + "\n".join(first[:20]))
            compiles.names.clear()
    assert whole_table is not None
    graph = try_graph(whole_table, total, device)
    return rows, "\n\n".join(top), graph


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="8 x 200k rows (bench_gpu_step's)")
    size.add_argument("--tiny", action="store_true", help="toy sizes (the Triton interpreter)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per measurement")
    parser.add_argument("--warmup", type=int, default=None, help="steps before measuring")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1)")
    add_output_options(parser, "gpu_profile.csv")
    args = parse_args(parser, argv)
    set_threads(args.threads)
    device = pick_device(args.device)
    name = "tiny" if args.tiny else "quick" if args.quick else "full"
    steps = args.steps or (2 if args.tiny else 5)
    warmup = args.warmup or (1 if args.tiny else 8)
    header = run_header(device)
    print(header)
    print(f"# {SIZES[name]}; {warmup} warm-up steps, then {steps} steps per measurement")
    rows, top, graph = run(name, device, steps, warmup)
    cols = ("ms/step", "busy ms", "kernels", "syncs", "sync ops", "memcpy", "compiles>2")
    print(f"{'impl':<14}" + "".join(f"{c:>11}" for c in cols))
    for r in rows:
        print(
            f"{r.impl:<14}{r.ms_per_step:11.3f}{r.gpu_busy_ms:11.3f}{r.kernels_per_step:11.1f}"
            f"{r.syncs_per_step:11.1f}{r.syncing_ops_per_step:11.1f}{r.memcpy_per_step:11.1f}"
            f"{r.compiles_after_warmup:11d}"
        )
    for r in rows:
        print(
            f"summary: {r.impl} {r.ms_per_step:.2f} ms/step, device busy {r.gpu_busy_ms:.2f} ms, "
            f"{r.kernels_per_step:.0f} kernels, {r.syncs_per_step:.0f} syncs, "
            f"{r.compiles_after_warmup} compiles after step 2"
        )
    print(f"summary: CUDA graph of the embcache_100 step: {graph}")
    write_csv(rows, args.out)
    top_path = args.out.with_name("gpu_profile_top.txt")
    top_path.write_text(header + "\n" + top + "\n")
    print(top)
    print(f"wrote {args.out} and {top_path}")


if __name__ == "__main__":
    main()
