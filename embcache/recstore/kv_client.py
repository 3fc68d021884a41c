"""A KV client with RecStore's calls (`init_data`, `pull`, `push`, `update_async`, ...) over a tier.

    kv = get_kv_client()
    kv.init_data("user", (1000, 16), torch.float32)
    rows = kv.pull("user", ids)                 # [n, 16]
    handle = kv.update_async("user", ids, deltas)   # rows += deltas, in the background
    kv.pull("user", ids)                        # sees the update: read-your-writes

Every operation goes through one worker thread in submission order, so asynchronous updates keep
their order and a later `pull` (which queues behind them) always sees them. `update_async` adds
its values to the rows (duplicate ids summed): a gradient step is ``update_async(name, ids,
-lr * grads)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from embcache.kernels.ids import dedup
from embcache.kv.base import Store, TableSpec
from embcache.kv.url import open_store

InitFunc = Callable[[tuple[int, int], torch.dtype], torch.Tensor]
"""DGL/RecStore style: ``init_func(shape, dtype) -> tensor of that shape``."""


@dataclass(frozen=True)
class _Tensor:
    shape: tuple[int, int]
    dtype: torch.dtype


class KVHandle:
    """A pending asynchronous operation; `KVClient.wait` / `wait_and_get` resolve it."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()


