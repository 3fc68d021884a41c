"""Suite-wide set-up: Triton's interpreter on machines without a GPU, and the backend fixture."""

from __future__ import annotations

import os

import torch

# Must happen before triton is first imported anywhere in the test session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

HAS_CUDA = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device; none on this machine")


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once per backend: the torch twins and the Triton kernels.

    On a machine without a GPU the Triton kernels run on CPU tensors through the interpreter.
    """
    monkeypatch.setenv("EMBCACHE_BACKEND", request.param)
    return request.param


@pytest.fixture
def device() -> torch.device:
    """The device tests put tensors on: CUDA when present, else the CPU."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # EMBCACHE_TEST_DEVICE=cpu: tests/test_gpu.py stands in the CPU for CUDA (the GPU check's
    # dry run walks it that way, with Triton through the interpreter).
    if HAS_CUDA or os.environ.get("EMBCACHE_TEST_DEVICE") == "cpu":
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none on this machine"))
