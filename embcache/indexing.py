"""Writes into tensors at given positions, and counts over bool maps, at the speed of a read.

On a CPU, advanced-indexing writes (``t[idx] = v``) take torch's general indexing path, three
to five times slower than ``scatter_`` on the same positions (`benchmarks/bench_step_profile.py`
showed where they were): `put` uses it. Reads use ``index_select`` directly, and the positions
of a bool mask come from `true_at` (numpy's ``flatnonzero``, two to five times faster than
torch's ``nonzero`` there). The writes with a compiled pass on a CPU (a value at positions,
rows at positions) are the rows family's (`ops.rows`: `RowsOps.fill_at`, `add_at`,
`copy_rows`), called through the implementation a cache or tier table bound.

Positions are int64, on the tensor's device; each function means the same on any device.
"""

from __future__ import annotations

import numpy as np
import torch


def put(t: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``t[idx] = src`` for a 1-D ``t`` (positions distinct, or repeats writing one value)."""
    t.scatter_(0, idx, src.to(t.dtype))


_BYTE_SUM = 0x0101010101010101  # times a word of 0/1 bytes: their sum lands in the top byte


def count_true(flags: torch.Tensor) -> int:
    """How many of a contiguous 1-D bool ``flags`` are True: eight flags per int64 word, their
    sum gathered into the word's top byte by one multiplication (a bool reduction over a CPU
    tensor runs byte by byte, several times slower)."""
    n = flags.numel()
    whole = n - n % 8
    if flags.storage_offset() % 8 or not flags.is_contiguous():
        return int(torch.count_nonzero(flags))
    total = 0
    if whole:
        words = flags[:whole].view(torch.int64)
        total = int(torch.bitwise_right_shift(words * _BYTE_SUM, 56).sum())
    if whole < n:
        total += int(torch.count_nonzero(flags[whole:]))
    return total


def or_flags(flags: torch.Tensor, other: torch.Tensor) -> None:
    """``flags |= other`` for two contiguous 1-D bool tensors of one size, eight flags at a
    time where their storage allows it."""
    n = flags.numel()
    whole = n - n % 8
    aligned = flags.storage_offset() % 8 == 0 and other.storage_offset() % 8 == 0
    if not (aligned and flags.is_contiguous() and other.is_contiguous()) or whole == 0:
        flags.logical_or_(other)
        return
    flags[:whole].view(torch.int64).bitwise_or_(other[:whole].view(torch.int64))
    if whole < n:
        flags[whole:].logical_or_(other[whole:])


def true_at(flags: torch.Tensor) -> torch.Tensor:
    """Positions where a 1-D bool ``flags`` is True, ascending: ``flags.nonzero()[:, 0]``.

    On a CPU through numpy's ``flatnonzero`` over the same memory, several times faster than
    torch's ``nonzero`` (which also backs a boolean-mask read ``t[flags]``)."""
    if flags.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(flags.detach().numpy())).to(torch.int64)
    return flags.nonzero().squeeze(1)


def select(t: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``t[flags]`` along dim 0 for a 1-D bool ``flags`` of ``t``'s length (`true_at`, then
    one ``index_select``)."""
    return t.index_select(0, true_at(flags))
