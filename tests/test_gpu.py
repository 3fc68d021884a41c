"""The device path against the CPU path, step by step (marked ``gpu``; skipped, with the reason,
without a GPU).

`benchmarks/gpu_check.sh` runs this file by path on a machine with a GPU. Each training test
runs the same batches through two collections in lockstep: the device run (the Triton kernels
on CUDA: ids, pooling, cache index, optimizer rows) and the CPU path (the torch twins), and
compares at every step the pooled outputs, the gradient rows of the trace and, after the
optimizer step, the touched rows with their optimizer state. The loss is not linear in the
output, so a wrong forward also changes the gradients. Between them the cases cover SUM, MEAN
and MAX, with and without per-sample weights, dims 8, 64 and 300 (two column blocks), two
tables sharing a cache, LRU and LFU, a cache smaller than one batch's working set (evictions,
write-backs, scratch rows), the whole table cached, all four optimizers and
``update_in_backward``. Then the prefetch pipeline on the device against the CPU path, the host
synchronisations of a step for 2 and for 26 tables, `DistEmbedding` with device ids, and a
sequence collection (`CachedEmbeddingCollection`: the gather and its backward).
Nothing here imports torchrec (the GPU image has none): inputs are `embcache.JaggedBatch`;
the one test of torchrec's DMP on a GPU imports it inside and is skipped where it is missing.

Two switches let the check's dry run walk this file on a machine without a GPU:

* ``EMBCACHE_TEST_DEVICE=cpu``: the device runs use CPU tensors with the Triton backend forced
  (through Triton's interpreter), the reference runs the torch twins, as on a GPU machine.
* ``EMBCACHE_GPU_TEST_TINY=1``: a few small batches instead of the realistic ones, so the
  interpreter gets through in seconds.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import embcache
from embcache.kernels.backend import use_triton
from embcache.train.pipeline import TrainPipeline

pytestmark = pytest.mark.gpu

DEVICE = torch.device(os.environ.get("EMBCACHE_TEST_DEVICE", "cuda"))
TINY = os.environ.get("EMBCACHE_GPU_TEST_TINY", "0") == "1"
BATCH, STEPS = (4, 3) if TINY else (128, 5)
LONG_BAG = 70  # sample 0's bag of every feature: more than one BLOCK_N of the pooling kernels
CPU = torch.device("cpu")
# The run under test: Triton on DEVICE (auto picks it on CUDA; forced on the CPU stand-in).
DEVICE_BACKEND = "auto" if DEVICE.type == "cuda" else "triton"

# (atol, rtol) of the device run against the CPU path. Each step starts both from the same rows
# (see `Side.restart_from`), so what differs is float32 rounding within one step: the backends
# sum a bag's rows and an id's gradient contributions in different orders (an id's gradient
# sums up to a few hundred positive terms, hence the wider rtol), and on a GPU Triton's sqrt and
# division may round an ulp or two away from torch's. A wrong kernel misses by orders more.
TOLERANCES = {"pooled": (1e-6, 1e-5), "grads": (1e-5, 2e-5), "rows": (1e-6, 2e-5)}
# The pipeline runs its own loop, so nothing restarts it: rounding differences compound over
# its steps (its tables pool SUM and MEAN only, where that stays rounding).
PIPELINE_TOLERANCE = (1e-5, 1e-4)


def table(
    name: str, dim: int, rows: int, pooling: str, features: list[str]
) -> embcache.TableConfig:
    return embcache.TableConfig(
        name=name, embedding_dim=dim, num_embeddings=rows, feature_names=features, pooling=pooling
    )


# Between the two layouts every pooling mode runs with and without weights, at dims 8 and 64
# (one column block) and 300 (two: MAX unweighted, MEAN weighted); t8 and t8b share the dim-8
# cache with two pooling modes.
LAYOUTS = {
    "unweighted": [
        table("t8", 8, 3000, "sum", ["f0", "f1"]),
        table("t8b", 8, 500, "max", ["f2"]),
        table("t64", 64, 2000, "mean", ["f3"]),
        table("t300", 300, 1000, "max", ["f4"]),
    ],
    "weighted": [
        table("t8", 8, 3000, "max", ["f0", "f1"]),
        table("t8b", 8, 500, "sum", ["f2"]),
        table("t64", 64, 2000, "sum", ["f3"]),
        table("t300", 300, 1000, "mean", ["f4"]),
    ],
}
# Weight decay and lr decay take the kernels' other branches.
OPTIMIZERS = {
    "sgd": lambda m: embcache.SparseSGD([m], lr=0.05, weight_decay=0.01),
    "adagrad": lambda m: embcache.SparseAdaGrad([m], lr=0.05, lr_decay=0.01, weight_decay=0.01),
    "rowwise_adagrad": lambda m: embcache.SparseRowWiseAdaGrad([m], lr=0.05),
    "adam": lambda m: embcache.SparseAdam([m], lr=0.01),
}
SMALL_CAPACITY, SMALL_WAYS = (4, 2) if TINY else (64, 8)


@dataclass(frozen=True)
class Case:
    """One training comparison: tables, cache, optimizer, and how the device run applies it."""

    layout: str
    policy: str
    cache: str  # "small": fewer rows than one batch's unique ids; "whole": every row cached
    optimizer: str
    update_in_backward: bool = False  # the device run only; the CPU path traces and steps

    def cache_config(self) -> embcache.CacheConfig:
        if self.cache == "whole":
            return embcache.CacheConfig(load_factor=1.0, policy=self.policy)
        return embcache.CacheConfig(capacity=SMALL_CAPACITY, ways=SMALL_WAYS, policy=self.policy)


# Each optimizer once; between them both layouts, LRU and LFU, small and whole caches, and
# trace + step as well as update_in_backward, each with and without weights.
CASES = {
    "adam-lfu-small": Case("unweighted", "lfu", "small", "adam"),
    "rowwise-lru-whole-weighted": Case("weighted", "lru", "whole", "rowwise_adagrad"),
    "sgd-lru-small-in-backward": Case("unweighted", "lru", "small", "sgd", update_in_backward=True),
    "adagrad-lfu-small-weighted-in-backward": Case(
        "weighted", "lfu", "small", "adagrad", update_in_backward=True
    ),
}


@contextmanager
def on_backend(name: str) -> Iterator[None]:
    """``EMBCACHE_BACKEND=name`` inside the block (read by every kernel call)."""
    old = os.environ.get("EMBCACHE_BACKEND")
    os.environ["EMBCACHE_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["EMBCACHE_BACKEND"]
        else:
            os.environ["EMBCACHE_BACKEND"] = old


def device_run() -> AbstractContextManager[None]:
    """The run under test: Triton on ``DEVICE``."""
    return on_backend(DEVICE_BACKEND)


def loss_of(out: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """Not linear in ``out``: a wrong pooled value changes every gradient of its bag. The
    gradient ``coeff + tanh(out) / cosh(out)**2`` stays in [0.6, 2.4] (``coeff`` in [1, 2]), so
    no gradient sits near zero, where AdaGrad's and Adam's first steps (``g / |g|``) would turn
    a rounding difference into a step of ``lr``."""
    return (out * coeff).sum() + 0.5 * torch.tanh(out).square().sum()


def make_batches(
    tables: list[embcache.TableConfig], weighted: bool, n: int, seed: int = 0
) -> list[tuple[embcache.JaggedBatch, torch.Tensor]]:
    """``n`` batches of ``BATCH`` samples over every feature of ``tables``, with the loss's
    coefficients: Zipf-like ids (duplicates in and across bags), each table's last row, an
    empty bag and a long bag of hot ids per feature; weights in [0.5, 1.5]."""
    gen = torch.Generator().manual_seed(seed)
    keys = [f for t in tables for f in t.feature_names]
    rows_of = [t.num_embeddings for t in tables for _ in t.feature_names]
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 5, (len(keys), BATCH), generator=gen)
        lengths[:, 0] = LONG_BAG
        lengths[:, 1] = 0
        values = []
        for f, rows in enumerate(rows_of):
            u = torch.rand(int(lengths[f].sum()), generator=gen)
            ids = (u.pow(2) * rows).long().clamp(max=rows - 1)
            # The long bag: the hottest ids many times over, and the table's last row.
            ids[: LONG_BAG - 1] = ids[: LONG_BAG - 1] % (3 if TINY else 50)
            ids[LONG_BAG - 1] = rows - 1
            values.append(ids)
        values = torch.cat(values)
        weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
        batch = embcache.JaggedBatch.from_lengths(keys, values, lengths.reshape(-1), weights)
        out.append((batch, torch.rand(BATCH, width, generator=gen) + 1.0))
    return out


def touched_ids(
    batch: embcache.JaggedBatch, tables: list[embcache.TableConfig]
) -> dict[str, torch.Tensor]:
    """The distinct ids of each table in ``batch`` (host tensors)."""
    return {
        t.name: torch.unique(torch.cat([batch[f].values() for f in t.feature_names]))
        for t in tables
    }


def assert_close(kind: str, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    atol, rtol = TOLERANCES[kind]
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    assert not actual.isnan().any(), f"{what}: NaN on the device"
    torch.testing.assert_close(
        actual.cpu(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


class Side:
    """One side of a comparison: a collection and its optimizer on ``device``, whose kernels
    run on ``backend``."""

    def __init__(
        self, case: Case, device: torch.device, backend: str, update_in_backward: bool = False
    ) -> None:
        self.device = device
        self.backend = backend
        self.tables = LAYOUTS[case.layout]
        self.ebc = embcache.CachedEmbeddingBagCollection(
            tables=self.tables,
            is_weighted=case.layout == "weighted",
            cache=case.cache_config(),
            device=device,
            update_in_backward=update_in_backward,
            seed=0,  # the same initial rows on both sides
        )
        self.opt = OPTIMIZERS[case.optimizer](self.ebc)

    def forward(self, batch: embcache.JaggedBatch) -> torch.Tensor:
        with on_backend(self.backend):
            return self.ebc(batch.to(self.device)).values()

    def backward(self, out: torch.Tensor, coeff: torch.Tensor) -> None:
        with on_backend(self.backend):
            loss_of(out, coeff.to(self.device)).backward()

    def step(self) -> None:
        with on_backend(self.backend):
            self.opt.step()

    def gradients(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The trace: ids and gradient rows per table, on the host."""
        return {name: (ids.cpu(), grads.cpu()) for name, ids, grads in self.ebc.sparse_gradients()}

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Current rows ``[n, dim + state]`` of ``ids`` wherever they live (cache slot, scratch
        or tier), on the host; reads change nothing in the cache."""
        engine = self.ebc.engines.engine_of(name)
        index = next(t.index for t in self.ebc.tables if t.name == name)
        fused = ids | (index << engine.fusion_k)
        with on_backend(self.backend):
            return engine.cache.read(fused.to(self.device)).cpu()

    def restart_from(self, name: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Set the rows (weights and state) of ``ids``, so that the next step starts from the
        other side's rows: float32 rounding then never compounds across steps, where one ulp
        could decide a MAX bag between two nearly equal rows and route a whole gradient to
        the other row."""
        table_rows = self.ebc.table_rows(name)
        table_rows[ids] = rows
        self.ebc.write_table_rows(name, table_rows, slice(None))


