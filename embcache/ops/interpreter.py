"""Triton's interpreter (``TRITON_INTERPRET=1``) made to run our kernels: imported by every
module that launches Triton kernels, before its first launch.

`fix_scalar_index` lets Triton 3.6's interpreter run our loops under NumPy >= 2.4. The
interpreter holds a scalar kernel argument (``dim``, a segment bound) as a one-element array
and turns it into a Python int for ``range`` with ``int(array)``, which NumPy 2.4 refuses for
arrays of one dimension; Triton 3.8's interpreter reshapes first. The compiled (GPU) path
never goes through this, so the patch applies only with ``TRITON_INTERPRET=1`` and only to an
interpreter that still has the old conversion.
"""

from __future__ import annotations

import inspect
import os


def fix_scalar_index() -> None:
    """Patch the interpreter's scalar conversion where it needs it (module docstring)."""
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


fix_scalar_index()
