"""How a cached collection's run ends: `CollectionLifetime`, the part of a collection that owns
its store (or not) and closes it, at `close`, at the end of ``with collection:`` or at the
interpreter's exit."""

from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
import weakref
from typing import Any

import torch

from embcache.engine.group import EngineGroup
from embcache.kv.base import Store
from embcache.kv.host import HostKV
from embcache.kv.url import open_store


class CollectionLifetime:
    """A collection's store and the end of its run.

    A store the collection opened (a URL, None) is its own: `close` closes it (a Redis tier
    releases its owner leases, so the next job opens the tables at once). A `Store` given is
    its owner's: `close` flushes it (`Store.flush`: a tiered store writes its host rows
    through) and leaves it open.

    Args:
        store: the tier as the options give it (a `Store`, a URL or None), opened here.
        device: the collection's device (on the meta device there is no row to write back).
    """

    def __init__(self, store: Store | str | None, device: torch.device) -> None:
        self.owns_store = not isinstance(store, Store)
        self.store = open_store(store)
        self.device = device
        self.closed = False
        self._engines: EngineGroup | None = None
        self._exit_hook: _CloseAtExit | None = None

    def watch(self, collection: Any, engines: EngineGroup) -> None:
        """Close ``collection`` at the interpreter's exit if it is still alive and open then
        (`close_at_exit`). Registered after the store was opened (and its own exit hook, a
        Redis tier's lease release), so it runs before it: atexit runs last-registered
        first."""
        self._engines = engines
        self._exit_hook = _CloseAtExit(collection)
        atexit.register(self._exit_hook)

    def close(self) -> None:
        """Drop pending gradients (and prefetch handles), write every dirty cached row back,
        then close the store if the collection owns it, else flush it. Idempotent; if the
        write-back fails nothing is closed and the rows stay dirty. Training calls are refused
        from then on (`EngineGroup.claim`)."""
        if self.closed:
            return
        engines, hook = self._engines, self._exit_hook
        assert engines is not None and hook is not None  # `watch` ran in the constructor
        if self.device.type != "meta":
            engines.zero_grad()  # waits for an in-flight prefetch before the write-back
            engines.flush()
        if self.owns_store:
            self.store.close()
        else:
            self.store.flush()
        self.closed = True
        engines.claim.closed = True  # training calls are refused from now on
        atexit.unregister(hook)

    def close_at_exit(self, collection: Any) -> None:
        """``collection.close()`` at the interpreter's exit; a failure is one line on stderr
        (the collection, the error, the dirty rows left unwritten), never a traceback."""
        if self.closed:
            return
        if isinstance(self.store, HostKV):
            return  # in-process rows end with the process: nothing to write back
        # concurrent.futures refuses new work once the interpreter is shutting down, so the
        # caches make their tier calls in turn (an instance attribute over the class's).
        self.store.parallel_io = False
        try:
            collection.close()
        except Exception as e:
            print(
                f"embcache: {type(collection).__name__} of tables "
                f"{[t.name for t in collection.tables]} on {self.store!r} could not write back "
                f"its cache at exit ({type(e).__name__}: {' '.join(str(e).split())}); "
                f"{self._dirty_rows()} dirty rows not written",
                file=sys.stderr,
            )

    def _dirty_rows(self) -> int | str:
        try:
            assert self._engines is not None
            return sum(int(cache.dirty.sum()) for cache in self._engines.caches())
        except Exception:
            return "an unknown number of"


class _CloseAtExit:
    """The exit hook of one collection: `CollectionLifetime.close_at_exit` if the collection is
    still alive (a weak reference: a collection garbage-collected before is skipped), in the
    process that built it only. A child forked from that process inherits the hook with a copy
    of the cache, whose dirty rows are older than what the parent has written since: writing
    them back at the child's exit would roll the parent's rows back."""

    def __init__(self, collection: Any) -> None:
        self._collection = weakref.ref(collection)
        self._pid = os.getpid()

    def __call__(self) -> None:
        if os.getpid() != self._pid:
            return
        _collect_garbage_once()
        collection = self._collection()
        if collection is not None:
            collection.lifetime.close_at_exit(collection)


@functools.cache
def _collect_garbage_once() -> None:
    """Collect unreachable reference cycles (a collection is one) before the first exit hook,
    so collections the program dropped are skipped rather than written back."""
    gc.collect()