class KVClient:
    """Named 2-D float tensors stored row-wise in a tier, read and written by id.

    Args:
        store: the tier (a `Store`, a URL, or None for an in-process HostKV).
    """

    def __init__(self, store: Store | str | None = None) -> None:
        self.store = open_store(store)
        self._tensors: dict[str, _Tensor] = {}
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embcache-kv")

    # ------------------------------------------------------------------------------------------

    def init_data(
        self,
        name: str,
        shape: tuple[int, int],
        dtype: torch.dtype = torch.float32,
        init_func: InitFunc | None = None,
    ) -> None:
        """Declare a tensor. Declaring the same name again with the same shape and dtype is a
        no-op (several modules may share a tensor); another shape or dtype is a ValueError.

        Rows start at ``init_func(shape, dtype)`` when given (materialised once, here), else at
        the default per-id initialiser (uniform in ±sqrt(1/rows), independent of access order).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
        if len(shape) != 2 or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape
        ):
            raise ValueError(
                f"tensor {name!r}: shape must be (rows, dim) positive ints, got {shape!r}"
            )
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise TypeError(f"tensor {name!r}: dtype must be a floating dtype, got {dtype}")
        meta = _Tensor((int(shape[0]), int(shape[1])), dtype)
        with self._lock:
            known = self._tensors.get(name)
            if known is not None:
                if known != meta:
                    raise ValueError(
                        f"tensor {name!r} exists with shape {known.shape} and dtype {known.dtype}; "
                        f"cannot redeclare it as {meta.shape}, {dtype}"
                    )
                return
            initial = None
            if init_func is not None:
                initial = init_func(meta.shape, dtype)
                if tuple(initial.shape) != meta.shape:
                    raise ValueError(
                        f"tensor {name!r}: init_func returned shape {tuple(initial.shape)}, "
                        f"expected {meta.shape}"
                    )
            self.store.init_table(TableSpec(name, meta.shape[1], meta.shape[0]))
            if initial is not None:
                self.store.put(name, torch.arange(meta.shape[0]), initial.float().cpu())
            self._tensors[name] = meta

    def shape(self, name: str) -> tuple[int, int]:
        return self._meta(name).shape

    def _meta(self, name: str) -> _Tensor:
        if name not in self._tensors:
            raise KeyError(f"unknown tensor {name!r}; declared: {sorted(self._tensors)}")
        return self._tensors[name]

    def _ids(self, name: str, ids) -> torch.Tensor:
        meta = self._meta(name)
        ids = torch.as_tensor(ids)
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"tensor {name!r}: ids must be integers, got dtype {ids.dtype}")
        ids = ids.reshape(-1).to(torch.int64).cpu()
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= meta.shape[0]:
                bad = lo if lo < 0 else hi
                raise ValueError(f"tensor {name!r}: id {bad} out of range [0, {meta.shape[0]})")
        return ids

    def _rows(self, name: str, ids: torch.Tensor, rows: torch.Tensor, what: str) -> torch.Tensor:
        meta = self._meta(name)
        rows = torch.as_tensor(rows)
        if not rows.is_floating_point():
            raise TypeError(f"tensor {name!r}: {what} must be floating point, got {rows.dtype}")
        if tuple(rows.shape) != (ids.numel(), meta.shape[1]):
            raise ValueError(
                f"tensor {name!r}: {what} has shape {tuple(rows.shape)}, expected "
                f"{(ids.numel(), meta.shape[1])}"
            )
        return rows.detach().to(torch.float32).cpu()

    # ------------------------------------------------------------------------------------------
    # operations (all run on the worker, in order)

    def _get(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        if not ids.numel():
            return torch.empty(0, self._meta(name).shape[1], dtype=self._meta(name).dtype)
        unique, inverse, _ = dedup(ids, with_counts=False)
        return self.store.get(name, unique)[inverse].to(self._meta(name).dtype)

    def _add(self, name: str, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        if not ids.numel():
            return
        unique, inverse, _ = dedup(ids, with_counts=False)
        summed = torch.zeros(unique.numel(), deltas.shape[1]).index_add_(0, inverse, deltas)
        self.store.put(name, unique, self.store.get(name, unique) + summed)

    def prefetch(self, name: str, ids) -> KVHandle:
        """Start reading rows; `wait_and_get` returns them. Sees every earlier write."""
        ids = self._ids(name, ids)
        return KVHandle(self._worker.submit(self._get, name, ids))

    def wait_and_get(self, handle: KVHandle) -> torch.Tensor:
        """The rows a `prefetch` read."""
        return handle._future.result()

    def pull(self, name: str, ids) -> torch.Tensor:
        """Rows ``[n, dim]`` of ``ids`` (any shape, flattened; duplicates allowed)."""
        return self.wait_and_get(self.prefetch(name, ids))

    def push(self, name: str, ids, rows) -> None:
        """Overwrite rows. Ids must be distinct (which of two values would win is undefined)."""
        ids = self._ids(name, ids)
        rows = self._rows(name, ids, rows, "rows")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"tensor {name!r}: push got duplicate ids")
        self._worker.submit(self.store.put, name, ids, rows).result()

    def update_async(self, name: str, ids, grads) -> KVHandle:
        """Add ``grads`` to the rows of ``ids`` (duplicates summed) in the background, after
        every earlier operation; returns a handle for `wait`."""
        ids = self._ids(name, ids)
        deltas = self._rows(name, ids, grads, "grads")
        if not bool(torch.isfinite(deltas).all()):
            raise ValueError(f"tensor {name!r}: update_async got NaN or Inf values")
        return KVHandle(self._worker.submit(self._add, name, ids, deltas))

    def wait(self, handle: KVHandle) -> None:
        """Block until an `update_async` has been applied (re-raises its error)."""
        handle._future.result()

    def flush(self) -> None:
        """Block until every operation submitted so far has been applied."""
        self._worker.submit(lambda: None).result()

    def close(self) -> None:
        self._worker.shutdown(wait=True)


_client: KVClient | None = None
_client_lock = threading.Lock()


def get_kv_client(store: Store | str | None = None) -> KVClient:
    """The process's KV client, created on first call (over ``store``, default HostKV).

    Passing a store once a client exists with another store is an error; `reset_kv_client`
    drops the current client.
    """
    global _client
    with _client_lock:
        if _client is None:
            _client = KVClient(store)
        elif store is not None and store is not _client.store:
            raise ValueError(
                "the KV client already exists over another store; call reset_kv_client() first"
            )
        return _client


def reset_kv_client() -> None:
    """Close and forget the process's KV client (its tensors go with it)."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
        _client = None
