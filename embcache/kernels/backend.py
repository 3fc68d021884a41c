"""The one dispatch point between the Triton kernels and their torch twins.

`EMBCACHE_BACKEND` decides, read at every call so tests can switch it per test:

* ``auto`` (default): Triton for CUDA tensors, the torch twins in `reference.py` for CPU tensors.
* ``triton``: Triton always. On CPU tensors this needs ``TRITON_INTERPRET=1`` set before
  triton is first imported (the test suite's conftest does that on machines without a GPU).
* ``torch``: the torch twins always, also on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

_CHOICES = ("auto", "triton", "torch")


def backend_name() -> str:
    """The backend asked for by ``EMBCACHE_BACKEND`` (``auto`` when unset)."""
    name = os.environ.get("EMBCACHE_BACKEND", "auto").strip().lower() or "auto"
    if name not in _CHOICES:
        raise ValueError(f"EMBCACHE_BACKEND={name!r} is not one of {', '.join(_CHOICES)}")
    return name


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor ``t`` should run its Triton kernel (else the torch twin)."""
    name = backend_name()
    if name == "auto":
        return t.is_cuda
    return name == "triton"