def test_auto_backend_runs_triton_on_cuda() -> None:
    if DEVICE.type != "cuda":
        pytest.skip(f"EMBCACHE_TEST_DEVICE={DEVICE.type}: auto picks the twins off CUDA")
    with on_backend("auto"):
        assert use_triton(torch.empty(1, device="cuda"))
        assert not use_triton(torch.empty(1))


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_training_matches_the_cpu_path_at_every_step(case: Case) -> None:
    """Outputs, gradient rows and updated rows with their state agree with the CPU path at
    every step; after a flush the device's tier holds exactly the rows it served."""
    dev = Side(case, DEVICE, DEVICE_BACKEND, update_in_backward=case.update_in_backward)
    ref = Side(case, CPU, "torch")
    batches = make_batches(dev.tables, case.layout == "weighted", STEPS)
    for step, (batch, coeff) in enumerate(batches, start=1):
        out, expected = dev.forward(batch), ref.forward(batch)
        assert_close("pooled", out, expected, f"step {step}: pooled output")
        dev.backward(out, coeff)
        ref.backward(expected, coeff)
        if not case.update_in_backward:
            got, want = dev.gradients(), ref.gradients()
            assert got.keys() == want.keys()
            for name, (ids, grads) in want.items():
                assert torch.equal(got[name][0], ids), f"step {step}: {name} gradient ids"
                assert_close("grads", got[name][1], grads, f"step {step}: {name} gradients")
        dev.step()
        ref.step()
        for name, ids in touched_ids(batch, dev.tables).items():
            rows = dev.rows(name, ids)
            assert_close("rows", rows, ref.rows(name, ids), f"step {step}: {name} rows + state")
            ref.restart_from(name, ids, rows)

    stats = dev.ebc.cache_stats()  # before the flushes below, which write back too
    for t in dev.tables:  # I3 on the device: every dirty row written back, none other changed
        assert torch.equal(dev.ebc.table_rows(t.name), ref.ebc.table_rows(t.name)), t.name
    caches = dev.ebc.caches()
    if case.cache == "whole":
        assert all(c.direct for c in caches)
        return
    # The paths a small cache must take: the first batch alone overflows every cache, and
    # dirty rows leave the device (a replaced slot, a freed scratch row) before any flush.
    dims = {t.name: t.embedding_dim for t in dev.tables}
    first = touched_ids(batches[0][0], dev.tables)
    for cache in caches:
        unique = sum(ids.numel() for name, ids in first.items() if dims[name] == cache.dim)
        assert cache.num_slots < unique, f"dim {cache.dim}: {cache.num_slots} >= {unique}"
        assert cache.scratch_rows > 0, f"dim {cache.dim}: the scratch area was never used"
    assert stats["evictions"] > 0 and stats["writebacks"] > 0, stats


