"""Bit helpers for the numba kernels (imported only when numba can be).

`mix64` is splitmix64's finaliser (`embcache.hashing.mix64`), the hash of the initialiser and of
a cache's sets. `popcount` is LLVM's ``ctpop``, one instruction on the CPUs this runs on (x86-64
with POPCNT, arm64). The compiled dedup ranks a row by counting the bits set before it in the
batch's bitmap instead of keeping a rank per row (`plan_kernels.unique_rows`), and lists the
set bits of a word lowest first through `DEBRUIJN`.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import intrinsic

from embcache.native.jit import jit

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
LOW63 = np.uint64(0x7FFFFFFFFFFFFFFF)
S27, S30, S31 = np.uint64(27), np.uint64(30), np.uint64(31)


@intrinsic
def popcount(typingctx, x):
    """The number of bits set in ``x`` (a uint64), as a uint64."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen


@jit
def mix64(x):  # x: uint64; splitmix64's finaliser (`embcache.hashing.mix64`)
    z = x + GOLDEN
    z = (z ^ (z >> S30)) * MIX1
    z = (z ^ (z >> S27)) * MIX2
    return z ^ (z >> S31)


DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
# The position of the lowest set bit of a word, ``t`` that bit alone: DEBRUIJN_BITS[t * DEBRUIJN
# >> 58] (a de Bruijn sequence: each 6-bit window of it occurs once).
DEBRUIJN_BITS = np.array(
    [0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4, 62, 55, 59, 36, 53, 51, 43, 22,
     45, 39, 33, 30, 24, 18, 12, 5, 63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23,
     11, 46, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6],
    dtype=np.int64,
)  # fmt: skip
