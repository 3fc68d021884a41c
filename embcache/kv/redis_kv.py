"""RedisKV: tables kept in a Redis server or a Redis Cluster, through redis-py (hiredis parser).

Each row is one key holding ``dim`` little-endian weights of the table's dtype and
``state_dim`` little-endian float32 values; keys carry
hash-tag buckets, so on a cluster a batch costs one MGET/MSET per slot touched and on a single
server one per chunk. The key layout, the spec record, the row encoding and the slot-grouped
commands are in `embcache.kv.redis_wire`.

Row values are created by ``spec.initial_rows`` (the same per-id seeding as `HostKV`, so a model
gives the same numbers on either tier) and written only where absent (``MSETNX`` per slot group,
``SET NX`` key by key when some already exist): two clients creating a row at once keep one
value, and both return it.

Every network operation runs in chunks of at most ``chunk_rows`` rows (one round trip per node) and
is retried on connection errors with exponential backoff for up to ``retry_timeout_s`` seconds
per chunk; then `TierUnavailableError` names the URL, table and operation. All writes are whole
rows (idempotent), so a failed `put` is safe to repeat in full later.

Two guards make a shared, restartable server safe to train on: write marks
(`embcache.kv.write_marks`) turn a server that lost acknowledged writes into
`TierDataLossError` instead of silently re-created rows, and owner leases
(`embcache.kv.redis_lease`) refuse a second job that opens the tables of a live one.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import redis
import redis.cluster
import torch

from embcache.kv.base import IOStats, Store, TableSpec, checked_ids, checked_rows
from embcache.kv.errors import (
    TierAuthError,
    TierCommandError,
    TierConfigError,
    TierFullError,
    TierUnavailableError,
)
from embcache.kv.redact import redact_url
from embcache.kv.redis_lease import TableLeases
from embcache.kv.redis_wire import (
    DEFAULT_BUCKETS,
    NAMESPACE_RE,
    ROW_DTYPE,
    TRANSIENT,
    TableLayout,
    auth_message,
    connect,
    error_text,
    from_blobs,
    key_batch,
    meta_key,
    parse_spec_record,
    set_nx,
    spec_record,
    table_layout,
    to_blobs,
)
from embcache.kv.write_marks import MarkGuard

__all__ = ["RedisKV", "TierUnavailableError"]

_SCAN_COUNT = 1000
_T = TypeVar("_T")
_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


class RedisKV(Store):
    """A `Store` on a Redis server (``redis://``) or a Redis Cluster (``redis+cluster://``).

    Args:
        url: ``redis://host:port/db``, ``rediss://...`` (TLS), ``unix:///path.sock``, or
            ``redis+cluster://host:port`` (any node of a cluster; the client discovers the rest).
            Query parameters are redis-py connection options.
        namespace: prefix of every key, so several models share one server; letters, digits
            and ``_.-/``.
        chunk_rows: most rows per round trip (one MGET/MSET, or one pipeline on a cluster).
        retry_timeout_s: how long one chunk retries a lost connection (exponential backoff from
            ``backoff_s`` doubling to ``max_backoff_s``) before `TierUnavailableError`.
        socket_timeout_s: timeout of each socket connect, read and write.
        backoff_s: first pause between retries.
        max_backoff_s: longest pause between retries.
        buckets: hash-tag buckets of tables this client creates (an existing table keeps the
            count recorded on the server).
        shared: open tables shared with other jobs (each must say so) instead of exclusively.
        owner: this job's token for exclusive leases (None: a new random one, `owner`). Give
            the token of an earlier run to reopen its tables at once (a resumed job), or the
            same token to every rank of one distributed job.
        lease_ttl_s: how long a table stays leased after its holder's last renewal (renewed
            every third of it): a job that dies frees its tables within this time.
        verify_interval_s: how often every write mark this client wrote is read back (they are
            also checked by each call on the buckets it touches, and after each reconnect).

    Raises:
        TierUnavailableError: the server does not answer PING at start (no retry: a server that
            is not there at start is a configuration error, reported at once).
        TierAuthError: the server wants a password that was not given, or refused it.
        TierOwnershipError: (`init_table`) another live job holds the table.
        TierDataLossError: (any call) the server lost writes this client had acknowledged.

    Thread-safe: redis-py's clients pool their connections, each call builds its own pipelines,
    and the table registry and counters sit behind a lock. ``init_table`` must not race with
    writers of the same table in other processes (it rewrites rows when the state layout
    changes); a client that still holds the old layout then gets a ``RuntimeError`` on `get`.
    `tables` lists the tables declared through this client, not all those on the server.

    Example:
        >>> kv = RedisKV("redis://127.0.0.1:6379/0", namespace="dlrm")  # doctest: +SKIP
        >>> kv.init_table(TableSpec("t0", dim=4, num_embeddings=100))  # doctest: +SKIP
        >>> kv.get("t0", torch.tensor([3, 97])).shape  # doctest: +SKIP
        torch.Size([2, 4])
    """

    parallel_io = True  # each call is a network round trip: concurrent calls overlap

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        namespace: str = "embcache",
        chunk_rows: int = 4096,
        retry_timeout_s: float = 10.0,
        *,
        socket_timeout_s: float = 5.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        buckets: int = DEFAULT_BUCKETS,
        shared: bool = False,
        owner: str | None = None,
        lease_ttl_s: float = 30.0,
        verify_interval_s: float = 5.0,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(_SCHEMES):
            shown = redact_url(url) if isinstance(url, str) else url
            raise ValueError(f"RedisKV url must start with one of {_SCHEMES}, got {shown!r}")
        if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(
                f"namespace must be letters, digits and '_.-/' (no ':' or braces, which would "
                f"change the key layout), got {namespace!r}"
            )
        for name, value in (("chunk_rows", chunk_rows), ("buckets", buckets)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (
            ("retry_timeout_s", retry_timeout_s),
            ("socket_timeout_s", socket_timeout_s),
            ("backoff_s", backoff_s),
            ("max_backoff_s", max_backoff_s),
            ("verify_interval_s", verify_interval_s),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if isinstance(lease_ttl_s, bool) or not isinstance(lease_ttl_s, int | float):
            raise ValueError(f"lease_ttl_s must be a number > 0, got {lease_ttl_s!r}")
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be a number > 0, got {lease_ttl_s!r}")
        if not isinstance(shared, bool):
            raise TypeError(f"shared must be a bool, got {shared!r}")
        if owner is not None and (not isinstance(owner, str) or not owner or "\n" in owner):
            raise ValueError(f"owner must be a non-empty one-line string or None, got {owner!r}")
        self.url = redact_url(url)
        self.namespace = namespace
        self.chunk_rows = chunk_rows
        self.retry_timeout_s = float(retry_timeout_s)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.default_buckets = buckets
        self.cluster = "+cluster://" in url
        self._ns = namespace.encode()
        self._tables: dict[str, TableLayout] = {}
        self._lock = threading.Lock()
        self._declare_lock = threading.Lock()  # one init_table at a time (it may rewrite rows)
        self._closed = False
        self._stats = IOStats()
        self.verify_interval_s = float(verify_interval_s)
        self._verified_at = time.monotonic()
        # Set by every new connection: the server behind it may have restarted.
        self._reconnected = threading.Event()
        self._client = connect(url, self.cluster, socket_timeout_s, self.url, self._reconnected.set)
        self._marks = MarkGuard(self._client, self.url, namespace, self.cluster)
        self._leases = TableLeases(
            self._client,
            self._describe,
            self._ns,
            owner or uuid.uuid4().hex,
            shared,
            float(lease_ttl_s),
            TRANSIENT,
        )

    @property
    def owner(self) -> str:
        """This client's owner token (give it to a later run as ``owner=`` to reopen its
        tables while its leases are still live)."""
        return self._leases.owner

    @property
    def lease_owner(self) -> str | None:
        return self.owner

    @property
    def shared(self) -> bool:
        """True when tables are opened shared with other jobs."""
        return self._leases.shared

    def _describe(self) -> str:
        return f"Redis tier {self.url} (namespace {self.namespace!r})"

    # -- tables ----------------------------------------------------------------------------

    def init_table(self, spec: TableSpec) -> None:
        """Declare a table here and on the server (see `Store.init_table`).

        The first client to declare a table records its spec on the server (``SET NX``). A
        later declaration, from this client or another, with another ``dim`` or
        ``num_embeddings`` is a ``ValueError``; with another ``state_dim``/``state_init`` every
        row on the server keeps its weights and gets fresh state columns (rewritten in chunks
        found by SCAN); another ``seed`` is recorded and applies to rows created from then on.
        """
        if not isinstance(spec, TableSpec):
            raise TypeError(f"init_table expects a TableSpec, got {type(spec).__name__}")
        if spec.capacity is not None:
            raise ValueError(
                f"table {spec.name!r}: RedisKV does not bound a table's rows (a Redis server is "
                f"bounded by its maxmemory); bound it in front of Redis: "
                f"TieredKV(RedisKV(...), capacity_rows=...) with the table's capacity, or a "
                f"'tiered+redis://' store"
            )
        spec = dataclasses.replace(spec)
        with self._declare_lock:
            with self._lock:
                self._check_open()
                known = self._tables.get(spec.name)
            if known is not None:
                self._check_compatible(spec, spec_record(known.spec, known.buckets), "here")
            self._call("init_table", spec.name, lambda: self._check_eviction_policy(spec.name))
            # The lease first: a job refused here has changed nothing on the server.
            self._call("init_table", spec.name, lambda: self._leases.take(spec.name))
            key = meta_key(self._ns, spec.name)
            record = spec_record(spec, self.default_buckets)
            payload = json.dumps(record, sort_keys=True).encode()
            stored = self._call(
                "init_table", spec.name, lambda: self._claim_meta(key, payload, spec.name)
            )
            if stored is not None:
                self._check_compatible(spec, stored, "on the server")
                table = self._layout(spec, int(stored["buckets"]))
                if (stored["state_dim"], stored["state_init"]) != (
                    spec.state_dim,
                    spec.state_init,
                ):
                    self._reset_state(table)
                if any(stored[k] != record[k] for k in ("state_dim", "state_init", "seed")):
                    record["buckets"] = table.buckets
                    payload = json.dumps(record, sort_keys=True).encode()
                    self._call("init_table", spec.name, lambda: self._client.set(key, payload))
            else:
                table = self._layout(spec, self.default_buckets)
            with self._lock:
                self._tables[spec.name] = table

    def _layout(self, spec: TableSpec, buckets: int) -> TableLayout:
        """The table's key layout; its mark book is created on first declaration and kept
        across re-declarations (the acknowledged writes stay acknowledged)."""
        table = table_layout(self._ns, spec, buckets, self.cluster)
        self._marks.register(table)
        return table

    def table_spec(self, table: str) -> TableSpec:
        """A copy of the spec ``table`` was (last) declared with through this client."""
        with self._lock:
            return dataclasses.replace(self._table(table).spec)

    def tables(self) -> list[str]:
        """Tables declared through this client, in declaration order."""
        with self._lock:
            self._check_open()
            return list(self._tables)

    # -- rows ------------------------------------------------------------------------------

    def get(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Rows of ``ids``; rows missing on the server are created (never overwriting a row
        another client made meanwhile) and returned.

        Args:
            table: a declared table.
            ids: integer ``[n]``, in range for the table.
            pin: ignored: no table here is bounded, so no row is ever evicted by us.

        Returns:
            stored rows ``[n, stored_width]`` of the table's dtype.
        """
        del pin
        with self._lock:
            t = self._table(table)
        ids = checked_ids(t.spec, ids)
        out = torch.empty(ids.numel(), t.spec.stored_width, dtype=t.spec.dtype)
        created = 0
        for start in range(0, ids.numel(), self.chunk_rows):
            chunk = ids[start : start + self.chunk_rows]
            rows, made = self._call("get", table, lambda c=chunk: self._get_chunk(t, c))
            out[start : start + chunk.numel()] = rows
            created += made
        self._count("read", ids.numel(), t, created=created)
        return out

    def read(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` without creating any on the server: rows not there read as their
        initial values (one MGET per chunk, write marks checked as for `get`).

        Args:
            table: a declared table.
            ids: integer ``[n]``, in range for the table.

        Returns:
            stored rows ``[n, stored_width]`` of the table's dtype.
        """
        with self._lock:
            t = self._table(table)
        ids = checked_ids(t.spec, ids)
        out = torch.empty(ids.numel(), t.spec.stored_width, dtype=t.spec.dtype)
        for start in range(0, ids.numel(), self.chunk_rows):
            chunk = ids[start : start + self.chunk_rows]
            rows = self._call("read", table, lambda c=chunk: self._read_chunk(t, c))
            out[start : start + chunk.numel()] = rows
        self._count("read", ids.numel(), t)
        return out

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite (creating) the rows of ``ids``.

        Chunks are written in order; if one fails for good, the earlier chunks are written and
        the rest are not. Writes are whole rows, so repeating the whole `put` is always safe.

        Args:
            table: a declared table.
            ids: integer ``[n]``, in range for the table.
            rows: stored rows, or floating ``[n, dim + state_dim]``.
        """
        with self._lock:
            t = self._table(table)
        self._write(t, "put", ids, rows)
        self._count("written", ids.numel(), t)

    def remove(self, table: str, ids: torch.Tensor) -> None:
        """Delete the rows of ``ids`` (DEL, with the write marks incremented like any write)."""
        with self._lock:
            t = self._table(table)
        ids = checked_ids(t.spec, ids)
        for part in ids.split(self.chunk_rows):
            batch = key_batch(t, part, self.cluster)
            self._call("remove", table, lambda b=batch: self._marks.write(t, b, None))

    # -- checkpoints -----------------------------------------------------------------------

    def export_rows(
        self, table: str, chunk_rows: int = 65536, scores: bool = False
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Every row on the server as ``(ids, rows)`` chunks of at most ``chunk_rows``.

        Ids are ascending across the whole export, not just within a chunk: all the table's
        keys are listed first (SCAN, on every primary of a cluster; 8 bytes per id held here),
        sorted, then fetched chunk by chunk. A row that vanishes between listing and fetching
        (a server restarted without persistence) is left out. Not counted by `io_stats`.
        """
        if not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        if scores:
            raise ValueError(f"table {table!r} is not bounded here: it keeps no scores")
        with self._lock:
            t = self._table(table)
        # Marks before listing and after the last fetch: a server that lost writes before or
        # during the export must not end up in a checkpoint.
        self._call("export_rows", table, lambda: self._marks.verify([t]))
        ids = self._call("export_rows", table, lambda: self._scan_ids(t))
        return self._export_chunks(t, ids, chunk_rows)

    def _export_chunks(
        self, t: TableLayout, ids: torch.Tensor, chunk_rows: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, ids.numel(), chunk_rows):
            part = ids[start : start + chunk_rows]
            kept, rows = [], []
            for sub in part.split(self.chunk_rows):
                found, values = self._call(
                    "export_rows", t.spec.name, lambda s=sub: self._fetch_existing(t, s)
                )
                kept.append(found)
                rows.append(values)
            if start + chunk_rows >= ids.numel():
                self._call("export_rows", t.spec.name, lambda: self._marks.verify([t]))
            yield torch.cat(kept), torch.cat(rows)

    def import_rows(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        """Load checkpointed rows: `put` without counting in `io_stats` (no scores: no table
        is bounded here)."""
        del scores
        with self._lock:
            t = self._table(table)
        self._write(t, "import_rows", ids, rows)

    # -- accounting and life cycle ---------------------------------------------------------

    def io_stats(self) -> dict[str, int]:
        """Traffic through `get`/`read`/`put` since creation or the last `reset_io_stats`.

        Keys as `HostKV`'s: ``rows_read``, ``rows_written``, ``bytes_read``, ``bytes_written``
        (row payload, not protocol bytes), ``get_calls``, ``put_calls``, ``rows_created``
        (rows this client created on the server on first touch, which `get` also writes).
        """
        with self._lock:
            return dict(self._stats)

    def reset_io_stats(self) -> None:
        with self._lock:
            self._stats.reset()

    def close(self) -> None:
        """Release this client's exclusive leases and close the connections. Any later call
        but `close` raises ``RuntimeError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tables.clear()
        self._leases.close()
        self._client.close()

    def __enter__(self) -> RedisKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        mode = ", shared" if self.shared else ""
        return f"RedisKV({self.url!r}, namespace={self.namespace!r}, {kind}{mode})"

    # -- retries and checks ------------------------------------------------------------------

    def _call(self, op: str, table: str, fn: Callable[[], _T]) -> _T:
        """``fn()``, retried on connection errors with exponential backoff for up to
        ``retry_timeout_s``; then `TierUnavailableError` naming URL, table and operation.

        Before each try the table must still be ours (lease) and not known to be lost; after a
        try that needed retries (a reconnect), and every ``verify_interval_s``, every write
        mark this client wrote is read back.
        """
        start = time.monotonic()
        deadline = start + self.retry_timeout_s
        pause = self.backoff_s
        attempts = 0
        while True:
            self._check_open()
            self._check_usable(table)
            attempts += 1
            try:
                result = fn()
            except redis.exceptions.AuthenticationError as err:
                raise TierAuthError(auth_message(self.url, err)) from None
            except TRANSIENT as err:
                now = time.monotonic()
                if now >= deadline:
                    raise TierUnavailableError(
                        f"{self._describe()} unavailable: {op} on table {table!r} failed "
                        f"{attempts} time(s) over {now - start:.2f}s "
                        f"(retry_timeout_s={self.retry_timeout_s:g}): {error_text(err)}"
                    ) from None
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, self.max_backoff_s)
                self._refresh_topology()
                continue
            except redis.exceptions.ResponseError as err:
                if isinstance(err, redis.exceptions.OutOfMemoryError):
                    raise TierFullError(
                        f"{self._describe()} is full: {op} on table {table!r} was refused "
                        f"({type(err).__name__}): {error_text(err)} Nothing was lost (the rows "
                        f"stay in the cache); "
                        f"raise the server's maxmemory, or bound the tables in front of it "
                        f"(a tier capacity), then repeat the call"
                    ) from None
                raise TierCommandError(
                    f"{self._describe()}: {op} on table {table!r} was refused by the server "
                    f"({type(err).__name__}): {error_text(err)}"
                ) from None
            overdue = time.monotonic() - self._verified_at > self.verify_interval_s
            if attempts > 1 or overdue or self._reconnected.is_set():
                self._reconnected.clear()
                self._verify_tables()
            return result

    def _check_usable(self, table: str) -> None:
        self._marks.check_usable(table)
        self._leases.check(table)

    def _refresh_topology(self) -> None:
        """On a cluster, re-read the slot map (a node failed over, a slot moved)."""
        if not isinstance(self._client, redis.cluster.RedisCluster):
            return
        # When the cluster is still down this fails too; the next retry tries again.
        with contextlib.suppress(
            redis.exceptions.RedisError, redis.exceptions.RedisClusterException
        ):
            self._client.nodes_manager.initialize()

    def _verify_tables(self) -> None:
        """`MarkGuard.verify` of every table; a server down again is left to the next call."""
        self._verified_at = time.monotonic()
        with self._lock:
            tables = list(self._tables.values())
        with contextlib.suppress(*TRANSIENT):
            self._marks.verify(tables)

    # -- row I/O (called without the lock; each call builds its own pipelines) --------------

    def _claim_meta(self, key: bytes, payload: bytes, table: str) -> dict[str, Any] | None:
        """Record a spec unless one is there; returns the one there (None when ours won)."""
        if self._client.set(key, payload, nx=True):
            return None
        stored = self._client.get(key)
        if stored is None:  # deleted between the two commands: claim again
            return self._claim_meta(key, payload, table)
        try:
            return parse_spec_record(stored, table)
        except ValueError as err:
            raise ValueError(
                f"{self._describe()}: the record {key.decode(errors='replace')} of table "
                f"{table!r} is damaged or was not written by embcache ({err}); delete it and "
                f"the table's rows, or use another namespace"
            ) from None

    def _check_eviction_policy(self, table: str) -> None:
        """Refuse a server that may evict keys once full: any ``maxmemory-policy`` but
        ``noeviction`` under a ``maxmemory``. ``allkeys-*`` would drop rows, re-created from
        their initial values, silently when their bucket's write mark survived; ``volatile-*``
        evicts the keys with a TTL, which are the owner leases: a lease dropped while its job
        runs lets a second job take the table and both write it. ``noeviction`` refuses writes
        instead (`TierFullError`), and nothing is lost."""
        if isinstance(self._client, redis.cluster.RedisCluster):
            info = self._client.info("memory", target_nodes=redis.cluster.RedisCluster.PRIMARIES)
            nodes = [v for v in info.values() if isinstance(v, dict)] or [info]
        else:
            nodes = [self._client.info("memory")]
        for node in nodes:
            policy = str(node.get("maxmemory_policy", "noeviction"))
            if int(node.get("maxmemory", 0) or 0) > 0 and policy != "noeviction":
                dropped = "rows of the model" if policy.startswith("allkeys") else (
                    "the tables' owner leases (keys with a TTL), letting another job take a "
                    "table in use")  # fmt: skip
                raise TierConfigError(
                    f"{self._describe()}: table {table!r}: the server evicts keys once full "
                    f"(maxmemory {node.get('maxmemory')}, maxmemory-policy {policy}), which "
                    f"would drop {dropped}; set maxmemory-policy noeviction (a full server "
                    f"then refuses writes, and nothing is lost) and bound the tables with a "
                    f"tier capacity in front of it if they must stay under maxmemory"
                )

    def _check_compatible(self, spec: TableSpec, stored: dict[str, Any], where: str) -> None:
        dtype = str(spec.dtype).removeprefix("torch.")
        if stored.get("dtype", "float32") != dtype:
            raise ValueError(
                f"table {spec.name!r} is declared with dtype {stored.get('dtype')} {where} "
                f"(Redis tier {self.url}, namespace {self.namespace!r}); cannot declare it "
                f"with dtype {dtype}"
            )
        for field in ("dim", "num_embeddings"):
            if stored[field] != getattr(spec, field):
                raise ValueError(
                    f"table {spec.name!r} is declared with {field}={stored[field]} {where} "
                    f"(Redis tier {self.url}, namespace {self.namespace!r}); cannot declare it "
                    f"with {field}={getattr(spec, field)}. Another model using this namespace? "
                    f"Give each model its own namespace."
                )

    def _mget_in_order(self, t: TableLayout, ids: torch.Tensor) -> list[bytes | None]:
        """Values of the rows of ``ids`` (None where absent), in the order of ``ids``."""
        batch = key_batch(t, ids, self.cluster)
        values = self._marks.read(t, batch)
        if batch.order is None:
            return values
        ordered: list[bytes | None] = [None] * len(values)
        for position, value in zip(batch.order.tolist(), values, strict=True):
            ordered[position] = value
        return ordered

    def _put_blobs(self, t: TableLayout, ids: torch.Tensor, blobs: list[bytes]) -> None:
        batch = key_batch(t, ids, self.cluster)
        if batch.order is not None:
            blobs = [blobs[k] for k in batch.order.tolist()]
        self._marks.write(t, batch, blobs)

    def _get_chunk(self, t: TableLayout, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Rows of one chunk of ids (creating the missing ones), and how many were created."""
        batch = key_batch(t, ids, self.cluster)
        values = self._marks.read(t, batch)
        if batch.order is not None:
            ids = ids[batch.order]  # work in key order, restore the caller's at the end
        missing = [k for k, value in enumerate(values) if value is None]
        created = 0
        if missing:
            fresh = to_blobs(t.spec.initial_rows(ids[torch.tensor(missing)]))
            won = set_nx(self._client, batch, missing, fresh)
            lost = []
            for k, blob, ok in zip(missing, fresh, won, strict=True):
                if ok:
                    values[k] = blob
                    created += 1
                else:
                    lost.append(k)
            if lost:  # another writer created (or put) these first: theirs is the value
                again = self._mget_in_order(t, ids[torch.tensor(lost)])
                for k, value in zip(lost, again, strict=True):
                    if value is None:
                        raise RuntimeError(
                            f"table {t.spec.name!r}: row {int(ids[k])} was deleted on the "
                            f"server while being created"
                        )
                    values[k] = value
        rows = from_blobs(values, t)
        if batch.order is None:
            return rows, created
        out = torch.empty_like(rows)
        out[batch.order] = rows
        return out, created

    def _read_chunk(self, t: TableLayout, ids: torch.Tensor) -> torch.Tensor:
        """Rows of one chunk of ids, initial values where the server has none."""
        found, rows = self._fetch_existing(t, ids)
        if found.numel() == ids.numel():
            return rows
        present = torch.isin(ids, found)  # found and rows keep the order of ``ids``
        out = torch.empty(ids.numel(), t.spec.stored_width, dtype=t.spec.dtype)
        out[present] = rows
        out[~present] = t.spec.initial_rows(ids[~present])
        return out

    def _fetch_existing(
        self, t: TableLayout, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids found, their rows)`` of ``ids``, in their order, skipping rows not there."""
        values = self._mget_in_order(t, ids)
        present = [k for k, value in enumerate(values) if value is not None]
        rows = from_blobs([values[k] for k in present], t)
        return ids[torch.tensor(present, dtype=torch.int64)], rows

    def _write(self, t: TableLayout, op: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        ids = checked_ids(t.spec, ids)
        rows = checked_rows(t.spec, ids, rows)
        for start in range(0, ids.numel(), self.chunk_rows):
            part = slice(start, start + self.chunk_rows)
            blobs = to_blobs(rows[part])
            self._call(op, t.spec.name, lambda i=ids[part], b=blobs: self._put_blobs(t, i, b))

    def _scan_ids(self, t: TableLayout) -> torch.Tensor:
        """Ids of every row of the table on the server, ascending (SCAN over all primaries)."""
        found = array.array("q")
        for key in self._client.scan_iter(match=t.scan_match, count=_SCAN_COUNT):
            match = t.id_re.fullmatch(key)
            if match is not None:  # the pattern also admits tables named like "T:x"
                found.append(int(match.group(1)))
        ids = torch.from_numpy(np.frombuffer(found, dtype=np.int64).copy())
        # A cluster SCAN may list a key twice when a slot migrates while it runs.
        return torch.unique(ids)

    def _reset_state(self, t: TableLayout) -> None:
        """Rewrite every row of ``t`` on the server as its first ``dim`` weights + fresh state.

        Idempotent (the weights are always the leading ``dim`` columns), so a rewrite cut short
        by a fault is finished by declaring the table again.
        """
        ids = self._call("init_table", t.spec.name, lambda: self._scan_ids(t))
        weight_bytes = t.spec.dim * t.spec.dtype.itemsize
        state = np.full(t.spec.state_dim, t.spec.state_init, dtype=ROW_DTYPE).tobytes()

        def rewrite(part: torch.Tensor) -> None:
            values = self._mget_in_order(t, part)
            present = [k for k, value in enumerate(values) if value is not None]
            blobs = [values[k][:weight_bytes] + state for k in present]  # type: ignore[index]
            if any(len(blob) != t.row_bytes for blob in blobs):
                raise RuntimeError(f"table {t.spec.name!r}: a row on the server is too short")
            if blobs:
                self._put_blobs(t, part[torch.tensor(present, dtype=torch.int64)], blobs)

        for part in ids.split(self.chunk_rows):
            self._call("init_table", t.spec.name, lambda p=part: rewrite(p))

    # -- bookkeeping -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"RedisKV({self.url}) is closed")

    def _table(self, name: str) -> TableLayout:
        self._check_open()
        table = self._tables.get(name)
        if table is None:
            raise KeyError(f"unknown table {name!r}; known tables: {sorted(self._tables)}")
        return table

    def _count(self, direction: str, n: int, t: TableLayout, created: int = 0) -> None:
        with self._lock:
            self._stats.count(direction, n, t.row_bytes)
            self._stats["rows_created"] += created
