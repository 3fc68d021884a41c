"""End-to-end checks on a CUDA device (marked ``gpu``; skipped, with the reason, without one).

`benchmarks/gpu_check.sh` runs this file by path on a machine with a GPU: the whole training
path on the Triton kernels (ids, pooling, cache index, optimizer rows) against the same run on
the CPU path, the prefetch pipeline's side stream, and `DistEmbedding` with CUDA ids. Nothing
here imports torchrec (the GPU image has none): inputs are `embcache.JaggedBatch`.

Two switches let the check's dry run walk this file on a machine without a GPU:

* ``EMBCACHE_TEST_DEVICE=cpu``: the device runs use CPU tensors with the Triton backend forced
  (through Triton's interpreter), the reference runs the torch twins, as on a GPU machine.
* ``EMBCACHE_GPU_TEST_TINY=1``: a few small batches instead of the realistic ones, so the
  interpreter gets through in seconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
from torch import nn

import embcache
from embcache.kernels.backend import use_triton
from embcache.train.pipeline import TrainPipeline

pytestmark = pytest.mark.gpu

DEVICE = torch.device(os.environ.get("EMBCACHE_TEST_DEVICE", "cuda"))
TINY = os.environ.get("EMBCACHE_GPU_TEST_TINY", "0") == "1"
BATCH, STEPS, PIPELINE_STEPS = (4, 2, 3) if TINY else (256, 6, 8)

TABLES = [
    embcache.TableConfig(name="t0", embedding_dim=16, num_embeddings=5000, feature_names=["f0"]),
    embcache.TableConfig(name="t1", embedding_dim=16, num_embeddings=3000, feature_names=["f1"]),
    embcache.TableConfig(name="t2", embedding_dim=8, num_embeddings=2000, feature_names=["f2"]),
]
OPTIMIZERS = {
    "sgd": lambda m: embcache.SparseSGD([m], lr=0.1),
    "adagrad": lambda m: embcache.SparseAdaGrad([m], lr=0.1),
    "rowwise_adagrad": lambda m: embcache.SparseRowWiseAdaGrad([m], lr=0.1),
    "adam": lambda m: embcache.SparseAdam([m], lr=0.01),
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
    """The run under test: Triton on ``DEVICE`` (auto picks it on CUDA; forced on CPU)."""
    return on_backend("auto" if DEVICE.type == "cuda" else "triton")


def batches(n: int, batch: int = BATCH) -> list[tuple[embcache.JaggedBatch, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 5, (3 * batch,), generator=gen)
        limit = torch.tensor([5000, 3000, 2000]).repeat_interleave(batch)
        limit = limit.repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen).pow(2) * limit).long()
        jb = embcache.JaggedBatch.from_lengths(["f0", "f1", "f2"], values, lengths)
        out.append((jb, torch.randn(batch, 40, generator=gen)))
    return out


def train(device: torch.device, rule: str, load_factor: float) -> dict[str, torch.Tensor]:
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=TABLES,
        cache=embcache.CacheConfig(load_factor=load_factor, ways=8),
        device=device,
        seed=0,  # the same initial rows on both devices
    )
    opt = OPTIMIZERS[rule](ebc)
    for jb, coeff in batches(STEPS):
        out = ebc(jb.to(device)).values()
        (out * coeff.to(device)).sum().backward()
        opt.step()
    return {t.name: ebc.table_rows(t.name) for t in ebc.tables}


def test_auto_backend_runs_triton_on_cuda() -> None:
    if DEVICE.type != "cuda":
        pytest.skip(f"EMBCACHE_TEST_DEVICE={DEVICE.type}: auto picks the twins off CUDA")
    with on_backend("auto"):
        assert use_triton(torch.empty(1, device="cuda"))
        assert not use_triton(torch.empty(1))


@pytest.mark.parametrize("load_factor", [0.05, 1.0], ids=["5pct", "whole"])
@pytest.mark.parametrize("rule", list(OPTIMIZERS))
def test_cuda_training_matches_the_cpu_path(rule: str, load_factor: float) -> None:
    """The Triton path (GPU) and the torch twins (CPU) train the same rows and state, to
    float32 reduction-order rounding."""
    with device_run():
        on_device = train(DEVICE, rule, load_factor)
    with on_backend("torch"):
        on_cpu = train(torch.device("cpu"), rule, load_factor)
    for name, rows in on_cpu.items():
        torch.testing.assert_close(on_device[name], rows, rtol=1e-4, atol=1e-5, msg=name)


def test_cuda_pipeline_is_bit_identical_to_no_prefetch() -> None:
    """Prefetch copies rows on a side stream: the results must not move by a bit."""
    results = []
    for prefetch in (False, True):
        torch.manual_seed(0)
        model = nn.ModuleDict(
            {
                "sparse": embcache.CachedEmbeddingBagCollection(
                    tables=TABLES,
                    cache=embcache.CacheConfig(load_factor=0.05, ways=8),
                    device=DEVICE,
                ),
                "head": nn.Linear(40, 1).to(DEVICE),
            }
        )
        sparse = embcache.SparseAdaGrad([model["sparse"]], lr=0.1)
        dense = torch.optim.SGD(model["head"].parameters(), lr=0.05)
        data = [(jb.to(DEVICE), c.to(DEVICE)) for jb, c in batches(PIPELINE_STEPS)]
        pipe = TrainPipeline(
            model,
            sparse,
            dense,
            features=lambda b: b[0],
            loss=lambda m, b: m["head"](m["sparse"](b[0]).values()).square().mean(),
            prefetch=prefetch,
        )
        # Off CUDA the twins: Triton's interpreter keeps the launch grid in process-wide state,
        # so the prefetch thread's kernels and the training thread's would corrupt each other.
        with device_run() if DEVICE.type == "cuda" else on_backend("torch"):
            losses = pipe.run(data)
        rows = {t.name: model["sparse"].table_rows(t.name) for t in model["sparse"].tables}
        results.append((losses, rows))
    assert results[0][0] == results[1][0]
    for name, rows in results[0][1].items():
        assert torch.equal(results[1][1][name], rows), name


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
    for device, backend in ((DEVICE, None), (torch.device("cpu"), "torch")):
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