PIPELINE_TABLES = [
    table("p8", 8, 3000, "sum", ["f0", "f1"]),
    table("p300", 300, 1000, "mean", ["f2"]),
]


def pipeline_run(device: torch.device, backend: str, prefetch: bool, side_stream: bool = False):
    """Train through `TrainPipeline`; returns the losses, the touched rows after each step and
    the whole tables at the end. ``side_stream``: train under a stream of the caller's own
    (CUDA), as a user overlapping other work does; the prefetch worker must order its work
    with that stream, not with the default one."""
    torch.manual_seed(0)
    sparse = embcache.CachedEmbeddingBagCollection(
        tables=PIPELINE_TABLES,
        cache=embcache.CacheConfig(capacity=SMALL_CAPACITY, ways=SMALL_WAYS),
        device=device,
        seed=0,  # the same initial rows on every run
    )
    width = sum(t.embedding_dim * len(t.feature_names) for t in PIPELINE_TABLES)
    model = nn.ModuleDict({"sparse": sparse, "head": nn.Linear(width, 1).to(device)})
    sparse_opt = embcache.SparseRowWiseAdaGrad([sparse], lr=0.05)
    dense_opt = torch.optim.SGD(model["head"].parameters(), lr=0.05)
    batches = make_batches(PIPELINE_TABLES, False, STEPS + 2, seed=1)
    data = [(b.to(device), c.to(device)) for b, c in batches]
    rows_per_step = []

    def after_step(step: int, loss: torch.Tensor) -> None:
        del loss
        batch = batches[step - 1][0]
        for name, ids in touched_ids(batch, PIPELINE_TABLES).items():
            engine = sparse.engines.engine_of(name)
            index = next(t.index for t in sparse.tables if t.name == name)
            fused = (ids | (index << engine.fusion_k)).to(device)
            rows_per_step.append((f"step {step}: {name}", engine.cache.read(fused).cpu()))

    pipe = TrainPipeline(
        model,
        sparse_opt,
        dense_opt,
        features=lambda b: b[0],
        loss=lambda m, b: m["head"](m["sparse"](b[0]).values()).square().mean(),
        prefetch=prefetch,
    )
    stream = torch.cuda.Stream(device) if side_stream else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))  # the batches' copies
    with on_backend(backend), torch.cuda.stream(stream) if stream else nullcontext():
        losses = pipe.run(data, on_step=after_step)
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)
    tables = {t.name: sparse.table_rows(t.name) for t in PIPELINE_TABLES}
    return losses, rows_per_step, tables


