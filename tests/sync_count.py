"""Counting host synchronisations on the CPU, where none of them costs anything.

On a GPU, reading a device value on the host (``.item()``, ``.tolist()``, ``int(t)``,
``bool(t)``, ``.cpu()``) waits for every kernel queued before it, and so do ops whose output
size depends on the data (``nonzero``, ``unique*``, boolean-mask indexing, ``repeat_interleave``
without ``output_size``, ``bincount``). `SyncCounter` counts both kinds while it is active, so a
test on the CPU can bound what the same code would cost on a GPU.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
_HOST_SIDE = ("embcache.kv.", "embcache.cache.transfer", "embcache.checkpoint")
_SHARED = (
    "embcache.indexing",
    "embcache.backend",
    "embcache.hashing",
    "embcache.ops.rows.spec",
    "embcache.ops.rows.native",
)


def _on_host_side() -> bool:
    """Whether the op runs in code that only ever sees host tensors: the tiers (their ids and
    rows are on the host by the `Store` contract). The innermost embcache frame decides, past
    `embcache.indexing`, `embcache.backend`, `embcache.hashing` and the rows family's host
    writes (`ops.rows.spec`, `ops.rows.native`), which run for both sides (their caller
    decides)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("embcache.") and name not in _SHARED:
            return name.startswith(_HOST_SIDE)
        frame = frame.f_back
    return False


_DATA_DEPENDENT = {
    "aten.nonzero",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.masked_select",
    "aten.bincount",
    "aten._local_scalar_dense",
}


class _Reads:
    """Host reads, counted by patching `torch.Tensor`'s methods while active: a
    ``TorchFunctionMode`` would miss those made in autograd's backward, whose engine does not
    carry the mode (a read in a custom Function's backward went uncounted that way)."""

    def __init__(self, counts: Counter) -> None:
        self.counts = counts
        self._saved: dict[str, object] = {}

    def __enter__(self) -> None:
        # The entering thread's reads only, as the dispatch mode (thread-local) counts ops: a
        # prefetch worker's reads stall the worker, not the training (on the CPU, autograd
        # runs the backward on the thread that called it).
        thread = threading.get_ident()
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(t, *args, _name=name, _original=original, **kwargs):
                if threading.get_ident() == thread and not _on_host_side():
                    self.counts[_name] += 1
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, counted)

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if _on_host_side():
            pass
        elif name in _DATA_DEPENDENT:
            # item/int/bool reach here as _local_scalar_dense too: counted once, above.
            if name != "aten._local_scalar_dense":
                self.counts[name] += 1
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ())
        ):
            self.counts["bool-mask index"] += 1
        elif name == "aten.repeat_interleave" and (kwargs or {}).get("output_size") is None:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """``with SyncCounter() as c: ...`` then ``c.total`` and ``c.counts`` (by kind)."""

    def __enter__(self) -> SyncCounter:
        self.counts: Counter = Counter()
        self._modes = [_Reads(self.counts), _Ops(self.counts)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
