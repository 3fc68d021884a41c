"""Rounding float32 values into half-precision weights: to nearest or stochastically.

The Triton helpers here are called by other kernels (the optimizer's row update stores its
weights through `store_weights`); `stochastic_round` runs them alone, for tests and
benchmarks. The specification, and the CPU path, is `rounding_ref.py`: the same float32
operations and the same counter-based draws, so both backends give the same bits.

Layout follows Liger-Kernel: kernels, then the launcher, then the public function.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embcache.kernels.backend import use_triton
from embcache.kernels.checks import check_tensor, require
from embcache.kernels.rounding_ref import (
    rounding_key,
    stochastic_round_ref,
    uniform_ref,
)

__all__ = ["rounding_key", "row_hash", "stochastic_round", "store_weights"]

_BLOCK_N = 16
_MAX_BLOCK_D = 256

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _hash32(x):
    """`rounding_ref.hash32` on int64 values in ``[0, 2**32)``."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def row_hash(b_ids, key):
    """Per-row part of the draws: `rounding_ref.uniform_ref`'s ``row``. int64 ``[BLOCK_N]``."""
    return _hash32(_hash32((b_ids & 0xFFFFFFFF) ^ key) ^ ((b_ids >> 32) & 0xFFFFFFFF))


@triton.jit
def _uniform(b_row, o_d):
    """float32 ``[BLOCK_N, BLOCK_D]`` in ``[0, 1)``: `rounding_ref.uniform_ref` of the rows'
    hashes ``b_row`` and columns ``o_d``."""
    b_cols = (o_d.to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF
    b_bits = _hash32(b_row[:, None] ^ b_cols[None, :]) >> 8
    return b_bits.to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _round(b_x, b_u, OUT_DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """float32 ``b_x`` into ``OUT_DTYPE`` (16-bit): stochastically with the uniform draws
    ``b_u`` (`rounding_ref.stochastic_round_ref`), else to nearest, ties to even.

    Both from the two neighbours: a cast gives one of them (Triton's interpreter truncates a
    float32 to bfloat16 where a GPU rounds to nearest; either way), stepped toward zero when it
    went away from it; the other is the next bit pattern.
    """
    b_near = b_x.to(OUT_DTYPE)
    b_bits = b_near.to(tl.int16, bitcast=True)
    m_away = tl.abs(b_near.to(tl.float32)) > tl.abs(b_x)
    b_lo_bits = tl.where(m_away, b_bits - 1, b_bits)
    b_lo = b_lo_bits.to(OUT_DTYPE, bitcast=True)
    b_hi = (b_lo_bits + 1).to(OUT_DTYPE, bitcast=True)
    b_lo32 = tl.abs(b_lo.to(tl.float32))
    b_hi32 = tl.abs(b_hi.to(tl.float32))
    b_p = tl.div_rn(tl.abs(b_x) - b_lo32, b_hi32 - b_lo32)
    m_nearest_up = (b_p > 0.5) | ((b_p == 0.5) & ((b_lo_bits & 1) == 1))  # ties to even
    m_up = b_u < b_p if STOCHASTIC else m_nearest_up
    return tl.where(m_up, b_hi, b_lo)


@triton.jit
def store_weights(p_w, b_w, m_nd, b_row, o_d, STOCHASTIC: tl.constexpr):
    """Store float32 weights ``b_w`` at ``p_w`` in its element type: half precision rounded
    stochastically (draws of the rows' hashes ``b_row``) or to nearest."""
    out_dtype: tl.constexpr = p_w.dtype.element_ty
    if out_dtype == tl.float32:
        tl.store(p_w, b_w, mask=m_nd)
    elif STOCHASTIC:
        tl.store(p_w, _round(b_w, _uniform(b_row, o_d), out_dtype, True), mask=m_nd)
    else:
        tl.store(p_w, _round(b_w, b_w, out_dtype, False), mask=m_nd)


@triton.jit(do_not_specialize=["n", "key"])  # per-batch values: one variant
def _stochastic_round_kernel(
    x_ptr,
    ids_ptr,
    out_ptr,
    n,
    dim,
    key: tl.int64,  # 32 unsigned bits, always passed as i64
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[i, j] = stochastic_round(x[i, j])`` with the draws of ``(key, ids[i], j)``;
    ``x`` and ``out`` contiguous ``[n, dim]``."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_row = row_hash(tl.load(ids_ptr + o_n, mask=m_n, other=0).to(tl.int64), key)
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D]
        m_nd = m_n[:, None] & (o_d < dim)[None, :]  # [BLOCK_N, BLOCK_D]
        offsets = o_n[:, None] * dim + o_d[None, :]
        b_x = tl.load(x_ptr + offsets, mask=m_nd, other=0.0)
        store_weights(out_ptr + offsets, b_x, m_nd, b_row, o_d, True)


# ----------------------------------------------------------------------------------------------
# launcher and public function
# ----------------------------------------------------------------------------------------------


def stochastic_round_triton(
    x: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor, key: int
) -> torch.Tensor:
    """Launch `_stochastic_round_kernel` on checked inputs (see `stochastic_round`)."""
    n, dim = x.shape
    out = torch.empty(n, dim, dtype=dtype, device=x.device)
    if n and dim:
        block_d = min(triton.next_power_of_2(dim), _MAX_BLOCK_D)
        grid = (triton.cdiv(n, _BLOCK_N),)
        _stochastic_round_kernel[grid](
            x.contiguous(), ids, out, n, dim, key, BLOCK_N=_BLOCK_N, BLOCK_D=block_d
        )
    return out


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor, key: int
) -> torch.Tensor:
    """Round float32 ``x`` ``[n, dim]`` into ``dtype`` (float16 or bfloat16) stochastically.

    Row i's draws are a function of ``(key, ids[i], column)`` alone, so the result is the same
    on every backend and run; over many keys its mean is ``x`` (unbiased).

    Args:
        x: float32 ``[n, dim]``.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        ids: int64 ``[n]``, non-negative row ids.
        key: a 32-bit key (`rounding_key(seed, step)`).

    Returns:
        ``[n, dim]`` of ``dtype``: each value the neighbour of ``x`` toward zero or the one away
        from it, the latter with probability equal to ``x``'s fraction of the gap.
    """
    check_tensor("x", x, torch.float32, 2)
    check_tensor("ids", ids, torch.int64, 1)
    require(dtype in (torch.float16, torch.bfloat16), f"dtype must be 16-bit, got {dtype}")
    require(ids.numel() == x.shape[0], f"ids has {ids.numel()} entries, x {x.shape[0]} rows")
    require(isinstance(key, int) and 0 <= key < 1 << 32, f"key must be 32-bit, got {key!r}")
    if use_triton(x):
        return stochastic_round_triton(x, dtype, ids, key)
    return stochastic_round_ref(x, dtype, uniform_ref(ids, x.shape[1], key))