@pytest.mark.parametrize("side_stream", [False, True], ids=["default_stream", "caller_stream"])
def test_prefetch_pipeline_matches_the_cpu_path(side_stream: bool) -> None:
    """On the device, prefetch (a worker thread on the caller's stream) is bit-identical to the same
    pipeline without it (I5), and both follow the CPU path step by step; also when the
    training runs under a stream of its own (the worker orders its work after that stream's,
    and that stream waits for the worker's before using the slots)."""
    if side_stream and DEVICE.type != "cuda":
        pytest.skip("EMBCACHE_TEST_DEVICE=cpu: the CPU has no streams to order")
    # Off CUDA the twins: Triton's interpreter keeps the launch grid in process-wide state,
    # so the prefetch thread's kernels and the training thread's would corrupt each other.
    backend = "auto" if DEVICE.type == "cuda" else "torch"
    prefetched = pipeline_run(DEVICE, backend, prefetch=True, side_stream=side_stream)
    synchronous = pipeline_run(DEVICE, backend, prefetch=False)
    reference = pipeline_run(CPU, "torch", prefetch=False)

    assert prefetched[0] == synchronous[0], "prefetch changed the losses"
    for (what, rows), (_, same) in zip(prefetched[1], synchronous[1], strict=True):
        assert torch.equal(rows, same), f"{what}: prefetch changed the rows"
    for name, rows in synchronous[2].items():
        assert torch.equal(prefetched[2][name], rows), f"{name}: prefetch changed the table"

    atol, rtol = PIPELINE_TOLERANCE
    torch.testing.assert_close(prefetched[0], reference[0], atol=atol, rtol=rtol)
    for (what, rows), (_, expected) in zip(prefetched[1], reference[1], strict=True):
        torch.testing.assert_close(
            rows, expected, atol=atol, rtol=rtol, msg=lambda m, what=what: f"{what}: {m}"
        )
    for name, rows in reference[2].items():
        torch.testing.assert_close(prefetched[2][name], rows, atol=atol, rtol=rtol)


