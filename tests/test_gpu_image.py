"""embcache without torchrec, fbgemm_gpu, tensordict or redis-py, as on the GPU image.

Each test starts a fresh Python with ``tests/gpu_image`` first on PYTHONPATH, whose
``sitecustomize`` makes those packages unimportable, and runs there what the GPU machine runs:
the kernel and cache tests, a short training run through `embcache.JaggedBatch` (compared bit
for bit with the same run through torchrec's KJT in this process) and the CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torchrec import KeyedJaggedTensor

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = ROOT / "tests" / "gpu_image"


def _run(args: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BLOCKER), str(ROOT)])}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_blocker_really_blocks() -> None:
    probe = "import importlib, sys\n" + "".join(
        f"try:\n    importlib.import_module({name!r})\n    sys.exit('imported {name}')\n"
        f"except ImportError:\n    pass\n"
        for name in ("torchrec", "fbgemm_gpu", "tensordict", "redis")
    )
    done = _run(["-c", probe + "import embcache; print('ok')"], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_kernel_and_cache_tests_pass_without_torchrec() -> None:
    done = _run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels", "tests/cache"],
        timeout=600,
    )
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " error" not in done.stdout, tail


TRAIN = """
import sys, torch, embcache
tables = [
    embcache.TableConfig(
        name="t0", embedding_dim=8, num_embeddings=300, feature_names=["f0", "f1"]
    ),
    {"name": "t1", "embedding_dim": 5, "num_embeddings": 200, "feature_names": ["f2"],
     "pooling": "mean"},
]
ebc = embcache.CachedEmbeddingBagCollection(
    tables=tables, cache=embcache.CacheConfig(capacity=16, ways=4, policy="lfu"), seed=0
)
opt = embcache.SparseRowWiseAdaGrad([ebc], lr=0.1)
batches = torch.load(sys.argv[1])
for lengths, values, coeff in batches:
    out = ebc(embcache.JaggedBatch.from_lengths(["f0", "f1", "f2"], values, lengths))
    assert type(out).__name__ == "PooledEmbeddings", type(out)
    (out.values() * coeff).sum().add(out.values().square().sum()).backward()
    opt.step()
torch.save({n: ebc.table_rows(n) for n in ("t0", "t1")}, sys.argv[2])
"""


def test_training_through_jagged_batch_matches_the_kjt_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import embcache

    # Without fbgemm the script runs the torch twins; the reference here must too (with fbgemm
    # the TBE step would round differently, which is not what this test compares).
    monkeypatch.setenv("EMBCACHE_BACKEND", "torch")

    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(5):
        lengths = torch.randint(0, 5, (3 * 8,), generator=gen)
        limits = torch.tensor([300, 300, 200]).repeat_interleave(8).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen) * limits).long()
        batches.append((lengths, values, torch.randn(8, 8 + 8 + 5, generator=gen)))
    torch.save(batches, tmp_path / "batches.pt")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    done = _run([str(script), str(tmp_path / "batches.pt"), str(tmp_path / "rows.pt")], 300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "rows.pt")

    from torchrec import EmbeddingBagConfig, PoolingType

    ebc = embcache.CachedEmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name="t0", embedding_dim=8, num_embeddings=300, feature_names=["f0", "f1"]
            ),
            EmbeddingBagConfig(
                name="t1",
                embedding_dim=5,
                num_embeddings=200,
                feature_names=["f2"],
                pooling=PoolingType.MEAN,
            ),
        ],
        cache=embcache.CacheConfig(capacity=16, ways=4, policy="lfu"),
        seed=0,  # the same rows in both processes
    )
    opt = embcache.SparseRowWiseAdaGrad([ebc], lr=0.1)
    for lengths, values, coeff in batches:
        out = ebc(KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], values, lengths))
        (out.values() * coeff).sum().add(out.values().square().sum()).backward()
        opt.step()
    for name in ("t0", "t1"):
        assert torch.equal(theirs[name], ebc.table_rows(name)), name


def test_cli_trains_without_torchrec(tmp_path: Path) -> None:
    done = _run(
        ["-m", "embcache.cli", "train", "--steps", "6", "--batch-size", "128", "--threads", "1"],
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out      AUC" in done.stdout, done.stdout[-2000:]


def test_a_redis_store_names_the_missing_package() -> None:
    done = _run(
        ["-c", "import embcache; embcache.open_store('redis://127.0.0.1:6379/0')"], timeout=120
    )
    assert done.returncode != 0
    assert "pip install 'redis[hiredis]" in done.stderr, done.stderr[-2000:]
