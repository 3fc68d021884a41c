"""Large host arrays in huge pages: the cache's slot storage and row index, the tiers' tables.

A CPU step reads and writes rows at random places in arrays of tens to hundreds of MB (a
cache's slots, its row index, a dense tier table). With 4 KiB pages nearly every such access
also misses the TLB and walks the page table; in 2 MiB pages the same arrays need 512 times
fewer entries. Linux gives anonymous memory huge pages when asked (``madvise(MADV_HUGEPAGE)``,
honoured under the default ``transparent_hugepage=madvise``): `host_zeros` maps the array
itself, asks, and wraps it as a tensor. Measured on a 2-core EPYC: gathering 8 x 970 random
rows of 260 bytes from 52 MB tables takes 0.41 ms in huge pages against 0.51 ms.

The pages are committed when first written, as with ``torch.zeros`` (a mapped page reads as
zeros), but 2 MiB at a time: a sparsely written array commits more, at most its whole size.
Where huge pages cannot be asked for (another OS, a kernel without them) it is plain
``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap

import torch

# Arrays from this size: below it the TLB covers them anyway.
HUGE_MIN_BYTES = 8 << 20


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor, in huge pages when it is large enough and the OS allows."""
    n = math.prod(shape)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_MIN_BYTES or advise is None:
        return torch.zeros(shape, dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(advise)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive; anonymous pages read as zeros until written.
    return torch.frombuffer(buf, dtype=dtype, count=n).view(shape)