@contextmanager
def sync_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Record a warning for each synchronising CUDA call made inside the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def syncs(caught: list[warnings.WarningMessage]) -> int:
    return sum("synchroniz" in str(w.message) for w in caught)


def count_syncs(num_tables: int) -> dict[str, int]:
    """Synchronising CUDA calls in the forward, backward and step of one batch with a 10% LRU
    cache after warm-up (hits, misses, dirty victims, scratch rows)."""
    tables = [table(f"t{i}", 16, 1000, "sum", [f"f{i}"]) for i in range(num_tables)]
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=tables, cache=embcache.CacheConfig(load_factor=0.1, ways=4), device=DEVICE
    )
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    gen = torch.Generator().manual_seed(0)
    keys = [f"f{i}" for i in range(num_tables)]
    batches = []
    for _ in range(5):
        lengths = torch.randint(1, 5, (num_tables * 64,), generator=gen)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
        batches.append(embcache.JaggedBatch.from_lengths(keys, values, lengths).to(DEVICE))
    *warm, batch = batches
    for b in warm:
        ebc(b).values().square().sum().backward()
        opt.step()
    torch.cuda.synchronize()
    with sync_warnings() as forward:
        out = ebc(batch).values()
    with sync_warnings() as backward:
        out.square().sum().backward()
    with sync_warnings() as step:
        opt.step()
    return {"forward": syncs(forward), "backward": syncs(backward), "step": syncs(step)}


def test_host_syncs_do_not_grow_with_tables() -> None:
    """On CUDA, the synchronising calls of a step are the same for 2 tables as for 26."""
    if DEVICE.type != "cuda":
        pytest.skip(
            "EMBCACHE_TEST_DEVICE=cpu: the CPU has no host synchronisations to count "
            "(tests/engine/test_sync_count.py counts the ops that would sync, on the CPU)"
        )
    with sync_warnings() as caught:  # the counter is not blind
        torch.ones(1, device=DEVICE).item()
    # torch 2.11 warns twice for one .item() (the copy and the stream's sync), older torch once:
    # the counts below are in warnings, compared with each other.
    per_item = syncs(caught)
    assert per_item >= 1
    two, many = count_syncs(2), count_syncs(26)
    print(f"sync warnings per phase (one .item() = {per_item}): 2 tables {two}; 26 tables {many}")
    assert two == many, f"2 tables: {two}; 26 tables: {many}"


