"""Writes into tensors at given positions, and counts over bool maps, at the speed of a read.

On a CPU, advanced-indexing writes (``t[idx] = v``, ``t[idx] += 1``) take torch's general
indexing path, three to five times slower than ``scatter_`` / ``index_add_`` on the same
positions, and ``index_copy_`` of whole rows about twice as slow as numpy's row assignment
(`benchmarks/bench_step_profile.py` shows where they were). The cache's bookkeeping (keys,
locks, dirty flags, scores of its slots) and the rows the cache and the tiers move go through
these instead. Reads use ``index_select`` directly, and the positions of a bool mask come from
`true_at` (numpy's ``flatnonzero``, two to five times faster than torch's ``nonzero`` there).

Positions are int64, on the tensor's device; each function means the same on any device.
"""

from __future__ import annotations

import numpy as np
import torch

import embcache.native as native
from embcache.backend import constant, cpu_backend


def put(t: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``t[idx] = src`` for a 1-D ``t`` (positions distinct, or repeats writing one value)."""
    t.scatter_(0, idx, src.to(t.dtype))


def fill_at(t: torch.Tensor, idx: torch.Tensor, value: float | int | bool) -> None:
    """``t[idx] = value`` for a 1-D ``t`` (positions may repeat). On a CPU with the compiled
    kernels, one checked pass (`native.write_at`: about as fast as ``scatter_`` on arrays in
    the CPU's caches; it asks for the lines ahead, for the cache's bookkeeping arrays that a
    step's row moves push out of them)."""
    if _compiled_at(t, idx):
        try:
            native.write_at(t.numpy(), idx.numpy(), _scalar(t, value), add=False)
        except native.OutOfRangeError as error:  # as torch's ``scatter_`` refuses it
            raise RuntimeError(str(error)) from None
        return
    t.scatter_(0, idx, value)  # the scalar overload: one launch, no values to fill first


def add_at(t: torch.Tensor, idx: torch.Tensor, delta: int) -> None:
    """``t[idx] += delta`` for a 1-D ``t`` and distinct positions (a repeated position is
    added to once per occurrence). On a CPU, one checked compiled pass as `fill_at`."""
    if _compiled_at(t, idx):  # a position out of range: IndexError, as ``index_add_``'s
        native.write_at(t.numpy(), idx.numpy(), _scalar(t, delta), add=True)
        return
    t.index_add_(0, idx, constant(delta, t.dtype, t.device).expand(idx.numel()))


# The compiled `fill_at` / `add_at` take these dtypes (numba has no half precision), and write
# the value as this numpy scalar type.
_COMPILED_DTYPES = {
    torch.bool: np.bool_,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
}


def _compiled_at(t: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether a write at ``idx`` into ``t`` goes through a compiled pass: CPU tensors, a
    contiguous 1-D ``t`` of a dtype numba has, contiguous int64 positions. (The write then
    leaves ``t``'s autograd version counter as it was, as `copy_rows` does: the cache's
    bookkeeping is saved by no graph.)"""
    return (
        t.device.type == "cpu"
        and idx.device.type == "cpu"
        and t.dim() == 1
        and idx.dtype == torch.int64
        and t.dtype in _COMPILED_DTYPES
        and t.is_contiguous()
        and idx.is_contiguous()
        and not t.requires_grad
        and cpu_backend().compiled
    )


def _scalar(t: torch.Tensor, value: float | int | bool) -> np.generic:
    """``value`` as a numpy scalar of ``t``'s dtype (what the kernel writes)."""
    return _COMPILED_DTYPES[t.dtype](value)


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


def copy_rows(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[idx] = src`` along dim 0, ``idx`` distinct (``index_copy_``'s meaning).

    On a CPU, numpy's row assignment over the same memory (no copy, no torch dispatch) writes
    scattered rows about twice as fast as torch's ``index_copy_`` (bench_step_profile: the
    tier's and the cache's row writes); elsewhere and for bfloat16 (which numpy lacks),
    ``index_copy_``. ``src`` is cast to ``dst``'s dtype first. The write does not bump
    ``dst``'s autograd version counter: ``dst`` must not be saved by a graph that checks it
    (the cache's storage and the tiers' arrays are not).
    """
    src = src.to(dst.dtype)
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and idx.device.type == "cpu"
        and dst.dtype != torch.bfloat16
        and idx.numel()
    ):
        d, s = dst.detach().numpy(), src.detach().numpy()
        if d.ndim == 2 and idx.dtype == torch.int64 and cpu_backend().compiled:
            if d.dtype == np.float16:  # moved as their bits (numba has no float16)
                d, s = d.view(np.int16), s.view(np.int16)
            native.scatter_rows(d, idx.numpy(), s)
        else:
            d[idx.numpy()] = s
        return
    dst.index_copy_(0, idx, src)


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
