"""The prefetch machinery alone (`embcache.engine.prefetch`), with jobs that only record what
they hold: the worker runs one job at a time in issue order on a thread that exits when idle,
and every rule that releases an unused handle does so exactly once (a job still running is
waited for first)."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from embcache.engine.batch_state import Prefetched, Prepared
from embcache.engine.inputs import JaggedBatch
from embcache.engine.prefetch import Prefetcher, SerialWorker

TIMEOUT_S = 10.0


def batch(*values: int) -> JaggedBatch:
    return JaggedBatch.from_lengths(["f"], torch.tensor(values), torch.tensor([len(values)]))


def share(seq: int) -> Prepared:
    """A stand-in for one cache's locked share, tagged with its prefetch's number."""
    empty = torch.empty(0, dtype=torch.int64)
    return Prepared(torch.tensor([seq]), empty, empty, empty, None, True)


class Recorder:
    """A Prefetcher whose jobs lock a tagged share, and the shares it released."""

    def __init__(self) -> None:
        self.released: list[int] = []
        self.prefetcher = Prefetcher(self.release, torch.device("cpu"))
        self.gate = threading.Event()
        self.gate.set()

    def release(self, prepared: list[Prepared | None]) -> None:
        self.released += [int(p.unique[0]) for p in prepared if p is not None]

    def job(self, seq: int) -> Prefetched:
        assert self.gate.wait(TIMEOUT_S)
        return Prefetched([share(seq)])

    def issue(self, features: JaggedBatch):
        return self.prefetcher.issue(1, 0, features, self.job)

    def forward(self, features: JaggedBatch) -> int | None:
        """A forward's use of the prefetcher: the seq of the share it got, or None."""
        got = self.prefetcher.use(self.prefetcher.take(features))
        return None if got is None else int(got.prepared[0].unique[0])


def test_worker_keeps_its_thread_between_calls_a_step_apart() -> None:
    """A training loop submits once a step: a call that comes within ``linger_s`` of the last
    one finishing runs on the same thread (no thread started per step), and the thread exits
    once no call has come for that long."""
    worker = SerialWorker("embcache-test-linger", linger_s=5.0)
    first = worker.submit(threading.current_thread).result(TIMEOUT_S)
    time.sleep(0.05)  # the first call is done: the old worker's thread would have exited
    second = worker.submit(threading.current_thread).result(TIMEOUT_S)
    assert second is first and first is not threading.current_thread()
    quick = SerialWorker("embcache-test-linger-short", linger_s=0.01)
    thread = quick.submit(threading.current_thread).result(TIMEOUT_S)
    thread.join(TIMEOUT_S)
    assert not thread.is_alive()
    assert quick.submit(lambda: 7).result(TIMEOUT_S) == 7  # a new thread for a new burst


def test_worker_runs_in_order_on_a_thread_that_exits_when_idle() -> None:
    worker = SerialWorker("embcache-test-worker")
    seen: list[tuple[int, str]] = []
    gate = threading.Event()

    def job(i: int) -> int:
        assert gate.wait(TIMEOUT_S)
        seen.append((i, threading.current_thread().name))
        if i == 3:
            raise ValueError("job 3 fails")
        return i * 10

    futures = [worker.submit(job, i) for i in range(5)]
    threads = [t for t in threading.enumerate() if t.name == "embcache-test-worker"]
    assert len(threads) == 1, "one thread for a burst of work"
    gate.set()
    assert [f.result(TIMEOUT_S) for f in futures[:3]] == [0, 10, 20]
    with pytest.raises(ValueError, match="job 3 fails"):
        futures[3].result(TIMEOUT_S)
    assert futures[4].result(TIMEOUT_S) == 40
    assert [i for i, _ in seen] == list(range(5))
    threads[0].join(TIMEOUT_S)
    assert not threads[0].is_alive(), "an idle worker keeps no thread"
    assert worker.submit(job, 7).result(TIMEOUT_S) == 70  # a new burst starts a new thread


def test_the_recorded_handle_is_used_and_nothing_is_released() -> None:
    r = Recorder()
    a = batch(1, 2)
    handle = r.issue(a)
    assert r.prefetcher.recorded is handle
    assert r.forward(a) == handle.state.seq
    assert handle.used and r.released == [] and not r.prefetcher.issued


def test_a_replaced_handle_nobody_holds_is_released_at_the_next_call() -> None:
    r = Recorder()
    a = batch(1)
    first = r.issue(a)
    seq = first.state.seq
    r.issue(a)  # records the newer one; the caller still holds the first
    assert r.released == []
    del first
    gc.collect()
    assert r.released == []  # not from the finalizer itself ...
    r.prefetcher.collect_dropped()
    assert r.released == [seq]  # ... but at the collection's next call


def test_a_handle_for_other_features_is_released_and_an_explicit_one_raises() -> None:
    r = Recorder()
    handle = r.issue(batch(1))
    assert r.forward(batch(2)) is None  # recorded by issuing: the forward reads synchronously
    assert r.released == [handle.state.seq]
    handle = r.issue(batch(1))
    r.prefetcher.record(handle, explicit=True)
    with pytest.raises(ValueError, match="other features"):
        r.forward(batch(2))
    assert r.released[-1] == handle.state.seq


def test_a_forward_releases_older_handles_and_those_two_forwards_passed_by() -> None:
    r = Recorder()
    a, b = batch(1), batch(2)
    old, kept, used = r.issue(a), r.issue(b), r.issue(a)
    r.prefetcher.record(used, explicit=True)
    next_one = r.issue(b)  # a pipeline issues the next batch before this forward
    r.prefetcher.record(used, explicit=True)
    assert r.forward(a) == used.state.seq
    assert sorted(r.released) == [old.state.seq, kept.state.seq]  # older than the one used
    r.prefetcher.record(next_one, explicit=True)
    assert r.forward(b) == next_one.state.seq  # the next forward still gets its handle
    stray = r.issue(a)
    r.prefetcher.record(None, explicit=True)
    assert r.forward(a) is None and stray.state.seq not in r.released  # passed by once
    assert r.forward(a) is None and r.released[-1] == stray.state.seq  # twice: released


def test_release_waits_for_a_running_job_and_happens_once() -> None:
    r = Recorder()
    r.gate.clear()
    handle = r.issue(batch(1))
    assert not handle.done()
    releasing = threading.Thread(target=r.prefetcher.release_all)
    releasing.start()
    releasing.join(0.2)
    assert releasing.is_alive(), "release must wait for the job that is locking the slots"
    r.gate.set()
    releasing.join(TIMEOUT_S)
    assert r.released == [handle.state.seq] and handle.used
    r.prefetcher.release(handle.state)
    del handle
    gc.collect()
    r.prefetcher.collect_dropped()
    assert r.released == [1], "a handle is released once"


def test_a_failed_prefetch_holds_nothing_and_its_forward_reads_synchronously() -> None:
    r = Recorder()

    def failing(seq: int) -> Prefetched:
        raise ConnectionError("tier unavailable")

    handle = r.prefetcher.issue(1, 0, batch(1), failing)
    assert isinstance(handle.wait(), ConnectionError)
    assert r.forward(batch(1)) is None
    assert r.released == [] and handle.used
