"""``pip install embcache`` needs only its core: torch, triton, numpy, safetensors and tqdm.

A fresh virtual environment (no system site-packages) gets those five, at the versions this
environment runs, then the checkout with ``--no-deps``; ``import embcache`` and a training step
through `embcache.JaggedBatch` must then work there, on the torch path (no numba), without
torchrec, redis-py or matplotlib. A second check: the first KeyedJaggedTensor a run builds
prints nothing (torch warned about its own deprecated ``is_fx_tracing`` call).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import venv
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ("torch", "triton", "numpy", "safetensors", "tqdm")
OPTIONAL = ("numba", "torchrec", "fbgemm_gpu", "tensordict", "redis", "matplotlib")

STEP = textwrap.dedent(
    f"""
    import sys

    import torch

    import embcache

    ebc = embcache.CachedEmbeddingBagCollection(
        tables=[
            embcache.TableConfig(
                name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f0", "f1"]
            )
        ],
        cache=embcache.CacheConfig(capacity=64),
        device="cpu",
        seed=0,
    )
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    batch = embcache.JaggedBatch.from_lengths(
        keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 7, 7]), lengths=torch.tensor([2, 1, 0, 2])
    )
    before = ebc(batch).values().detach().clone()
    ebc(batch).values().square().sum().backward()
    opt.step()
    after = ebc(batch).values().detach()
    assert after.shape == (2, 16), after.shape
    assert not torch.equal(before, after), "the step changed no row"
    print("loaded:", sorted(m for m in {OPTIONAL!r} if m in sys.modules))
    print("from:", embcache.__file__)
    """
)


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["TRITON_INTERPRET"] = "1"  # the CPU has no GPU for Triton; the torch path runs anyway
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_core_alone_installs_imports_and_trains(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = str(env_dir / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]

    pins = [f"{name}=={version(name)}" for name in CORE]
    core = _run([*pip, *pins], tmp_path, timeout=600)
    if core.returncode != 0:
        pytest.skip(f"cannot install {' '.join(pins)} here: {core.stderr.strip()[-300:]}")

    # A copy of what the package is built from, so the build leaves nothing in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "embcache", src / "embcache", ignore=skip)
    done = _run([*pip, "--no-deps", str(src)], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    (tmp_path / "step.py").write_text(STEP)
    done = _run([python, "step.py"], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded: []" in done.stdout, done.stdout
    assert str(env_dir) in done.stdout, "embcache was imported from outside the new environment"


@pytest.mark.slow
def test_the_first_kjt_prints_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torchrec")
    script = textwrap.dedent(
        """
        import torch
        from torchrec import KeyedJaggedTensor

        import embcache

        ebc = embcache.CachedEmbeddingBagCollection(
            tables=[{"name": "t0", "embedding_dim": 8, "num_embeddings": 100,
                     "feature_names": ["f0"]}],
            device="cpu",
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([1, 2, 3]),
                                                   torch.tensor([2, 1]))
        ebc(kjt).values().sum().backward()
        print("done")
        """
    )
    done = _run([sys.executable, "-c", script], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done" in done.stdout
    assert "is_fx_tracing" not in done.stderr, done.stderr