def test_dist_embedding_with_cuda_ids_matches_the_cpu_path() -> None:
    """`DistEmbedding` with ids on the device: rows come back there, the backward sums the
    gradients there (the Triton segment sum), and SGD leaves the tier as the CPU run does."""
    gen = torch.Generator().manual_seed(1)
    steps = [
        (torch.randint(0, 50, (6 if TINY else 4096,), generator=gen).pow(2) % 50)
        for _ in range(STEPS)
    ]
    coeffs = [torch.randn(ids.numel(), 4, generator=gen) for ids in steps]
    results = []
    for device, backend in ((DEVICE, None), (CPU, "torch")):
        embcache.reset_kv_client()
        emb = embcache.DistEmbedding(50, 4, name="gpu_dist", lr=0.1)
        opt = embcache.SparseSGD([emb])
        with device_run() if backend is None else on_backend(backend):
            for ids, coeff in zip(steps, coeffs, strict=True):
                out = emb(ids.to(device))
                assert out.device.type == device.type
                (out * coeff.to(device)).square().sum().backward()
                opt.step()
        results.append(emb.weight[torch.arange(50)])
    embcache.reset_kv_client()
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


SEQUENCE_TABLES = [
    embcache.TableConfig(name="s8", embedding_dim=8, num_embeddings=3000,
                         feature_names=["f0", "f1"], pooling="none"),
    embcache.TableConfig(name="s300", embedding_dim=300, num_embeddings=500,
                         feature_names=["f2"], pooling="none"),
]  # fmt: skip


def test_sequence_training_matches_the_cpu_path() -> None:
    """`CachedEmbeddingCollection` on the device (the Triton gather and its segment-sum
    backward, dims 8 and 300) against the CPU path: the rows of every value at every step, and
    the tables after AdaGrad with a cache smaller than one batch's ids."""
    batches = make_batches(SEQUENCE_TABLES, False, STEPS, seed=3)
    sides = []
    for device, backend in ((DEVICE, DEVICE_BACKEND), (CPU, "torch")):
        cache = embcache.CacheConfig(capacity=SMALL_CAPACITY, ways=SMALL_WAYS)
        ec = embcache.CachedEmbeddingCollection(SEQUENCE_TABLES, device=device, cache=cache, seed=0)
        sides.append((ec, embcache.SparseAdaGrad([ec], lr=0.05), device, backend))
    for step, (batch, _) in enumerate(batches):
        outs = []
        for ec, opt, device, backend in sides:
            with on_backend(backend):
                out = ec(batch.to(device))
                loss = torch.zeros((), device=device)
                for jt in out.values():
                    v = jt.values()
                    assert v.device.type == device.type
                    coeff = 1 + torch.arange(v.numel(), device=device).reshape(v.shape) % 5 / 5
                    loss = loss + loss_of(v, coeff)
                loss.backward()
                opt.step()
            outs.append({k: jt.values().detach().cpu() for k, jt in out.items()})
        for key, expected in outs[1].items():
            assert_close("pooled", outs[0][key], expected, f"step {step}: {key}")
    for t in SEQUENCE_TABLES:
        found = []
        for ec, _, _, backend in sides:
            with on_backend(backend):
                found.append(ec.table_rows(t.name))
        atol, rtol = PIPELINE_TOLERANCE  # several steps: rounding compounds
        torch.testing.assert_close(found[0], found[1], atol=atol, rtol=rtol, msg=t.name)


DMP_TABLES = [
    embcache.TableConfig(name="d0", embedding_dim=8, num_embeddings=300,
                         feature_names=["f0", "f1"], pooling="sum"),
    embcache.TableConfig(name="d1", embedding_dim=12, num_embeddings=200,
                         feature_names=["f2"], pooling="mean"),
]  # fmt: skip


