"""Torch twins of the rounding helpers (`kernels/rounding.py`): float32 values stored into
float16 or bfloat16 weights, rounded to nearest or stochastically.

Stochastic rounding keeps an update smaller than half a unit in the last place from vanishing:
``x`` between the two neighbours ``lo`` (toward zero) and ``hi`` (away from zero) of the narrow
type becomes ``hi`` with probability ``(|x| - |lo|) / (|hi| - |lo|)``, so its expected value is
``x`` exactly (FBGEMM rounds fp16 weights this way by default). ``lo`` is the round-to-nearest
result stepped one unit toward zero when that rounded away, ``hi`` the next value away from
zero (bit patterns of a sign-magnitude format: ``bits + 1``), so it is unbiased everywhere,
subnormals included; the fraction is exact in float32.

The uniform draw is a counter-based hash of ``(key, row id, column)``: the same bits on every
backend and every run, whatever the order rows are updated in, and independent of where the row
sits (a slot of the cache): `key` mixes the seed with the optimizer step.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # a 32-bit integer hash's multiplier (< 2**27: products fit in int64)
_COLUMN_MUL = 0x9E3779B1  # golden-ratio multiplier spreading column numbers over 32 bits


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in ``[0, 2**32)`` (same shape, same range)."""
    x = (((x >> 16) ^ x) * _HASH_MUL) & M32
    x = (((x >> 16) ^ x) * _HASH_MUL) & M32
    return (x >> 16) ^ x


def rounding_key(seed: int, step: int) -> int:
    """The 32-bit key of one optimizer step's draws."""
    x = (seed * _COLUMN_MUL + step) & M32
    x = (((x >> 16) ^ x) * _HASH_MUL) & M32
    x = (((x >> 16) ^ x) * _HASH_MUL) & M32
    return (x >> 16) ^ x


def uniform_ref(ids: torch.Tensor, dim: int, key: int) -> torch.Tensor:
    """float32 ``[n, dim]`` in ``[0, 1)`` (24 random bits), a function of ``(key, ids[i], j)``.

    Args:
        ids: int64 ``[n]``, non-negative row ids (fused ids).
        dim: columns.
        key: `rounding_key` of the step.
    """
    row = hash32(hash32((ids & M32) ^ key) ^ ((ids >> 32) & M32))  # [n]
    cols = (torch.arange(dim, dtype=torch.int64, device=ids.device) * _COLUMN_MUL) & M32
    bits = hash32(row.unsqueeze(1) ^ cols.unsqueeze(0)) >> 8  # [n, dim], 24 bits
    return bits.to(torch.float32) * (1.0 / (1 << 24))


def stochastic_round_ref(x: torch.Tensor, dtype: torch.dtype, u: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) in ``dtype`` (float16 or bfloat16), rounded up in magnitude where
    ``u < (|x| - |lo|) / (|hi| - |lo|)``, else toward zero; ``u`` uniform in ``[0, 1)`` of
    ``x``'s shape."""
    nearest = x.to(dtype)
    bits = nearest.view(torch.int16)
    away = nearest.to(torch.float32).abs() > x.abs()  # rounded away from zero: step back
    lo_bits = torch.where(away, bits - 1, bits)
    lo = lo_bits.view(dtype)
    hi = (lo_bits + 1).view(dtype)
    lo32, hi32 = lo.to(torch.float32).abs(), hi.to(torch.float32).abs()
    p = (x.abs() - lo32) / (hi32 - lo32)
    return torch.where(u < p, hi, lo)


def store_weights_ref(
    w: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor | None, key: int
) -> torch.Tensor:
    """Updated float32 weights ``[n, dim]`` as ``dtype``: float32 unchanged; half precision
    stochastically rounded with the draws of ``(key, ids)``, or to nearest without ``ids``."""
    if dtype == torch.float32:
        return w
    if ids is None:
        return w.to(dtype)
    return stochastic_round_ref(w, dtype, uniform_ref(ids, w.shape[1], key))
