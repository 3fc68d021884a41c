"""`ShardedKVClient`: the RecStore-style KV calls over tensors whose rows are sharded across
ranks.

Row ``id`` of tensor ``name`` lives on rank ``kv_owner_of(name, id)`` (the hash is documented in
`embcache.distributed.exchange`), in that rank's local `KVClient`. Every call is a collective
made of the exchanges of `embcache.distributed.exchange`: a header, the ids routed to their
owners, then the rows (pushed rows and deltas to the owners, pulled rows back from them).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from embcache.distributed.exchange import (
    OP_ADD,
    OP_INIT,
    OP_NAMES,
    OP_PULL,
    OP_PUSH,
    OP_UPDATE,
    Comm,
    kv_owner_of,
    with_status,
)
from embcache.kernels.ids import dedup
from embcache.kv.base import Store, table_hash
from embcache.recstore.kv_client import InitFunc, KVClient, KVHandle, KVOptimizer


class ShardedKVClient:
    """`KVClient`'s calls over rows sharded across ranks; every call is a collective.

    Each rank keeps the rows it owns (``kv_owner_of``) in a local `KVClient`; ``pull``,
    ``push`` and ``update_async`` send each id to its owner by all_to_all. Every rank calls each
    method in the same order with its own ids (possibly none).

    Semantics across ranks: ``pull`` sees every earlier call of every rank. ``push`` of the same
    id by several ranks keeps the highest rank's row. ``update_async`` returns once its gradients
    have reached their owners, which sum them (duplicates, over ranks too) and apply the tensor's
    backend optimizer once per call, on their worker threads in call order, so any later call
    sees them (``add_async`` likewise adds raw deltas); ``wait(handle)`` waits for this rank's
    share (the rows it owns), ``flush()`` for every rank's.

    Args:
        store: this rank's tier (a `Store`, a URL or None for an in-process `HostKV`).
        process_group: the ranks sharing the tensors (None: the default group).
        optimizer: the backend optimizer of tensors declared without one (as `KVClient`).
    """

    def __init__(
        self,
        store: Store | str | None = None,
        process_group=None,
        optimizer: KVOptimizer | Mapping[str, Any] | None = None,
    ) -> None:
        self._comm = Comm(process_group)
        self.rank, self.world_size = self._comm.rank, self._comm.world_size
        self.local = KVClient(store, optimizer)
        self._names: dict[int, str] = {}

    def _owners(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return kv_owner_of(name, ids, self.world_size)

    def _ids(self, name: str, ids) -> torch.Tensor:
        """Checked CPU int64 ids; an empty list (a rank with nothing to ask) is fine."""
        ids = torch.as_tensor(ids)
        return self.local.checked_ids(name, ids.long() if ids.numel() == 0 else ids)

    def init_data(
        self,
        name: str,
        shape: tuple[int, int],
        dtype: torch.dtype = torch.float32,
        init_func: InitFunc | None = None,
        optimizer: KVOptimizer | Mapping[str, Any] | None = None,
    ) -> None:
        """Declare a tensor on every rank (collective), with its backend ``optimizer`` (None:
        the client's). ``init_func`` runs on rank 0 only, and its rows are sent to their owners,
        so it need not be deterministic across ranks."""
        error, initial = None, None
        fresh = name not in self.local.names()
        try:
            self.local.init_data(name, shape, dtype, optimizer=optimizer)
            if init_func is not None and fresh and self.rank == 0:
                initial = init_func(self.local.shape(name), dtype)
                if tuple(initial.shape) != self.local.shape(name):
                    raise ValueError(
                        f"tensor {name!r}: init_func returned shape {tuple(initial.shape)}, "
                        f"expected {self.local.shape(name)}"
                    )
        except Exception as e:
            error = e
        self._names[table_hash(name)] = name
        wants_init = int(init_func is not None and fresh)
        flags = self._comm.header(
            torch.full((self.world_size,), wants_init), OP_INIT, table_hash(name), error,
            self._names,
        )  # fmt: skip
        if len(set(flags)) != 1:
            raise RuntimeError(
                f"rank {self.rank}: init_data({name!r}) needs the same arguments on every rank; "
                f"ranks {[r for r, f in enumerate(flags) if f]} (only) would initialise it from "
                f"an init_func"
            )
        if not wants_init:
            return
        rows = self.local.shape(name)[0]
        ids = torch.arange(rows) if self.rank == 0 else torch.empty(0, dtype=torch.int64)
        values = initial.float().cpu() if self.rank == 0 else None
        self._send(OP_INIT, name, ids, values, lambda i, v: self.local.push(name, i, v))

    def _send(self, op: int, name: str, ids, values, apply, error=None):
        """Route ``ids`` and their ``values`` rows to the owners, who call ``apply``."""
        if error is not None:
            ids, values = torch.empty(0, dtype=torch.int64), None
        dim = self.local.shape(name)[1] if error is None else 0
        route = self._comm.route(
            ids, self._owners(name, ids), op, table_hash(name), error, self._names
        )
        if values is None:
            values = torch.empty(0, dim)
        got = self._comm.exchange(
            values[route.order], route.send_counts, route.recv_counts, f"{OP_NAMES[op]}'s rows"
        )
        return apply(route.recv_ids, got)

    def pull(self, name: str, ids) -> torch.Tensor:
        """Rows ``[n, dim]`` of ``ids`` (any shape, flattened; duplicates allowed)."""
        error = None
        try:
            ids = self._ids(name, ids)
        except Exception as e:
            error, ids = e, torch.empty(0, dtype=torch.int64)
        unique, inverse, _ = dedup(ids, with_counts=False)
        self._names[table_hash(name)] = name
        route = self._comm.route(
            unique, self._owners(name, unique), OP_PULL, table_hash(name), error, self._names
        )
        served, failure = None, None
        try:
            served = self.local.pull(name, route.recv_ids).to(torch.float32)
        except Exception as e:
            failure = e
        dim = self.local.shape(name)[1]
        reply = with_status(served, torch.arange(route.recv_ids.numel()), route.recv_counts, dim)
        got, data = self._comm.reply(
            reply, route.recv_counts, route.send_counts, failure, f"pull({name!r})"
        )
        rows = torch.empty(unique.numel(), dim)
        rows[route.order] = got[data]
        return rows[inverse].to(self.local.dtype(name))

    def push(self, name: str, ids, rows) -> None:
        """Overwrite rows; a rank's ids must be distinct (several ranks: the highest rank's row
        wins)."""
        error = None
        try:
            ids = self._ids(name, ids)
            rows = self.local.checked_rows(name, ids, rows, "rows")
            if torch.unique(ids).numel() != ids.numel():
                raise ValueError(f"tensor {name!r}: push got duplicate ids")
        except Exception as e:
            error = e

        def apply(recv_ids: torch.Tensor, recv_rows: torch.Tensor) -> None:
            unique, inverse = torch.unique(recv_ids, return_inverse=True)
            last = torch.full_like(unique, -1).scatter_reduce_(
                0, inverse, torch.arange(recv_ids.numel()), "amax"
            )
            self.local.push(name, unique, recv_rows[last])

        self._names[table_hash(name)] = name
        self._send(OP_PUSH, name, ids, rows, apply, error)

    def update_async(self, name: str, ids, grads) -> KVHandle:
        """Hand ``grads`` to the backend optimizer of the rows' owners (see the class
        docstring)."""
        return self._update(OP_UPDATE, name, ids, grads, "grads", self.local.update_async)

    def add_async(self, name: str, ids, deltas) -> KVHandle:
        """Add ``deltas`` to the rows at their owners, without an optimizer."""
        return self._update(OP_ADD, name, ids, deltas, "deltas", self.local.add_async)

    def _update(self, op: int, name: str, ids, values, what: str, apply) -> KVHandle:
        error = None
        try:
            ids = self._ids(name, ids)
            values = self.local.checked_rows(name, ids, values, what)
            if not bool(torch.isfinite(values).all()):
                raise ValueError(f"tensor {name!r}: {OP_NAMES[op]} got NaN or Inf values")
        except Exception as e:
            error = e
        self._names[table_hash(name)] = name
        return self._send(op, name, ids, values, lambda i, v: apply(name, i, v), error)

    def wait(self, handle: KVHandle) -> None:
        """Block until this rank has applied its share of an `update_async`."""
        self.local.wait(handle)

    def prefetch(self, name: str, ids) -> KVHandle:
        """`pull` now (it is a collective); `wait_and_get` returns the rows."""
        future: Future = Future()
        future.set_result(self.pull(name, ids))
        return KVHandle(future)

    def wait_and_get(self, handle: KVHandle) -> torch.Tensor:
        return self.local.wait_and_get(handle)

    def flush(self) -> None:
        """Block until every rank has applied every operation submitted so far (collective)."""
        self.local.flush()
        self._comm.run("barrier of flush", lambda: dist.barrier(group=self._comm.group))

    def shape(self, name: str) -> tuple[int, int]:
        return self.local.shape(name)

    def comm_stats(self) -> dict[str, int]:
        return self._comm.stats()

    def close(self) -> None:
        self.local.close()