class DMPModel(nn.Module):
    """The collection DMP shards (its forward takes a torchrec KeyedJaggedTensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = embcache.CachedEmbeddingBagCollection(DMP_TABLES)

    def forward(self, kjt: object) -> torch.Tensor:
        return self.ebc(kjt).values()


def test_torchrec_dmp_on_one_gpu_matches_one_process() -> None:
    """torchrec's DMP over a `CachedEmbeddingBagCollection` on one GPU (world size 1, NCCL),
    planned by torchrec's own planner (``fused_uvm_caching``, half of each table cached by the
    plan's ``cache_params``): three AdaGrad steps give the outputs and tables of one
    `CachedEmbeddingBagCollection` on the same device, started from the rows DMP drew. Needs
    torchrec and fbgemm_gpu, which the GPU image lacks (skipped there)."""
    if DEVICE.type != "cuda":
        pytest.skip("EMBCACHE_TEST_DEVICE=cpu: NCCL runs on CUDA only")
    pytest.importorskip("torchrec", reason="torchrec is not installed (the GPU image has none)")
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams, ShardingEnv

    from embcache.torchrec import CachedEmbeddingBagCollectionSharder

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    lr, eps = 0.1, 1e-8
    device = torch.device("cuda", DEVICE.index or 0)  # NCCL and DMP want an indexed device
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        model = DMPModel()
        sharder = CachedEmbeddingBagCollectionSharder(
            {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": lr, "eps": eps}
        )
        constraints = {
            t.name: ParameterConstraints(
                sharding_types=["table_wise"], cache_params=CacheParams(load_factor=0.5)
            )
            for t in DMP_TABLES
        }
        planner = EmbeddingShardingPlanner(
            Topology(world_size=1, compute_device="cuda"), constraints=constraints
        )
        plan = planner.collective_plan(model, [sharder], pg)
        kernels = {p.compute_kernel for p in plan.get_plan_for_module("ebc").values()}
        assert kernels == {"fused_uvm_caching"}
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(pg),
            device=device,
            sharders=[sharder],
            plan=plan,
        )

        def tables(state: dict, prefix: str) -> dict[str, torch.Tensor]:
            out = {}
            for t in DMP_TABLES:
                value = state[f"{prefix}embedding_bags.{t.name}.weight"]
                if isinstance(value, ShardedTensor):  # world size 1: one shard, the table
                    (shard,) = value.local_shards()
                    value = shard.tensor
                out[t.name] = value.detach().cpu().clone()
            return out

        initial = tables(dmp.state_dict(), "ebc.")
        ref = embcache.CachedEmbeddingBagCollection(
            DMP_TABLES,
            device=device,
            optimizer_type=torch.optim.Adagrad,
            optimizer_kwargs={"lr": lr, "eps": eps},
        )
        ref.load_state_dict({f"embedding_bags.{n}.weight": w for n, w in initial.items()})
        gen = torch.Generator().manual_seed(5)
        rows = {"f0": 300, "f1": 300, "f2": 200}
        for step in range(3):
            lengths, values = [], []
            for n in rows.values():  # an empty bag, duplicate ids, the table's last row
                length = torch.randint(1, 6, (8,), generator=gen)
                length[0] = 0
                ids = torch.randint(0, n, (int(length.sum()),), generator=gen)
                ids[1], ids[2] = ids[0], n - 1
                lengths.append(length)
                values.append(ids)
            kjt = KeyedJaggedTensor(
                keys=list(rows), values=torch.cat(values), lengths=torch.cat(lengths)
            ).to(device)
            outs = []
            for out in (dmp(kjt), ref(kjt).values()):
                assert out.device.type == "cuda"
                ((out * out).sum() + out[:, ::3].sum()).backward()
                outs.append(out.detach().cpu())
            dmp.fused_optimizer.step()
            # the same kernels on both sides: what differs is the order of float32 sums
            torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5, msg=f"step {step}")
        ref.flush()
        got, want = tables(dmp.state_dict(), "ebc."), tables(ref.state_dict(), "")
        for name in got:
            assert not torch.equal(got[name], initial[name]), f"{name}: nothing trained"
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()
