"""Bit counting for the numba kernels (imported only when numba can be).

`popcount` is LLVM's ``ctpop``, one instruction on the CPUs this runs on (x86-64 with POPCNT,
arm64). The compiled dedup ranks a row by counting the bits set before it in the batch's
bitmap instead of keeping a rank per row (`kernels._list_marked`).
"""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic


@intrinsic
def popcount(typingctx, x):
    """The number of bits set in ``x`` (a uint64), as a uint64."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen
