"""The Triton-or-twin choice per tensor, for the code that still asks it at every call (the
engine's `dedup_together` route; every op family is bound once under `embcache.ops`).

`embcache.backend.for_device` decides (the environment variable is read there only), at
every call so tests can switch it per test: the Triton kernels where the tensor's `Backend` is
the ``triton`` family (``auto`` on a GPU; ``EMBCACHE_BACKEND=triton`` anywhere, on CPU
tensors through ``TRITON_INTERPRET=1``, set before triton is first imported: the test suite's
conftest does that on machines without a GPU), the torch specifications otherwise. The
families under `embcache.ops` are bound once instead (`embcache.ops.registry`).
"""

from __future__ import annotations

import torch

import embcache.ops.interpreter  # noqa: F401  (the interpreter runs our kernels)
from embcache.backend import backend_name, for_device

__all__ = ["backend_name", "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor ``t`` should run its Triton kernel (else the torch twin)."""
    return for_device(t.device).triton
