"""A collection's prefetch handles: issued at once, resolved on a worker thread, recorded on the
module, and released whenever they can no longer be used.

    handle = module.issue_fused_prefetch(features)   # returns at once; the worker dedups and
                                                     # resolves (tier I/O) in the background
    module.set_fused_prefetch_handle(handle)         # optional: issuing recorded it already
    out = module(features)                           # waits only for what is left

A prefetch locks the slots it resolves, so a handle that is never used would hold them (and
any scratch rows) forever. Every way of leaving one behind releases it instead:

* **a newer handle**: issuing records the new handle on the module (RecStore's
  ``_fused_prefetch_handle``) in place of the older one, as `set_fused_prefetch_handle` does; the
  older one stays usable only while the caller holds it (see garbage collection);
* **the next forward** takes the recorded handle: issued for other features, it is released (a
  handle set explicitly for other features is also an error); once a forward used a handle,
  every handle issued before it is released; and a handle that two forwards passed by unused
  is released by the second (a pipeline issues batch i+1 before forward i, which must leave it);
* **zero_grad / reset_trace / invalidate_caches** release every handle;
* **garbage collection**: a handle nobody references is queued by its finalizer and released
  at the module's next call (never from the finalizer itself, which may run in the middle of a
  resolve).

Releasing a handle whose prefetch is still running waits for it first. The worker runs one
prefetch at a time, in issue order (the sharded collection's prefetches are collectives, which
every rank must make in the same order), on a thread that exists only while there is work.

On a GPU the worker's device work is ordered with the caller's, whatever stream the caller
trains on (`StreamHandoff`): a prefetch's kernels run on the stream that was current on the
thread that issued it (the worker's own thread would otherwise use the default stream, and a
model trained under another stream would read slots before the worker's writes land). On one
stream, the worker's kernels and the training thread's run in the order their host calls take
the cache's lock, so the cache's shared tensors are never written by two streams at once; the
tier copies alone overlap, on `TierTransfer`'s copy stream. The stream of the forward (or
release) that takes the result waits for the prefetch's last kernel, and the result's tensors
are marked used on it (``record_stream``), in case it is another stream than the issue's.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from embcache.devices import resolve_device
from embcache.engine.batch_state import FusedPrefetchHandle, Prefetched, PrefetchState, Prepared
from embcache.engine.inputs import JaggedBatch


class SerialWorker:
    """Runs submitted calls one at a time, in submission order, on a daemon thread that is
    started for a burst of work and exits once the queue has stayed empty for ``linger_s`` (an
    idle collection holds no thread; a training loop, which submits once a step, keeps one
    thread instead of starting one per step).

    A thread that cannot start, or whose device cannot be made current, fails every call
    queued for it with that error (their futures raise it); the next submit tries again with
    a new thread. No future is left waiting for a thread that is gone.

    Args:
        name: the thread's name.
        device: a CUDA device to make current on the thread (the training thread's may differ
            from the default), or None. ``cuda`` without an index is resolved here, on the
            caller's thread, to its current device (`embcache.devices.resolve_device`).
        linger_s: how long an idle thread waits for the next call before it exits.
    """

    def __init__(
        self, name: str, device: torch.device | str | None = None, linger_s: float = 0.05
    ) -> None:
        self.name = name
        device = None if device is None else resolve_device(device)
        self.device = device if device is not None and device.type == "cuda" else None
        self.linger_s = linger_s
        self._queue: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._wake = threading.Condition(threading.Lock())  # the queue; a submit wakes the thread
        self._running = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; its future holds the result, or the error it raised (or the
        error that kept the worker's thread from starting or taking its device)."""
        future: Future = Future()
        with self._wake:
            self._queue.append((future, fn, args))
            if self._running:
                self._wake.notify()
                return future
            self._running = True
            try:
                threading.Thread(target=self._run, name=self.name, daemon=True).start()
            except BaseException as err:  # e.g. "can't start new thread"
                failed, error = self._drain(), err
            else:
                return future
        _fail(failed, error)
        return future

    def _drain(self) -> list[Future]:
        """Take every queued call off the queue and mark the thread gone (the lock held)."""
        futures = [future for future, _, _ in self._queue]
        self._queue.clear()
        self._running = False
        return futures

    def _run(self) -> None:
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)
        except BaseException as err:
            with self._wake:
                failed = self._drain()
            _fail(failed, err)
            return
        while True:
            with self._wake:
                if not self._queue:
                    self._wake.wait(self.linger_s)
                if not self._queue:
                    self._running = False
                    return
                future, fn, args = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)
            del future, fn, args  # the worker keeps no reference to a finished call


