"""Compiled CPU kernels (numba) for the cache's per-batch bookkeeping on a CPU.

A CPU resolve is a few thousand row moves and a few passes over the batch's ids. Written as
torch ops it is 100-150 calls, each with its own dispatch, allocation and pass over memory, and
those calls cost more than the embedding work itself (FBGEMM's TBE). Here the same steps
are loops compiled by numba, over numpy views of the cache's own tensors (no copy): one pass
where the torch path makes several.

Each kernel computes exactly what the torch code it stands for computes (the specification,
run under the ``torch`` backend, on a GPU, and wherever numba cannot be imported). Which one
runs is `embcache.backend`'s choice (its ``native`` family). The kernels live in modules by
what they serve, imported by their callers at the first call (numba is imported with them):

* `plan_kernels`: over a cache's rows: the key check, the plan (LRU, exactly counted LFU),
  the reservation, the scratch rows' release, the locks and the bitmap dedup;
* `row_kernels`: row moves (a cache's slots, its stored rows, a dense tier table's rows and
  ``created`` mask, several tables in one pass), writes at positions, the hashed initialiser,
  the grouping of a tier transfer's ids by table, the TBE step's sample-major bags;
* `direct_kernels`: a direct share's distinct rows;
* `bits`, `prefetch` and `jit`: their shared helpers.

Their callers are the op families' numba implementations (`ops.ids.native`, `ops.plan.native`,
`ops.rows.native`), which hold a cache's bound choice, and the host tier's dense tables
(`kv.host_tables`), which chose when declared: each call goes from there straight to its
kernel. This module keeps what they share: `OutOfRangeError` (a position a pass refused,
nothing written), the ``GROUP_*`` outcomes of the grouping, whether numba imports here
(`importable`) and when one of the kernels compiles (`on_compile`). The kernels release the
GIL (a prefetch thread's resolve overlaps the training thread) and are cached on disk after
their first compilation (``cache=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

GROUP_SORTED = 0  # `group_by_table`: the ids were grouped already (``raw`` holds them)
GROUP_BY_COUNTS = 1  # grouped by a counting sort (``order``, ``raw`` in that order)
GROUP_NEEDS_SORT = 2  # neither: the caller sorts


class OutOfRangeError(IndexError):
    """A compiled pass was given a position out of its array's range and wrote nothing.

    Attributes:
        position: where in the positions given the first bad one is.
    """

    def __init__(self, what: str, value: int, position: int, size: int) -> None:
        super().__init__(
            f"{what} {value} at position {position} is out of bounds for dimension 0 with "
            f"size {size} (nothing was written)"
        )
        self.position = position


# ----------------------------------------------------------------------------------------------
# numba: whether it imports here, and its compilations
# ----------------------------------------------------------------------------------------------


_NUMBA: list = []  # [njit or None], filled on first use


def _njit() -> Any | None:
    if not _NUMBA:
        try:
            from numba import njit
        except Exception:  # absent (the GPU image), or a build that does not load here
            njit = None
        _NUMBA.append(njit)
    return _NUMBA[0]


def importable() -> bool:
    """Whether numba imports here, so that the kernels can run (`embcache.backend` chooses
    whether they do)."""
    return _njit() is not None


def _is_ours(dispatcher: Any) -> bool:
    """Whether a numba dispatcher compiles one of embcache's kernels."""
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", None) or ""
    return module == "embcache" or module.startswith("embcache.")


@contextmanager
def on_compile(callback: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``callback()`` (on the compiling thread) as each compilation of one
    of embcache's kernels starts: a kernel's first use with no entry in the disk cache (a load
    from it is none). numba's own helpers, which it compiles afresh in every process (those
    of ``numba.typed.List``, uncached), are not embcache's kernels and call nothing.
    Without numba, never."""
    if _njit() is None:
        yield
        return
    from numba.core import event

    class _Started(event.Listener):
        def on_start(self, started: Any) -> None:
            if _is_ours(started.data.get("dispatcher")):
                callback()

        def on_end(self, _event: Any) -> None:
            pass

    listener = _Started()
    event.register("numba:compile", listener)
    try:
        yield
    finally:
        event.unregister("numba:compile", listener)
