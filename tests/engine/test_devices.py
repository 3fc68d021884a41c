"""Unindexed CUDA devices (`embcache.devices.resolve_device`) and a prefetch worker that cannot
take its device.

torch refuses ``torch.cuda.set_device(torch.device("cuda"))`` (no index); a worker thread that
called it died before running its job, and the job's future was waited on forever. These tests
emulate torch's own check on the CPU: ``set_device`` runs ``torch.cuda._utils._get_device_index``
(which raises for a CUDA device without an index, as the real call does) and
``current_device`` says 0. Every wait has a generous timeout: a hang fails the test, and no
verdict rests on how long something took.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
from torch.cuda._utils import _get_device_index

import embcache
import embcache.engine.interface as interface_module
import embcache.engine.prefetch as prefetch_module
from embcache.devices import resolve_device
from embcache.engine.batch_state import Prefetched
from embcache.engine.inputs import JaggedBatch
from embcache.engine.prefetch import Prefetcher, SerialWorker

WAIT_S = 60.0  # a ceiling against hangs, never a measure
CUDA = torch.device("cuda")


class EmulatedCuda:
    """``torch.cuda.set_device`` with torch's index check, and a current device of 0; records
    the devices set and the threads that set them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[torch.device, str]] = []
        self.error: BaseException | None = None  # set: set_device raises it after the check
        self.gate = threading.Event()  # set_device waits for it
        self.gate.set()
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def set_device(self, device: torch.device) -> None:
        assert self.gate.wait(WAIT_S)
        _get_device_index(device)  # raises for torch.device("cuda"), as torch does
        self.calls.append((device, threading.current_thread().name))
        if self.error is not None:
            raise self.error


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> EmulatedCuda:
    return EmulatedCuda(monkeypatch)


def test_the_emulation_refuses_what_torch_refuses(cuda: EmulatedCuda) -> None:
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(CUDA)
    torch.cuda.set_device(torch.device("cuda", 0))
    assert cuda.calls == [(torch.device("cuda", 0), threading.current_thread().name)]


# -- resolve_device ----------------------------------------------------------------------------


