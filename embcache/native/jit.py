"""numba's compile options for every kernel of `embcache.native` (imported only when numba
can be): compiled without the GIL (a prefetch thread's resolve overlaps the training thread),
cached on disk after the first compilation, no bounds checks (each kernel checks what it
must); `inline` for the small helpers the compiler should paste into their callers."""

from __future__ import annotations

from numba import njit

jit = njit(nogil=True, cache=True, boundscheck=False)
inline = njit(nogil=True, cache=True, boundscheck=False, inline="always")
