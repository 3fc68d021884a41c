"""Suite-wide set-up: Triton's interpreter on machines without a GPU, and the backend fixture."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Must happen before triton is first imported anywhere in the test session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

HAS_CUDA = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device; none on this machine")


@pytest.fixture(params=["torch", "triton", "auto"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once per backend: the torch twins, the Triton kernels, and ``auto`` (the
    default: Triton on CUDA tensors; on CPU tensors the torch twins with the compiled numba
    kernels of `embcache.native` and FBGEMM's CPU TBE where they apply).

    On a machine without a GPU the Triton kernels run on CPU tensors through the interpreter.
    """
    monkeypatch.setenv("EMBCACHE_BACKEND", request.param)
    return request.param


@pytest.fixture
def device() -> torch.device:
    """The device tests put tensors on: CUDA when present, else the CPU."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, not by the plugin, so that --strict-markers accepts it in every run.
    config.addinivalue_line(
        "markers",
        "launch_guard_exempt: not checked by tests/triton_launch_guard.py (a test that never "
        "runs on the GPU, e.g. one that needs the interpreter)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # EMBCACHE_TEST_DEVICE=cpu: tests/test_gpu.py stands in the CPU for CUDA (the GPU check's
    # dry run walks it that way, with Triton through the interpreter).
    if HAS_CUDA or os.environ.get("EMBCACHE_TEST_DEVICE") == "cpu":
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none on this machine"))


@pytest.fixture(autouse=True)
def _tier_records_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`embcache train` records a Redis tier's state in ./.embcache/tiers/ (where it runs); a
    test's runs keep theirs in its own folder, so a record never outlives its test's server."""
    monkeypatch.setenv("EMBCACHE_TIER_RECORDS", str(tmp_path / "tier-records"))