def test_resolve_device_gives_cuda_the_current_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device(CUDA) == torch.device("cuda", 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # an index is kept
    assert resolve_device(2) == torch.device("cuda", 2)
    for other in ("cpu", torch.device("cpu"), "meta"):
        assert resolve_device(other) == torch.device(other)


@pytest.mark.parametrize("bad", [None, 1.5, True, ["cuda"]])
def test_resolve_device_refuses_other_types(bad: object) -> None:
    with pytest.raises(TypeError, match="device must be"):
        resolve_device(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["nodevice", "cuda:x", -1])
def test_resolve_device_refuses_what_is_no_device(bad: object) -> None:
    with pytest.raises(ValueError, match="not a device"):
        resolve_device(bad)  # type: ignore[arg-type]


# -- SerialWorker -----------------------------------------------------------------------------


def test_worker_on_unindexed_cuda_runs_its_call(cuda: EmulatedCuda) -> None:
    worker = SerialWorker("x", CUDA)
    assert worker.device == torch.device("cuda", 0)
    assert worker.submit(lambda: 1).result(timeout=WAIT_S) == 1
    assert cuda.calls == [(torch.device("cuda", 0), "x")]  # set on the worker's thread


def test_worker_whose_device_setup_raises_fails_every_queued_call(cuda: EmulatedCuda) -> None:
    """Every call queued for the thread fails with the setup's error; the next submit tries
    again with a new thread, and runs once the device can be set."""
    worker = SerialWorker("x", torch.device("cuda", 0))
    cuda.error = RuntimeError("CUDA error: invalid device ordinal")
    cuda.gate.clear()  # hold the thread in set_device until every call is queued
    futures = [worker.submit(lambda i=i: i) for i in range(3)]
    cuda.gate.set()
    for future in futures:
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            future.result(timeout=WAIT_S)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        worker.submit(lambda: 4).result(timeout=WAIT_S)  # still failing: fails the same way
    cuda.error = None
    assert worker.submit(lambda: 5).result(timeout=WAIT_S) == 5
    assert len(cuda.calls) == 3  # a thread per attempt


def test_worker_given_an_unindexed_device_fails_instead_of_hanging(cuda: EmulatedCuda) -> None:
    """The original bug, past resolution: torch's check raises on the thread, and the call's
    future gets that error."""
    worker = SerialWorker("x")
    worker.device = CUDA  # as a worker built before resolution held it
    with pytest.raises(ValueError, match="specified index"):
        worker.submit(lambda: 1).result(timeout=WAIT_S)


def test_worker_whose_thread_cannot_start_fails_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = SerialWorker("x")

    class NoThread:
        def __init__(self, **_: object) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    fake = types.SimpleNamespace(Thread=NoThread)
    monkeypatch.setattr(prefetch_module, "threading", fake)
    future = worker.submit(lambda: 1)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        future.result(timeout=WAIT_S)
    monkeypatch.undo()
    assert worker.submit(lambda: 2).result(timeout=WAIT_S) == 2  # the next one starts


# -- a prefetching collection on torch.device("cuda") ------------------------------------------


def _tables() -> list[embcache.TableConfig]:
    return [
        embcache.TableConfig(name="t", embedding_dim=4, num_embeddings=100, feature_names=["f"])
    ]


def _batch() -> JaggedBatch:
    return JaggedBatch.from_lengths(["f"], torch.tensor([1, 2, 3]), torch.tensor([2, 1]))


def test_prefetcher_on_unindexed_cuda_runs_its_job(cuda: EmulatedCuda) -> None:
    """What a collection builds for its prefetches, given ``cuda``: the worker sets cuda:0
    and the job's result reaches the forward."""
    prefetcher = Prefetcher(lambda prepared: None, CUDA)
    assert prefetcher.worker.device == torch.device("cuda", 0)
    batch = _batch()
    handle = prefetcher.issue(1, 0, batch, lambda seq: Prefetched([], error=None))
    got = prefetcher.use(prefetcher.take(batch))
    assert got is not None and got.error is None
    assert handle.state.future.done()
    assert cuda.calls == [(torch.device("cuda", 0), "embcache-prefetch")]


def test_collection_resolves_cuda_before_building_its_engines(
    cuda: EmulatedCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collection asked for ``cuda`` hands its engines (caches and prefetch worker) the
    resolved device. Stopped there: the caches' tensors need a real GPU."""
    seen: list[torch.device] = []

    class StopError(Exception):
        pass

    def engines(tables, specs, store, cache_config, device, *args):
        seen.append(device)
        raise StopError

    monkeypatch.setattr(interface_module, "EngineGroup", engines)
    with pytest.raises(StopError):
        embcache.CachedEmbeddingBagCollection(
            tables=_tables(), cache=embcache.CacheConfig(capacity=10), device=CUDA
        )
    assert seen == [torch.device("cuda", 0)]


def test_prefetching_collection_with_a_cuda_worker_runs(cuda: EmulatedCuda) -> None:
    """A collection's prefetch, its worker on ``torch.device("cuda")`` (the caches stay on the
    CPU, which is all this machine has): the worker sets cuda:0, the prefetch resolves, and
    the forward uses it instead of waiting forever."""
    ebc = embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0)
    ebc.engines.prefetches = Prefetcher(ebc.engines.release_shares, CUDA)
    batch = _batch()
    expected = embcache.CachedEmbeddingBagCollection(tables=_tables(), seed=0)(batch).values()
    handle = ebc.issue_fused_prefetch(batch)
    assert handle.state.result().error is None  # waits, with no timeout: a hang is the bug
    assert handle.state.future.result(timeout=WAIT_S).prepared  # the shares it resolved
    torch.testing.assert_close(ebc(batch).values(), expected)
    assert handle.state.used  # the forward took the prefetched shares
    assert cuda.calls == [(torch.device("cuda", 0), "embcache-prefetch")]
