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
    batch = [1, 16, 7, 33, 16, 48, 2, 5, 17, 64, 3, 9][step % 12]
    lengths = torch.randint(0 if step % 3 else 1, 5, (len(keys) * batch,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return embcache.JaggedBatch.from_lengths(keys, values, lengths)


@pytest.mark.parametrize("load_factor", [1.0, 0.1], ids=["whole", "cached10"])
@pytest.mark.parametrize(
    ("dtype", "dims"),
    [(torch.float32, (8, 12)), (torch.float16, (8, 8))],
    ids=["fp32-two-caches", "fp16-one-cache"],
)
def test_no_new_compile_key_after_warmup(launches, load_factor: float, dtype, dims) -> None:
    """12 steps of batches of 1 to 64 samples, empty bags included, on two tables of two dims
    (two caches) or of one (one cache of two tables), SUM and MEAN, Adagrad (half rows round
    stochastically with a key that changes each step): after step 2 no launch has a key unseen
    before."""
    tables = [
        embcache.TableConfig(
            name="a", embedding_dim=dims[0], num_embeddings=1000, feature_names=["f0"]
        ),
        embcache.TableConfig(
            name="b",
            embedding_dim=dims[1],
            num_embeddings=1000,
            feature_names=["f1"],
            pooling="mean",
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
        out = ebc(_batch(gen, ["f0", "f1"], 1000, step)).values()
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


def test_sizes_of_a_batch_never_change_a_kernels_key(launches) -> None:
    """The counts a batch decides (ids, misses, touched sets) at values that flip Triton's
    specialisations (1, a multiple of 16, another): one key per kernel. The victim choice sees
    only the touched sets' rows, so their number is a batch's count too (it compiled a new
    variant at step 3 of a run before it was do_not_specialize)."""
    from embcache.kernels.cache_index import assign_ways, cache_lookup, set_index

    gen = torch.Generator().manual_seed(0)
    for n in (1, 16, 17, 32, 5):
        ids = torch.randint(0, 10_000, (n,), generator=gen)
        keys = torch.randint(-1, 10_000, (64, 4), generator=gen)
        cache_lookup(keys, ids, set_index(ids, 64))
        scores = torch.randint(0, 100, (n, 4), generator=gen)  # the touched sets' rows
        blocked = torch.rand(n, 4, generator=gen) < 0.3
        assign_ways(scores, blocked, torch.sort(torch.randint(0, n, (2 * n,), generator=gen))[0])
    by_kernel = defaultdict(set)
    for _, key in launches:
        by_kernel[key[1]].add(key)
    assert set(by_kernel) == {"_set_index_kernel", "_cache_lookup_kernel", "_assign_ways_kernel"}
    assert all(len(keys) == 1 for keys in by_kernel.values()), {
        k: len(v) for k, v in by_kernel.items()
    }
