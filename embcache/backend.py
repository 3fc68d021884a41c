"""Which implementation of the core operations runs: ``EMBCACHE_BACKEND``, read here and
nowhere else.

* ``auto`` (default, also when unset or empty): on a GPU the Triton kernels; on a CPU the
  compiled loops (`embcache.native`, numba) and FBGEMM's CPU TBE where they apply, else the
  torch twins.
* ``triton``: the Triton kernels always (on CPU tensors through ``TRITON_INTERPRET=1``), and
  code with a CPU-only branch takes its device branch (`kernels.backend.takes_device_path`).
* ``torch``: the torch twins always, the specification every other implementation matches.

Anything else is a ValueError, raised where the choice is made: a collection's construction
(a cache decides its structures, a tier table its row moves), a step's first use of a compiled
pass. The variable is read at every call, so that tests can switch it per test; whoever holds a
choice reads it once and keeps it.
"""

from __future__ import annotations

import os

CHOICES = ("auto", "triton", "torch")


def backend_name() -> str:
    """The backend asked for by ``EMBCACHE_BACKEND`` (``auto`` when unset), or a ValueError
    naming the choices for any other value."""
    name = os.environ.get("EMBCACHE_BACKEND", "auto").strip().lower() or "auto"
    if name not in CHOICES:
        raise ValueError(f"EMBCACHE_BACKEND={name!r} is not one of {', '.join(CHOICES)}")
    return name
