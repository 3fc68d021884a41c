"""The one dispatch point between the Triton kernels and their torch twins.

`embcache.backend.for_device` decides (the environment variable is read there only), at
every call so tests can switch it per test: the Triton kernels where the tensor's `Backend` is
the ``triton`` family (``auto`` on a GPU; ``EMBCACHE_BACKEND=triton`` anywhere, on CPU
tensors through ``TRITON_INTERPRET=1``, set before triton is first imported: the test suite's
conftest does that on machines without a GPU), the torch twins (``*_ref.py``) otherwise.
"""

from __future__ import annotations

import inspect
import os

import torch

from embcache.backend import backend_name, for_device

__all__ = ["backend_name", "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor ``t`` should run its Triton kernel (else the torch twin)."""
    return for_device(t.device).triton


def _fix_interpreter_scalar_index() -> None:
    """Let Triton 3.6's interpreter run our loops under NumPy >= 2.4.

    The interpreter holds a scalar kernel argument (``dim``, a segment bound) as a one-element
    array and turns it into a Python int for ``range`` with ``int(array)``, which NumPy 2.4
    refuses for arrays of one dimension; Triton 3.8's interpreter reshapes first. The compiled
    (GPU) path never goes through this, so the patch applies only with ``TRITON_INTERPRET=1``
    and only to an interpreter that still has the old conversion.
    """
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or "int(self.handle.data)" not in inspect.getsource(patch_tensor):
        return

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    interpreter._patch_lang_tensor = patched


_fix_interpreter_scalar_index()
