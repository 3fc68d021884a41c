"""Shared set-up of the RecStore layer's tests: a fresh process KV client per test, and tiers
whose calls a test can hold back."""

from __future__ import annotations

import threading
import time

import pytest

import embcache

TIMEOUT_S = 10.0  # bound on every wait, so a broken client fails instead of hanging


@pytest.fixture(autouse=True)
def fresh_kv_client():
    embcache.reset_kv_client()
    yield
    embcache.reset_kv_client()


class GatedKV(embcache.HostKV):
    """A HostKV whose writes (``gate``) and reads (``read_gate``) wait until the test opens them
    (both open by default); ``writing`` / ``reading`` are set once a call waits there."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.read_gate = threading.Event()
        self.read_gate.set()
        self.delay = delay
        self.writing = threading.Event()
        self.reading = threading.Event()
        self.gets = 0

    def put(self, table, ids, rows) -> None:
        self.writing.set()
        assert self.gate.wait(TIMEOUT_S), "the test never opened the gate"
        if self.delay:
            time.sleep(self.delay)
        super().put(table, ids, rows)

    def get(self, table, ids):
        self.gets += 1
        self.reading.set()
        assert self.read_gate.wait(TIMEOUT_S), "the test never opened the read gate"
        return super().get(table, ids)
