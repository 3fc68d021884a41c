"""No Triton kernel compiles a new variant mid-run: every compile key is fixed after warm-up.

A GPU compiles a kernel once per distinct key (constexprs, argument types, and the
specialisation of integers and pointers: divisible by 16, or equal to 1). A constexpr computed
from a batch's count, or a size or seed that changes every step, compiles new variants in the
middle of training (0.1-1.7 s each on an H200, seen there: 6 new variants after step 2 of a
20-step run before this test existed). Under the interpreter nothing compiles, so the keys are
computed as Triton computes them (`benchmarks/compile_kernels.compile_key`: Triton's own
specialisation with the kernel's ``do_not_specialize`` list) on every launch of a device-path
training run whose batches vary in size and content, and none may be new after step 2.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

import embcache

ROOT = Path(__file__).resolve().parents[2]
WARMUP = 2


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch):
    """A list that receives ``(step, key)`` for each Triton launch; set ``launches.step``."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from compile_kernels import compile_key
    from triton.runtime import interpreter

    class Recorder(list):
        step = -1

    seen = Recorder()
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        seen.append((seen.step, compile_key(self, args, kwargs)[2]))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    return seen


def _batch(gen: torch.Generator, keys: list[str], rows: int, step: int) -> embcache.JaggedBatch:
    """Batch sizes that cross the divisible-by-16 and equal-to-1 boundaries of every count."""
    batch = [1, 16, 7, 33, 2, 48, 5, 17, 64, 3][step % 10]
    lengths = torch.randint(0 if step % 3 else 1, 4, (len(keys) * batch,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return embcache.JaggedBatch.from_lengths(keys, values, lengths)


@pytest.mark.parametrize("load_factor", [1.0, 0.1], ids=["whole", "cached10"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_no_new_compile_key_after_warmup(launches, load_factor: float, dtype) -> None:
    """12 steps of batches of 1 to 64 samples, empty bags included, on two tables of two dims
    (SUM and MEAN), Adagrad (half rows round stochastically with a key that changes each step):
    after step 2 no launch has a key unseen before."""
    tables = [
        embcache.TableConfig(name="a", embedding_dim=8, num_embeddings=300, feature_names=["f0"]),
        embcache.TableConfig(
            name="b", embedding_dim=12, num_embeddings=500, feature_names=["f1"], pooling="mean"
        ),
    ]
    ebc = embcache.CachedEmbeddingBagCollection(
        tables,
        cache=embcache.CacheConfig(load_factor=load_factor, ways=4, weight_dtype=dtype),
        seed=0,
    )
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        launches.step = step
        out = ebc(_batch(gen, ["f0", "f1"], 300, step)).values()
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        opt.step()
    first: dict[tuple, int] = {}
    for step, key in launches:
        first.setdefault(key, step)
    late = defaultdict(list)
    for key, step in first.items():
        if step >= WARMUP:
            late[key[1]].append((step, key[2]))
    kernels = {key[1] for key in first}
    print(f"{len(first)} compile keys over {len(kernels)} kernels, {len(launches)} launches")
    assert len(kernels) >= 4, f"too few kernels launched to prove anything: {sorted(kernels)}"
    assert not late, "new compile keys after warm-up: " + "; ".join(
        f"{name} at step {s}: {k}" for name, items in late.items() for s, k in items[:2]
    )
