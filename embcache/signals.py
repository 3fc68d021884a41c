"""`flush_on_signal`: a library script's one line for SIGTERM/SIGINT.

``embcache train`` finishes its step, flushes, checkpoints and exits when it is signalled
(`embcache.cli.job`). A script of one's own dies at SIGTERM with its dirty cached rows unwritten
and, on a Redis tier, its tables' owner leases held until their TTL lapses. One call fixes
that::

    model = MyModel()                  # holding cached collections, DistEmbeddings
    embcache.flush_on_signal(model)    # SIGTERM and SIGINT by default

At the signal every cached collection found in the given modules is closed (`close`: pending
gradients dropped, dirty rows written back, a store it opened closed and its leases released, a
store it was given flushed), every ``DistEmbedding`` is flushed, and the signal then does what
it did before: the previous Python handler runs (SIGINT's raises ``KeyboardInterrupt``), or
the process ends by the signal itself (exit status 128 + its number in a shell, ``-signum`` to
`subprocess`), as it would have without embcache.

A signal that arrives while the main thread runs embcache's code (a forward, a step, a flush)
waits until that call returns to the caller, so the rows written back are those between two
calls, never a cache half-way through an update. A second signal meanwhile is ignored.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Any

from torch import nn

from embcache.engine.interface import CachedCollectionInterface
from embcache.recstore.dist_embedding import DistEmbedding

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_THIS = os.path.abspath(__file__)


class SignalFlush:
    """The handlers `flush_on_signal` installed (see the module docstring). `remove` puts the
    previous handlers back; ``with flush_on_signal(model):`` removes them on leaving."""

    def __init__(self, modules: Iterable[Any], signals: Sequence[int]) -> None:
        self.collections: list[CachedCollectionInterface] = []
        self.dist_embeddings: list[DistEmbedding] = []
        for m in modules:
            found = m.modules() if isinstance(m, nn.Module) else [m]
            for sub in found:
                if isinstance(sub, CachedCollectionInterface):
                    self.collections.append(sub)
                elif isinstance(sub, DistEmbedding):
                    self.dist_embeddings.append(sub)
        if not self.collections and not self.dist_embeddings:
            raise ValueError(
                "flush_on_signal: no cached collection or DistEmbedding in the modules given "
                f"({', '.join(type(m).__name__ for m in modules) or 'none'})"
            )
        self.signals = tuple(signal.Signals(s) for s in signals)
        self._previous: dict[int, Any] = {}
        self._pending: int | None = None
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def remove(self) -> None:
        """Put back the handlers that were there before (idempotent)."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        self._previous = {}

    def __enter__(self) -> SignalFlush:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- the signal ---------------------------------------------------------------------------

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._pending is not None:
            return  # already on its way out
        self._pending = signum
        inside = _outermost_embcache_frame(frame)
        if inside is None:
            self._finish()
            return

        # Wait for the embcache call to return to its caller: a profile function sees it.
        def profile(f: FrameType, event: str, arg: Any) -> None:
            if f is inside and event == "return":
                sys.setprofile(None)
                self._finish()

        sys.setprofile(profile)

    def _finish(self) -> None:
        signum = self._pending
        assert signum is not None
        for c in self.collections:
            try:
                c.close()
            except Exception as e:
                print(
                    f"embcache: at {signal.Signals(signum).name}, {type(c).__name__} of tables "
                    f"{[t.name for t in c.tables]} could not write back its cache "
                    f"({type(e).__name__}: {' '.join(str(e).split())})",
                    file=sys.stderr,
                )
        for d in self.dist_embeddings:
            try:
                d.flush()
            except Exception as e:
                print(
                    f"embcache: at {signal.Signals(signum).name}, DistEmbedding could not "
                    f"flush ({type(e).__name__}: {' '.join(str(e).split())})",
                    file=sys.stderr,
                )
        previous = self._previous.get(signum, signal.SIG_DFL)
        self.remove()
        self._pending = None
        if callable(previous):
            previous(signum, None)  # SIGINT's default raises KeyboardInterrupt here
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # end as the signal ends a process


def _outermost_embcache_frame(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of embcache's code on the interrupted stack (this module's aside),
    or None when the main thread was outside it."""
    found = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE) and name != _THIS:
            found = frame
        frame = frame.f_back
    return found


def flush_on_signal(
    *modules: Any, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)
) -> SignalFlush:
    """At ``signals``, close every cached collection in ``modules`` (dirty rows written back,
    leases released) and flush every ``DistEmbedding``, then let the signal end the process as
    it would have (see the module docstring). Call it from the main thread.

    Args:
        modules: models (``nn.Module`` trees are searched), cached collections,
            ``DistEmbedding`` objects.
        signals: the signals handled.

    Returns:
        The installed `SignalFlush` (``remove()`` puts the previous handlers back).

    Raises:
        ValueError: nothing to flush among ``modules``, or not on the main thread (Python's
            own refusal).
    """
    return SignalFlush(modules, signals)
