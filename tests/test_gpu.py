"""End-to-end checks on a CUDA device (marked ``gpu``; skipped, with the reason, without one).

`benchmarks/gpu_check.sh` runs these with ``pytest -m gpu`` on a machine with a GPU: the whole
training path on the Triton kernels (ids, pooling, cache index, optimizer rows), against the
same run on the CPU path, and the prefetch pipeline's side stream.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import embcache
from embcache.kernels.backend import use_triton
from embcache.train.pipeline import TrainPipeline

pytestmark = pytest.mark.gpu

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=5000, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=3000, feature_names=["f1"]),
    EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=2000, feature_names=["f2"]),
]
OPTIMIZERS = {
    "sgd": lambda m: embcache.SparseSGD([m], lr=0.1),
    "adagrad": lambda m: embcache.SparseAdaGrad([m], lr=0.1),
    "rowwise_adagrad": lambda m: embcache.SparseRowWiseAdaGrad([m], lr=0.1),
    "adam": lambda m: embcache.SparseAdam([m], lr=0.01),
}


def batches(n: int, batch: int = 256) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 5, (3 * batch,), generator=gen)
        limit = torch.tensor([5000, 3000, 2000]).repeat_interleave(batch)
        limit = limit.repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen).pow(2) * limit).long()
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], values, lengths)
        out.append((kjt, torch.randn(batch, 40, generator=gen)))
    return out


def train(device: str, rule: str, load_factor: float, steps: int = 6) -> dict[str, torch.Tensor]:
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=TABLES,
        cache=embcache.CacheConfig(load_factor=load_factor, ways=8),
        device=torch.device(device),
    )
    opt = OPTIMIZERS[rule](ebc)
    for kjt, coeff in batches(steps):
        out = ebc(kjt.to(torch.device(device))).values()
        (out * coeff.to(device)).sum().backward()
        opt.step()
    return {t.name: ebc.table_rows(t.name) for t in ebc.tables}


def test_auto_backend_runs_triton_on_cuda() -> None:
    assert use_triton(torch.empty(1, device="cuda"))
    assert not use_triton(torch.empty(1))


@pytest.mark.parametrize("load_factor", [0.05, 1.0], ids=["5pct", "whole"])
@pytest.mark.parametrize("rule", list(OPTIMIZERS))
def test_cuda_training_matches_the_cpu_path(rule: str, load_factor: float) -> None:
    """The Triton path (GPU) and the torch twins (CPU) train the same rows and state, to
    float32 reduction-order rounding."""
    on_gpu = train("cuda", rule, load_factor)
    on_cpu = train("cpu", rule, load_factor)
    for name, rows in on_cpu.items():
        torch.testing.assert_close(on_gpu[name], rows, rtol=1e-4, atol=1e-5, msg=name)


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
                    device=torch.device("cuda"),
                ),
                "head": nn.Linear(40, 1).cuda(),
            }
        )
        sparse = embcache.SparseAdaGrad([model["sparse"]], lr=0.1)
        dense = torch.optim.SGD(model["head"].parameters(), lr=0.05)
        data = [(kjt.to(torch.device("cuda")), c.cuda()) for kjt, c in batches(8)]
        pipe = TrainPipeline(
            model,
            sparse,
            dense,
            features=lambda b: b[0],
            loss=lambda m, b: m["head"](m["sparse"](b[0]).values()).square().mean(),
            prefetch=prefetch,
        )
        losses = pipe.run(data)
        rows = {t.name: model["sparse"].table_rows(t.name) for t in model["sparse"].tables}
        results.append((losses, rows))
    assert results[0][0] == results[1][0]
    for name, rows in results[0][1].items():
        assert torch.equal(results[1][1][name], rows), name
