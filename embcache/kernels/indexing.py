"""Writes into 1-D tensors at given positions, at the speed of ``index_select``.

On a CPU, advanced-indexing writes (``t[idx] = v``, ``t[idx] += 1``) take torch's general
indexing path, three to five times slower than ``scatter_`` / ``index_add_`` on the same
positions (`benchmarks/bench_step_profile.py` shows where they were). The cache's bookkeeping
(keys, locks, dirty flags, scores of its slots) goes through these instead. Reads use
``index_select`` directly.

Every function takes int64 positions on ``t``'s device and works the same on any device.
"""

from __future__ import annotations

import torch


def put(t: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``t[idx] = src`` for a 1-D ``t`` (positions distinct, or repeats writing one value)."""
    t.scatter_(0, idx, src.to(t.dtype))


def fill_at(t: torch.Tensor, idx: torch.Tensor, value: float | int | bool) -> None:
    """``t[idx] = value`` for a 1-D ``t`` (positions may repeat)."""
    t.scatter_(0, idx, torch.full((idx.numel(),), value, dtype=t.dtype, device=t.device))


def add_at(t: torch.Tensor, idx: torch.Tensor, delta: int) -> None:
    """``t[idx] += delta`` for a 1-D ``t`` and distinct positions (a repeated position is
    added to once per occurrence)."""
    t.index_add_(0, idx, torch.full((idx.numel(),), delta, dtype=t.dtype, device=t.device))


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