def _fail(futures: list[Future], error: BaseException) -> None:
    """Fail calls that no thread will run (outside the queue's lock: a future's callbacks
    may submit again)."""
    for future in futures:
        if future.set_running_or_notify_cancel():
            future.set_exception(error)


def _tensors(obj: object, depth: int = 3) -> Iterator[torch.Tensor]:
    """The tensors in ``obj``: itself, or inside its lists, tuples, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth <= 0 or obj is None:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth - 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth - 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, field.name), depth - 1)


class StreamHandoff:
    """Orders a worker's device work with the stream of the thread that submitted it, and with
    the stream that later takes its result (a GPU only; see the module docstring).

    `wrap` is called on the submitting thread: it notes that thread's current stream and
    returns a job that, on the worker, runs with that stream current, so the job's kernels
    queue behind the caller's earlier work and ahead of its later work in the order the
    cache's lock gives their host calls: the cache's shared tensors (keys, scores, locks) are
    never written by two streams at once (the tier copies still run on `TierTransfer`'s copy
    stream, which waits for the current one). The job records an event in its result
    (`Prefetched.ready`); `take`, on the thread that uses the result, makes that thread's
    current stream wait for it (a forward under another stream than the issue's) and marks the
    result's tensors used on it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def wrap(self, job: Callable[[int], Prefetched]) -> Callable[[int], Prefetched]:
        caller = torch.cuda.current_stream(self.device)

        def run(seq: int) -> Prefetched:
            with torch.cuda.stream(caller):
                result = job(seq)
                done = torch.cuda.Event()
                done.record(caller)
            result.ready = done
            return result

        return run

    def on_caller(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` made to run on the submitting thread's current stream."""
        caller = torch.cuda.current_stream(self.device)

        def run() -> Any:
            with torch.cuda.stream(caller):
                return fn()

        return run

    def take(self, result: Prefetched) -> None:
        if result.ready is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(result.ready)
        for t in _tensors((result.prepared, result.payload)):
            if t.is_cuda:  # made on the issuing stream, maybe used and freed on another
                t.record_stream(stream)
        result.ready = None


class Prefetcher:
    """The prefetch handles of one collection (see the module docstring for the rules).

    Args:
        release_shares: gives back the locked shares of a prefetch that will not be used.
        device: the collection's device (made current on the worker thread).
    """

    def __init__(
        self,
        release_shares: Callable[[list[Prepared | None]], None],
        device: torch.device,
    ) -> None:
        self.worker = SerialWorker("embcache-prefetch", device)
        cuda = self.worker.device
        self.streams: StreamHandoff | None = None
        if cuda is not None and torch.cuda.is_available():
            self.streams = StreamHandoff(cuda)
        self.recorded: FusedPrefetchHandle | None = None  # the handle the next forward uses
        self.explicit = False  # recorded by set_fused_prefetch_handle, not by issuing
        self.issued: list[PrefetchState] = []  # neither used nor released, in issue order
        self.seq = 0
        # Filled by handles' finalizers, emptied by `collect_dropped`. With ``issued`` and
        # ``recorded`` empty too there is nothing to take or release: `EngineGroup` skips it.
        self.dropped: deque[PrefetchState] = deque()
        self._passed_by = 0  # the last seq issued before the previous forward
        self._release_shares = release_shares

    def _submit(self, job: Callable[[int], Prefetched]) -> PrefetchState:
        self.seq += 1
        if self.streams is not None:
            job = self.streams.wrap(job)
        return PrefetchState(self.seq, self.worker.submit(job, self.seq))

    def submit_after(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn()`` on the worker after the prefetches issued so far, on their stream."""
        return self.worker.submit(self.streams.on_caller(fn) if self.streams else fn)

    def _result(self, state: PrefetchState) -> Prefetched:
        """The prefetch's result, its device work ordered before this thread's stream."""
        result = state.result()
        if self.streams is not None:
            self.streams.take(result)
        return result

    def issue(
        self,
        module_id: int,
        generation: int,
        batch: JaggedBatch,
        job: Callable[[int], Prefetched],
        source: object = None,
    ) -> FusedPrefetchHandle:
        """Queue ``job(seq)`` on the worker and record its handle for the next forward
        (``batch`` is the checked batch, ``source`` the features object it was made of)."""
        self.collect_dropped()
        state = self._submit(job)
        handle = FusedPrefetchHandle(
            module_id, generation, list(batch.keys()), batch.lengths(), batch.values(), state,
            source, batch,
        )  # fmt: skip
        state.finalizer = weakref.finalize(handle, self.dropped.append, state)
        self.issued.append(state)
        self.record(handle, explicit=False)
        return handle

    def issue_refused(self, job: Callable[[int], Prefetched]) -> None:
        """Queue ``job(seq)`` for a prefetch whose input was refused: it holds no handle, but
        its seq is spent (a sharded collection still makes the prefetch's collectives)."""
        self._submit(job)

    def record(self, handle: FusedPrefetchHandle | None, explicit: bool) -> None:
        self.collect_dropped()
        self.recorded, self.explicit = handle, explicit and handle is not None

    def take(self, batch: JaggedBatch) -> FusedPrefetchHandle | None:
        """The recorded handle, for a forward on ``batch`` (the record is cleared). One issued
        for other features is released: an error when it was set explicitly, else the forward
        reads synchronously."""
        self.collect_dropped()
        handle, explicit = self.recorded, self.explicit
        self.recorded, self.explicit = None, False
        if handle is not None and not handle.issued_for(batch):
            self.release(handle.state)
            if explicit:
                raise ValueError(
                    "prefetch handle was issued for other features than this forward's; "
                    "it has been released"
                )
            handle = None
        return handle

    def use(self, handle: FusedPrefetchHandle | None) -> Prefetched | None:
        """Wait for ``handle``'s prefetch and hand its shares to a forward (None: no handle,
        or its prefetch failed and was released; the forward reads synchronously). Then release
        every handle that can no longer be used."""
        result = None
        used = 0  # the seq of the prefetch this forward uses
        if handle is not None:
            state = handle.state
            result = self._result(state)
            if result.error is not None:
                self.release(state)
                result = None
            else:
                self._forget(state)
                state.used = True
                used = state.seq
        if self.issued:  # none in a loop without prefetch: no copy of the list to walk
            for state in list(self.issued):
                if state.seq < used or state.seq <= self._passed_by:
                    self.release(state)
        self._passed_by = self.seq
        return result

    def release(self, state: PrefetchState) -> None:
        """Give back the slots of a prefetch that will not be used (waits for it first)."""
        if state.used or state.released:
            return
        self._forget(state)
        state.released = True
        self._release_shares(self._result(state).prepared)
        if self.recorded is not None and self.recorded.state is state:
            self.recorded, self.explicit = None, False

    def release_all(self) -> None:
        self.collect_dropped()
        for state in list(self.issued):
            self.release(state)
        self.recorded, self.explicit = None, False

    def collect_dropped(self) -> None:
        """Release the handles garbage collection found unreferenced."""
        while self.dropped:
            self.release(self.dropped.popleft())

    def _forget(self, state: PrefetchState) -> None:
        if state in self.issued:
            self.issued.remove(state)
        if state.finalizer is not None:
            state.finalizer.detach()
