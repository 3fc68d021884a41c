"""RedisKV: tables kept in a Redis server or a Redis Cluster, through redis-py (hiredis parser).

Key layout, for namespace ``ns``, table ``T``, row id ``i``:

    ns:meta:T             JSON: the spec (name, dim, num_embeddings, state_dim, state_init,
                          seed; never the init callable) and the table's bucket count B
    ns:{h.b}:T:i          row i: ``dim + state_dim`` little-endian float32, ``[weights | state]``

with ``h = table_hash(T)`` (a CRC of the name) and ``b = i % B`` (B = 256 unless the server's
record says otherwise). The braces are Redis Cluster's hash tag: the rows of one bucket share a
slot, so on a cluster a batch costs one MGET/MSET per slot touched (at most B) rather than one
command per row, while a table's B buckets still spread over the slots and hence the nodes. On a
single server the tag is just part of the name and a chunk is one MGET/MSET. Row values are
created by ``spec.initial_rows`` (the same per-id seeding as `HostKV`, so a model gives the same
numbers on either tier) and written only where absent (``MSETNX`` per slot group, ``SET NX`` key
by key when some already exist): two clients creating a row at once keep one value, and both
return it.

Every network operation runs in chunks of at most ``chunk_rows`` rows (one round trip per node) and
is retried on connection errors with exponential backoff for up to ``retry_timeout_s`` seconds
per chunk; then `TierUnavailableError` names the URL, table and operation. All writes are whole
rows (idempotent), so a failed `put` is safe to repeat in full later.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import json
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import redis
import redis.cluster
import torch
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from embcache.kv.base import TableSpec, table_hash
from embcache.kv.host import _checked_ids, _checked_rows

DEFAULT_BUCKETS = 256
_ROW_DTYPE = np.dtype("<f4")  # fixed byte order: clients on any machine read the same rows
_META_FORMAT = 1
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-/]+")
_SCAN_COUNT = 1000
_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")

# Errors after which the same command may succeed: the server restarting, a node failing over.
_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError (a server still loading)
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.ClusterError,
    redis.exceptions.AskError,  # and MovedError: a slot moved; the slot map is refreshed
    ConnectionResetError,
)

_T = TypeVar("_T")


class TierUnavailableError(ConnectionError):
    """The Redis tier cannot be reached: at start, or still after ``retry_timeout_s`` of retries.

    The message names the URL (password hidden) and, mid-run, the table and operation.
    """


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, fit for error messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@dataclasses.dataclass
class _Table:
    """A declared table and the precomputed parts of its keys."""

    spec: TableSpec
    buckets: int
    meta_key: bytes
    prefixes: list[bytes]  # per bucket b: b"ns:{h.b}:T:"
    bucket_slot: torch.Tensor  # int64 [B], cluster slot of each bucket
    scan_match: bytes  # SCAN MATCH pattern of the table's row keys
    id_re: re.Pattern[bytes]  # a row key of exactly this table -> its id

    @property
    def row_bytes(self) -> int:
        return self.spec.row_width * _ROW_DTYPE.itemsize


@dataclasses.dataclass
class _KeyBatch:
    """Keys of a chunk of ids as sent: ``keys[a:b]`` is one multi-key command per group."""

    keys: list[bytes]
    order: torch.Tensor | None  # keys[k] is the key of ids[order[k]]; None: ids order
    groups: list[tuple[int, int, int]]  # (slot or -1, a, b)


class RedisKV:
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

    Raises:
        TierUnavailableError: the server does not answer PING at start (no retry: a server that
            is not there at start is a configuration error, reported at once).

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
    ) -> None:
        if not isinstance(url, str) or not url.startswith(_SCHEMES):
            raise ValueError(f"RedisKV url must start with one of {_SCHEMES}, got {url!r}")
        if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
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
        ):
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        self.url = redact_url(url)
        self.namespace = namespace
        self.chunk_rows = chunk_rows
        self.retry_timeout_s = float(retry_timeout_s)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.default_buckets = buckets
        self.cluster = "+cluster://" in url
        self._ns = namespace.encode()
        self._tables: dict[str, _Table] = {}
        self._lock = threading.Lock()
        self._declare_lock = threading.Lock()  # one init_table at a time (it may rewrite rows)
        self._closed = False
        self._stats = dict.fromkeys(_STAT_KEYS, 0)
        # Retries are ours (bounded by time, across reconnects); redis-py's own would stack
        # their backoff on top of ours, so they are off.
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        self._client: redis.Redis | redis.cluster.RedisCluster
        try:
            if self.cluster:
                plain = url.replace("+cluster://", "://", 1)
                self._client = redis.cluster.RedisCluster.from_url(plain, **options)
            else:
                self._client = redis.Redis.from_url(url, **options)
            self._client.ping()
        except (*_TRANSIENT, redis.exceptions.RedisClusterException, OSError) as err:
            raise TierUnavailableError(
                f"cannot reach the Redis tier at {self.url}: {err} "
                f"(is redis-server running and listening there?)"
            ) from err

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
        spec = dataclasses.replace(spec)
        with self._declare_lock:
            with self._lock:
                self._check_open()
                known = self._tables.get(spec.name)
            if known is not None:
                self._check_compatible(spec, _spec_record(known.spec, known.buckets), "here")
            meta_key = self._ns + b":meta:" + spec.name.encode()
            record = _spec_record(spec, self.default_buckets)
            payload = json.dumps(record, sort_keys=True).encode()
            stored = self._call(
                "init_table", spec.name, lambda: self._claim_meta(meta_key, payload)
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
                    self._call("init_table", spec.name, lambda: self._client.set(meta_key, payload))
            else:
                table = self._layout(spec, self.default_buckets)
            with self._lock:
                self._tables[spec.name] = table

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

    def get(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids``; rows missing on the server are created (never overwriting a row
        another client made meanwhile) and returned.

        Args:
            table: a declared table.
            ids: integer ``[n]``, in range for the table.

        Returns:
            float32 ``[n, dim + state_dim]``.
        """
        with self._lock:
            t = self._table(table)
        ids = _checked_ids(t.spec, ids)
        out = torch.empty(ids.numel(), t.spec.row_width, dtype=torch.float32)
        created = 0
        for start in range(0, ids.numel(), self.chunk_rows):
            chunk = ids[start : start + self.chunk_rows]
            rows, made = self._call("get", table, lambda c=chunk: self._get_chunk(t, c))
            out[start : start + chunk.numel()] = rows
            created += made
        self._count("read", ids.numel(), t, created=created)
        return out

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite (creating) the rows of ``ids``.

        Chunks are written in order; if one fails for good, the earlier chunks are written and
        the rest are not. Writes are whole rows, so repeating the whole `put` is always safe.

        Args:
            table: a declared table.
            ids: integer ``[n]``, in range for the table.
            rows: floating ``[n, dim + state_dim]``.
        """
        with self._lock:
            t = self._table(table)
        self._write(t, "put", ids, rows)
        self._count("written", ids.numel(), t)

    # -- checkpoints -----------------------------------------------------------------------

    def export_rows(
        self, table: str, chunk_rows: int = 65536
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row on the server as ``(ids, rows)`` chunks of at most ``chunk_rows``.

        Ids are ascending across the whole export, not just within a chunk: all the table's
        keys are listed first (SCAN, on every primary of a cluster; 8 bytes per id held here),
        sorted, then fetched chunk by chunk. A row that vanishes between listing and fetching
        (a server restarted without persistence) is left out. Not counted by `io_stats`.
        """
        if not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        with self._lock:
            t = self._table(table)
        ids = self._call("export_rows", table, lambda: self._scan_ids(t))
        return self._export_chunks(t, ids, chunk_rows)

    def _export_chunks(
        self, t: _Table, ids: torch.Tensor, chunk_rows: int
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
            yield torch.cat(kept), torch.cat(rows)

    def import_rows(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Load checkpointed rows: `put` without counting in `io_stats`."""
        with self._lock:
            t = self._table(table)
        self._write(t, "import_rows", ids, rows)

    # -- accounting and life cycle ---------------------------------------------------------

    def io_stats(self) -> dict[str, int]:
        """Traffic through `get`/`put` since creation or the last `reset_io_stats`.

        Keys as `HostKV`'s: ``rows_read``, ``rows_written``, ``bytes_read``, ``bytes_written``
        (row payload, not protocol bytes), ``get_calls``, ``put_calls``, ``rows_created``
        (rows this client created on the server on first touch, which `get` also writes).
        """
        with self._lock:
            return dict(self._stats)

    def reset_io_stats(self) -> None:
        with self._lock:
            self._stats = dict.fromkeys(_STAT_KEYS, 0)

    def close(self) -> None:
        """Close the connections. Any later call but `close` raises ``RuntimeError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tables.clear()
        self._client.close()

    def __enter__(self) -> RedisKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        return f"RedisKV({self.url!r}, namespace={self.namespace!r}, {kind})"

    # -- retries ---------------------------------------------------------------------------

    def _call(self, op: str, table: str, fn: Callable[[], _T]) -> _T:
        """``fn()``, retried on connection errors with exponential backoff for up to
        ``retry_timeout_s``; then `TierUnavailableError` naming URL, table and operation."""
        start = time.monotonic()
        deadline = start + self.retry_timeout_s
        pause = self.backoff_s
        attempts = 0
        while True:
            self._check_open()
            attempts += 1
            try:
                result = fn()
            except _TRANSIENT as err:
                now = time.monotonic()
                if now >= deadline:
                    raise TierUnavailableError(
                        f"Redis tier {self.url} (namespace {self.namespace!r}) unavailable: "
                        f"{op} on table {table!r} failed {attempts} time(s) over "
                        f"{now - start:.2f}s (retry_timeout_s={self.retry_timeout_s:g}): {err}"
                    ) from err
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, self.max_backoff_s)
                self._refresh_topology()
                continue
            if attempts > 1:
                self._restore_meta()
            return result

    def _refresh_topology(self) -> None:
        """On a cluster, re-read the slot map (a node failed over, a slot moved)."""
        if not isinstance(self._client, redis.cluster.RedisCluster):
            return
        # When the cluster is still down this fails too; the next retry tries again.
        with contextlib.suppress(
            redis.exceptions.RedisError, redis.exceptions.RedisClusterException
        ):
            self._client.nodes_manager.initialize()

    def _restore_meta(self) -> None:
        """Re-record the specs of our tables (``SET NX``) after a reconnect: a server that
        restarted without persistence has lost them, and other clients check against them."""
        with self._lock:
            tables = list(self._tables.values())
        try:
            pipe = self._client.pipeline(transaction=False)
            for t in tables:
                payload = json.dumps(_spec_record(t.spec, t.buckets), sort_keys=True).encode()
                pipe.set(t.meta_key, payload, nx=True)
            pipe.execute()
        except _TRANSIENT:
            pass  # down again: the next successful retry restores them

    # -- wire helpers (called without the lock; each builds its own pipelines) --------------

    def _claim_meta(self, key: bytes, payload: bytes) -> dict[str, Any] | None:
        """Record a spec unless one is there; returns the one there (None when ours won)."""
        if self._client.set(key, payload, nx=True):
            return None
        stored = self._client.get(key)
        if stored is None:  # deleted between the two commands: claim again
            return self._claim_meta(key, payload)
        return json.loads(stored)

    def _check_compatible(self, spec: TableSpec, stored: dict[str, Any], where: str) -> None:
        for field in ("dim", "num_embeddings"):
            if stored[field] != getattr(spec, field):
                raise ValueError(
                    f"table {spec.name!r} is declared with {field}={stored[field]} {where} "
                    f"(Redis tier {self.url}, namespace {self.namespace!r}); cannot declare it "
                    f"with {field}={getattr(spec, field)}. Another model using this namespace? "
                    f"Give each model its own namespace."
                )

    def _layout(self, spec: TableSpec, buckets: int) -> _Table:
        name = spec.name.encode()
        tag = b"%d" % table_hash(spec.name)
        prefixes = [self._ns + b":{" + tag + b".%d}:" % b + name + b":" for b in range(buckets)]
        escaped = re.sub(rb"([*?\[\]\\])", rb"\\\1", name)
        return _Table(
            spec=spec,
            buckets=buckets,
            meta_key=self._ns + b":meta:" + name,
            prefixes=prefixes,
            bucket_slot=torch.tensor([key_slot(p) for p in prefixes], dtype=torch.int64),
            scan_match=self._ns + b":{" + tag + b".*}:" + escaped + b":*",
            id_re=re.compile(
                re.escape(self._ns + b":{" + tag + b".") + rb"\d+\}:" + re.escape(name) + rb":(\d+)"
            ),
        )

    def _keys(self, t: _Table, ids: torch.Tensor) -> _KeyBatch:
        """Keys of ``ids``, grouped so that one multi-key command serves each group.

        Single server: one group, keys in the order of ``ids``. Cluster: one group per slot,
        keys sorted by slot (``order`` says which id each key is).
        """
        buckets, prefixes = t.buckets, t.prefixes
        if not self.cluster:
            keys = [prefixes[i % buckets] + b"%d" % i for i in ids.tolist()]
            return _KeyBatch(keys, None, [(-1, 0, len(keys))])
        slots = t.bucket_slot[ids % buckets]
        order = torch.argsort(slots, stable=True)
        keys = [prefixes[i % buckets] + b"%d" % i for i in ids[order].tolist()]
        group_slots, counts = torch.unique_consecutive(slots[order], return_counts=True)
        stops = torch.cumsum(counts, 0)
        groups = list(
            zip(group_slots.tolist(), (stops - counts).tolist(), stops.tolist(), strict=True)
        )
        return _KeyBatch(keys, order, groups)

    def _run(self, commands: list[tuple[int, tuple[Any, ...]]]) -> list[Any]:
        """Replies to ``(slot, command)`` pairs, in order: one pipeline (a round trip) per node.

        On a cluster, commands go straight to the node that owns their slot, as redis-py's own
        cluster pipeline would send them but without its per-key slot checks (they cost more
        than the round trip). A slot that moved raises MovedError/AskError; `_call` refreshes
        the slot map and retries.
        """
        if not self.cluster:
            if len(commands) == 1:
                return [self._client.execute_command(*commands[0][1])]
            pipe = self._client.pipeline(transaction=False)
            for _, command in commands:
                pipe.execute_command(*command)
            return pipe.execute()
        assert isinstance(self._client, redis.cluster.RedisCluster)
        nodes = self._client.nodes_manager
        by_node: dict[str, tuple[redis.cluster.ClusterNode, list[int]]] = {}
        for k, (slot, _) in enumerate(commands):
            node = nodes.get_node_from_slot(slot)
            by_node.setdefault(node.name, (node, []))[1].append(k)
        replies: list[Any] = [None] * len(commands)
        for node, positions in by_node.values():
            pipe = self._client.get_redis_connection(node).pipeline(transaction=False)
            for k in positions:
                pipe.execute_command(*commands[k][1])
            for k, reply in zip(positions, pipe.execute(), strict=True):
                replies[k] = reply
        return replies

    def _mget(self, batch: _KeyBatch) -> list[bytes | None]:
        """Values of ``batch.keys`` (None where absent), in the batch's key order."""
        if not batch.keys:
            return []
        commands = [(slot, ("MGET", *batch.keys[a:b])) for slot, a, b in batch.groups]
        return [value for values in self._run(commands) for value in values]

    def _mset(self, batch: _KeyBatch, blobs: list[bytes]) -> None:
        """Write ``blobs`` (in the batch's key order) to ``batch.keys``."""
        commands = []
        for slot, a, b in batch.groups:
            args: list[bytes] = [b""] * (2 * (b - a))
            args[0::2] = batch.keys[a:b]
            args[1::2] = blobs[a:b]
            commands.append((slot, ("MSET", *args)))
        if commands:
            self._run(commands)

    def _set_nx(self, batch: _KeyBatch, positions: list[int], blobs: list[bytes]) -> list[bool]:
        """Create the keys at ``positions`` of the batch unless they exist: True where created.

        One MSETNX per slot group sets the whole group when none of its keys exists (the usual
        case, one command); a group where some key exists (another writer got there first) is
        redone key by key with ``SET NX``, so each key keeps whichever value came first.
        """
        slot_at = [-1] * len(batch.keys)
        for slot, a, b in batch.groups:
            slot_at[a:b] = [slot] * (b - a)
        groups: dict[int, list[int]] = {}
        for j, k in enumerate(positions):
            groups.setdefault(slot_at[k], []).append(j)
        commands = []
        for slot, members in groups.items():
            args: list[bytes] = [b""] * (2 * len(members))
            args[0::2] = [batch.keys[positions[j]] for j in members]
            args[1::2] = [blobs[j] for j in members]
            commands.append((slot, ("MSETNX", *args)))
        created = [True] * len(positions)
        retry = []
        for (slot, members), reply in zip(groups.items(), self._run(commands), strict=True):
            if not reply:
                retry.extend((slot, j) for j in members)
        if retry:
            one_by_one = [
                (slot, ("SET", batch.keys[positions[j]], blobs[j], "NX")) for slot, j in retry
            ]
            for (_, j), reply in zip(retry, self._run(one_by_one), strict=True):
                created[j] = bool(reply)
        return created

    def _mget_in_order(self, t: _Table, ids: torch.Tensor) -> list[bytes | None]:
        """Values of the rows of ``ids`` (None where absent), in the order of ``ids``."""
        batch = self._keys(t, ids)
        values = self._mget(batch)
        if batch.order is None:
            return values
        ordered: list[bytes | None] = [None] * len(values)
        for position, value in zip(batch.order.tolist(), values, strict=True):
            ordered[position] = value
        return ordered

    def _put_blobs(self, t: _Table, ids: torch.Tensor, blobs: list[bytes]) -> None:
        batch = self._keys(t, ids)
        if batch.order is not None:
            blobs = [blobs[k] for k in batch.order.tolist()]
        self._mset(batch, blobs)

    def _get_chunk(self, t: _Table, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Rows of one chunk of ids (creating the missing ones), and how many were created."""
        batch = self._keys(t, ids)
        values = self._mget(batch)
        if batch.order is not None:
            ids = ids[batch.order]  # work in key order, restore the caller's at the end
        missing = [k for k, value in enumerate(values) if value is None]
        created = 0
        if missing:
            fresh = _to_blobs(t.spec.initial_rows(ids[torch.tensor(missing)]))
            won = self._set_nx(batch, missing, fresh)
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
        rows = _from_blobs(values, t)
        if batch.order is None:
            return rows, created
        out = torch.empty_like(rows)
        out[batch.order] = rows
        return out, created

    def _fetch_existing(self, t: _Table, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids found, their rows)`` of ``ids``, in their order, skipping rows not there."""
        values = self._mget_in_order(t, ids)
        present = [k for k, value in enumerate(values) if value is not None]
        rows = _from_blobs([values[k] for k in present], t)
        return ids[torch.tensor(present, dtype=torch.int64)], rows

    def _write(self, t: _Table, op: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        ids = _checked_ids(t.spec, ids)
        rows = _checked_rows(t.spec, ids, rows)
        for start in range(0, ids.numel(), self.chunk_rows):
            part = slice(start, start + self.chunk_rows)
            blobs = _to_blobs(rows[part])
            self._call(op, t.spec.name, lambda i=ids[part], b=blobs: self._put_blobs(t, i, b))

    def _scan_ids(self, t: _Table) -> torch.Tensor:
        """Ids of every row of the table on the server, ascending (SCAN over all primaries)."""
        found = array.array("q")
        for key in self._client.scan_iter(match=t.scan_match, count=_SCAN_COUNT):
            match = t.id_re.fullmatch(key)
            if match is not None:  # the pattern also admits tables named like "T:x"
                found.append(int(match.group(1)))
        ids = torch.from_numpy(np.frombuffer(found, dtype=np.int64).copy())
        # A cluster SCAN may list a key twice when a slot migrates while it runs.
        return torch.unique(ids)

    def _reset_state(self, t: _Table) -> None:
        """Rewrite every row of ``t`` on the server as its first ``dim`` weights + fresh state.

        Idempotent (the weights are always the leading ``dim`` columns), so a rewrite cut short
        by a fault is finished by declaring the table again.
        """
        ids = self._call("init_table", t.spec.name, lambda: self._scan_ids(t))
        weight_bytes = t.spec.dim * _ROW_DTYPE.itemsize
        state = np.full(t.spec.state_dim, t.spec.state_init, dtype=_ROW_DTYPE).tobytes()

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

    def _table(self, name: str) -> _Table:
        self._check_open()
        table = self._tables.get(name)
        if table is None:
            raise KeyError(f"unknown table {name!r}; known tables: {sorted(self._tables)}")
        return table

    def _count(self, direction: str, n: int, t: _Table, created: int = 0) -> None:
        with self._lock:
            self._stats[f"rows_{direction}"] += n
            self._stats[f"bytes_{direction}"] += n * t.row_bytes
            self._stats["get_calls" if direction == "read" else "put_calls"] += 1
            self._stats["rows_created"] += created


_STAT_KEYS = (
    "rows_read",
    "rows_written",
    "bytes_read",
    "bytes_written",
    "get_calls",
    "put_calls",
    "rows_created",
)


def _spec_record(spec: TableSpec, buckets: int) -> dict[str, Any]:
    """What the server keeps about a table (everything but the init callable)."""
    return {
        "format": _META_FORMAT,
        "name": spec.name,
        "dim": spec.dim,
        "num_embeddings": spec.num_embeddings,
        "state_dim": spec.state_dim,
        "state_init": float(spec.state_init),
        "seed": spec.seed,
        "buckets": buckets,
    }


def _to_blobs(rows: torch.Tensor) -> list[bytes]:
    """One bytes object per row of float32 ``[n, W]``, little-endian."""
    data = rows.numpy().astype(_ROW_DTYPE, copy=False).tobytes()
    width = rows.shape[1] * _ROW_DTYPE.itemsize
    return [data[k : k + width] for k in range(0, len(data), width)]


def _from_blobs(values: list[Any], t: _Table) -> torch.Tensor:
    """float32 ``[n, W]`` from ``n`` row blobs, checking each has the table's width."""
    data = b"".join(values)
    if len(data) != len(values) * t.row_bytes:
        bad = next(v for v in values if len(v) != t.row_bytes)
        raise RuntimeError(
            f"table {t.spec.name!r}: a row on the server has {len(bad)} bytes, expected "
            f"{t.row_bytes} (dim={t.spec.dim} + state_dim={t.spec.state_dim} float32); was the "
            f"table re-declared with another state layout by another client?"
        )
    flat = np.frombuffer(data, dtype=_ROW_DTYPE).astype(np.float32)
    return torch.from_numpy(flat).reshape(len(values), t.spec.row_width)
