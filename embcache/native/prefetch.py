"""Software prefetch for the numba kernels (imported only when numba can be).

The kernels' row moves and index updates touch rows at random in arrays far larger than the
CPU's caches (a tier table, a cache's slot storage, the row index), so each access waits for
memory. The CPU overlaps only the few misses its reorder window reaches; telling it a few rows
ahead which lines come next keeps more of them in flight (random 260-byte row gathers out of a
cache's slots: 1.5-2x faster; out of a tier's tables, 1.15x). Only reads gain: the same hint
before scattered writes changed nothing measurable, so the scatters go without. A prefetch is
a hint: it never faults, even past an array's end, and changes no value.

    for i in range(n):
        if i + AHEAD < n:
            prefetch_row(rows, ids[i + AHEAD])  # lines of the row needed AHEAD rows later
        ...                                     # use rows[ids[i]]
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from embcache.native.jit import jit

# How many rows ahead the kernels ask for: far enough to cover memory's latency at a few
# nanoseconds of work a row, near enough that the lines are still cached when used.
AHEAD = 16
_LINE = 64  # bytes in a cache line on the CPUs this runs on (x86-64, arm64)

_i32 = ir.IntType(32)


@intrinsic
def _prefetch_at(typingctx, arr, byte_offset):
    """Ask for the line at ``arr``'s data pointer + ``byte_offset`` bytes, to read it."""
    if not isinstance(arr, types.Array) or not isinstance(byte_offset, types.Integer):
        return None
    sig = types.void(arr, byte_offset)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        address = builder.gep(base, [offset])
        fnty = ir.FunctionType(ir.VoidType(), [address.type, _i32, _i32, _i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch")
        # (address, 0: for a read, 3: keep it in every cache level, 1: a data line)
        builder.call(fn, [address, ir.Constant(_i32, 0), ir.Constant(_i32, 3),
                          ir.Constant(_i32, 1)])  # fmt: skip
        return context.get_dummy_value()

    return sig, codegen


@jit
def prefetch_row(arr, r):
    """Ask for every line of row ``r`` of 2-D ``arr``, to read it."""
    start = r * arr.strides[0]
    nbytes = arr.shape[1] * arr.itemsize
    for b in range(0, nbytes, _LINE):
        _prefetch_at(arr, start + b)
    if nbytes:
        _prefetch_at(arr, start + nbytes - 1)  # a row that starts inside a line


@jit
def prefetch_item(arr, i):
    """Ask for the line of element ``i`` of 1-D ``arr``, to read it."""
    _prefetch_at(arr, i * arr.strides[0])


@jit
def prefetch_span(arr, start, count):
    """Ask for the lines of elements ``start .. start + count`` of 1-D ``arr``, to read them."""
    step = arr.strides[0]
    first = start * step
    last = (start + count) * step - 1
    for b in range(first, last, _LINE):
        _prefetch_at(arr, b)
    if count:
        _prefetch_at(arr, last)
