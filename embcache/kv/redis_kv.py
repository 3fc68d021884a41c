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
`TierDataLossError` instead of silently re-created rows, and owner leases with fencing
(`embcache.kv.redis_lease`) refuse a second job that opens the tables of a live one and refuse
every write of a job whose lease was taken over. The jobs that opened tables and never closed
them are remembered on the server (`embcache.kv.redis_jobs`) and reported to the next one.

The class reads top to bottom as its public calls; the retries and checks around each round
trip are in `embcache.kv.redis_calls` (`RedisCalls`), the chunked row I/O under them in
`embcache.kv.redis_rows` (`RedisRowIO`), both base classes of `RedisKV` only.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from embcache.kv.base import IOStats, Store, TableSpec, checked_ids
from embcache.kv.errors import TierUnavailableError
from embcache.kv.redact import redact_url
from embcache.kv.redis_calls import check_options
from embcache.kv.redis_identity import TierIdentity
from embcache.kv.redis_jobs import JobRegistry, read_record
from embcache.kv.redis_lease import TableLeases
from embcache.kv.redis_rows import RedisRowIO
from embcache.kv.redis_wire import (
    DEFAULT_BUCKETS,
    TRANSIENT,
    TableLayout,
    connect,
    key_batch,
    meta_key,
    spec_record,
    table_layout,
    view_layout,
)
from embcache.kv.tier_state import TableState, TierState, WrittenIds
from embcache.kv.write_marks import MarkGuard

__all__ = ["RedisKV", "TierUnavailableError"]


class RedisKV(RedisRowIO, Store):
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
        shared: open tables read-only, beside the job that trains them: no lease is taken,
            rows missing on the server read as their initial values without being created,
            and every write (`put`, `import_rows`, `remove`) raises `TierOwnershipError`; a
            table of any state layout opens (its weights read, with this client's fresh
            state: `init_table`). Two jobs writing one table would each overwrite the other's
            updates with whole rows; ranks of one job share the ``owner`` token instead.
        owner: this job's token for exclusive leases (None: a new random one, `owner`). Give
            the same token to every rank of one distributed job (they share its leases), and
            never the token of another job, live or not: a resumed job names that one as
            ``takeover``.
        takeover: the token (`owner`) of the job this one continues, as its checkpoint
            recorded: its tables are taken at once when the process holding them is dead (on
            this host), else once its leases lapse (within ``lease_ttl_s``); a live job's are
            refused. Its record of an unclean end is not reported (its rows are restored).
        lease_ttl_s: how long a table stays leased after its holder's last renewal (renewed
            every third of it): a job that dies frees its tables within this time.
        verify_interval_s: how often every write mark this client wrote is read back (they are
            also checked by each call on the buckets it touches, and after each reconnect).

    Raises:
        TierUnavailableError: the server does not answer PING at start (no retry: a server that
            is not there at start is a configuration error, reported at once).
        TierAuthError: the server wants a password that was not given, or refused it.
        TierOwnershipError: (`init_table`) another live job holds the table; (a write) the
            tables were opened shared (read-only); (any call) another job took the table
            over (this one's lease lapsed): fenced off, it writes nothing more.
        TierDataLossError: (any call) the server lost writes this client had acknowledged,
            rows it wrote are missing, or (`init_table`, after `expect_state`) the tier is not
            the one an earlier run left.
        TierConfigError: (`init_table`, and every ``verify_interval_s`` while the job runs)
            the server may evict keys.

    Thread-safe: redis-py's clients pool their connections, each call builds its own pipelines,
    and the table registry and counters sit behind a lock. ``init_table`` must not race with
    writers of the same table in other processes (it rewrites rows when a writer declares
    another optimizer's state layout); a client that still holds the old layout then gets a
    ``RuntimeError`` on `get`.
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
        takeover: str | None = None,
        lease_ttl_s: float = 30.0,
        verify_interval_s: float = 5.0,
    ) -> None:
        check_options(
            url,
            namespace,
            owner,
            shared,
            lease_ttl_s,
            {"chunk_rows": chunk_rows, "buckets": buckets},
            {
                "retry_timeout_s": retry_timeout_s,
                "socket_timeout_s": socket_timeout_s,
                "backoff_s": backoff_s,
                "max_backoff_s": max_backoff_s,
                "verify_interval_s": verify_interval_s,
            },
            takeover,
        )
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
        self._written: dict[str, WrittenIds] = {}  # rows whose writes were acknowledged
        self._identity = TierIdentity(self._client, self._ns, self._describe, self._marks, shared)
        self._config_error: str | None = None  # the server may evict keys: why
        self._leases = TableLeases(
            self._client,
            self._describe,
            self._ns,
            owner or uuid.uuid4().hex,
            shared,
            float(lease_ttl_s),
            TRANSIENT,
            self.cluster,
            takeover,
        )
        self._jobs: JobRegistry | None = None
        if not shared:
            self._jobs = JobRegistry(
                self._client, self._ns, self.owner, self._leases.holder, takeover, self.cluster
            )
            # A clean end (close, or the interpreter's exit) deletes the job's field.
            self._leases.before_close = self._jobs.close

    @property
    def owner(self) -> str:
        """This client's owner token (a later run that continues this one gives it as
        ``takeover=``; ranks of this job give it as ``owner=``)."""
        return self._leases.owner

    @property
    def lease_owner(self) -> str | None:
        return self.owner

    # -- tables ----------------------------------------------------------------------------

    def init_table(self, spec: TableSpec) -> None:
        """Declare a table here and on the server (see `Store.init_table`).

        A writer takes the table's lease first (refused: nothing changed), under a new epoch
        when newly taken, so that an earlier writer is fenced off (`embcache.kv.redis_lease`).
        The first client to declare a table records its spec on the server (``SET NX``). A
        later declaration, from this client or another, with another ``dim`` or
        ``num_embeddings`` is a ``ValueError``; another ``seed`` is recorded and applies to
        rows created from then on. The state layout (``state_dim``, ``state_init``):

        * the server's: nothing is rewritten, every row keeps its weights and state (a new
          run of the same optimizer continues from the state the last one left);
        * ``state_dim=0`` (a model whose optimizer is not attached yet), or any layout on a
          read-only (``shared``) client: a view. Rows keep the server's layout and state;
          reads give their weights (with this client's fresh state), rows created get the
          server's fresh state, and a write keeps each row's state on the server;
        * another one with state columns, from a writer (another optimizer): every row on the
          server keeps its weights and gets fresh state columns (rewritten in chunks found by
          SCAN), and the new layout is recorded.
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
            if self._jobs is not None:
                jobs = self._jobs
                self._call("init_table", spec.name, lambda: self._leases.take(spec.name))
                self._call("init_table", spec.name, lambda: jobs.opened(spec.name))
            if self._identity.tier_id is None:
                self._call("init_table", spec.name, self._identity.check_record)
            key = meta_key(self._ns, spec.name)
            record = spec_record(spec, self.default_buckets)
            payload = json.dumps(record, sort_keys=True).encode()
            stored = self._call(
                "init_table", spec.name, lambda: self._claim_meta(key, payload, spec.name)
            )
            if stored is not None:
                self._check_compatible(spec, stored, "on the server")
                table = self._layout(spec, int(stored["buckets"]))
                server_state = (stored["state_dim"], float(stored["state_init"]))
                if server_state != (spec.state_dim, float(spec.state_init)):
                    if self.shared or spec.state_dim == 0:
                        # A view: the rows keep the server's state (`view_layout`).
                        table = view_layout(table, spec, *server_state)
                        record.update(state_dim=server_state[0], state_init=server_state[1])
                    else:
                        self._reset_state(table)
                if self.shared:
                    pass  # a reader records nothing
                elif any(stored[k] != record[k] for k in ("state_dim", "state_init", "seed")):
                    record["buckets"] = table.buckets
                    payload = json.dumps(record, sort_keys=True).encode()
                    self._call("init_table", spec.name, lambda: self._client.set(key, payload))
            else:
                table = self._layout(spec, self.default_buckets)
            with self._lock:
                self._tables[spec.name] = table
            self._call("init_table", spec.name, lambda: self._check_expected(table))

    def _layout(self, spec: TableSpec, buckets: int) -> TableLayout:
        """The table's key layout; its mark book is created on first declaration and kept
        across re-declarations (the acknowledged writes stay acknowledged)."""
        table = table_layout(self._ns, spec, buckets, self.cluster)
        self._marks.register(table)
        if self.cluster:
            # The epoch was taken in bucket 0's fence; every bucket's fence follows it before
            # this job writes (a fence is only ever raised: an older job's epoch never wins).
            self._call("init_table", spec.name, lambda: self._raise_fences(spec.name, table))
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
            if self.shared:  # read-only: nothing is created
                rows, made = self._call("get", table, partial(self._read_chunk, t, chunk)), 0
            else:
                rows, made = self._call("get", table, partial(self._get_chunk, t, chunk))
            out[start : start + chunk.numel()] = rows
            created += made
        self._count("read", ids.numel(), t, created=created)
        return out

    def read(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Rows of ``ids`` without creating any on the server: rows not there read as their
        initial values (one MGET per chunk, write marks checked as for `get`).

        Args:
            table: a declared table.
            ids: integer ``[n]``, in range for the table.
            pin: ignored: no table here is bounded.

        Returns:
            stored rows ``[n, stored_width]`` of the table's dtype.
        """
        del pin
        with self._lock:
            t = self._table(table)
        ids = checked_ids(t.spec, ids)
        out = torch.empty(ids.numel(), t.spec.stored_width, dtype=t.spec.dtype)
        for start in range(0, ids.numel(), self.chunk_rows):
            chunk = ids[start : start + self.chunk_rows]
            rows = self._call("read", table, partial(self._read_chunk, t, chunk))
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
        self._check_writable("remove", table)
        ids = checked_ids(t.spec, ids)
        # Forgotten before the DEL: a read racing it must not take the row for lost.
        self._written_ids(t).discard(ids)
        for part in ids.split(self.chunk_rows):
            batch = key_batch(t, part, self.cluster)
            fence = self._writer_fence(t)
            self._call("remove", table, partial(self._marks.write, t, batch, None, fence))

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
        written = self._written_ids(t).ids()
        absent = written[~torch.isin(written, ids)]
        if absent.numel():
            self._call(
                "export_rows", table, lambda: self._check_not_lost(t, absent, "a checkpoint export")
            )
        return self._export_chunks(t, ids, chunk_rows)

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

    def flush(self) -> None:
        """Nothing is buffered here; a flush re-checks the tier: every write mark this client
        wrote and the eviction policy (`TierDataLossError`, `TierConfigError`)."""
        with self._lock:
            names = list(self._tables)
        if names:
            self._call("flush", names[0], self._verify_tables)

    # -- the tier's identity ---------------------------------------------------------------

    def tier_state(self, count_rows: bool = True) -> TierState:
        """What the tier holds now for the tables declared through this client: the
        namespace record's id, each table's write marks and (``count_rows``: a SCAN of its
        keys) its rows. Record it beside a run or checkpoint, after a flush, and hand it to the
        next run's `expect_state`. Checks the marks first (`TierDataLossError`)."""
        with self._lock:
            self._check_open()
            tables = list(self._tables.values())
        name = tables[0].spec.name if tables else "(none)"
        if self._identity.tier_id is None:
            self._call("tier_state", name, self._identity.check_record)
        states = {}
        for t in tables:
            self._call("tier_state", t.spec.name, partial(self._marks.verify, [t], False))
            marks = self._call("tier_state", t.spec.name, partial(self._identity.marks, t))
            rows = None
            if count_rows:
                rows = self._call("tier_state", t.spec.name, partial(self._scan_ids, t)).numel()
            states[t.spec.name] = TableState(tuple(marks), rows)
        return TierState(self.url, self.namespace, self._identity.tier_id, states)

    def expect_state(self, state: TierState) -> None:
        """Continue from ``state`` (an earlier run's `tier_state`): the namespace record must
        be the same one, and each table declared through this client, now or later, must
        have at least the write marks and rows recorded; otherwise `TierDataLossError` names
        what was lost, and the rows found count as written from then on (one of them missing
        later is a loss too).

        Raises:
            ValueError: ``state`` is of another namespace.
            TierDataLossError: the tier lost what ``state`` recorded.
        """
        if not isinstance(state, TierState):
            raise TypeError(f"expect_state takes a TierState, got {type(state).__name__}")
        if state.namespace != self.namespace:
            raise ValueError(
                f"{self._describe()}: the expected tier state is of namespace "
                f"{state.namespace!r}; open the store with ?namespace={state.namespace}"
            )
        with self._lock:
            self._check_open()
            self._identity.expected = state
            tables = list(self._tables.values())
        name = tables[0].spec.name if tables else "(none)"
        self._call("expect_state", name, self._identity.check_record)
        for t in tables:
            self._call("expect_state", t.spec.name, partial(self._check_expected, t))

    # -- jobs and run records ---------------------------------------------------------------

    def unclean_ends(self) -> list[dict[str, Any]]:
        """Jobs found, when this client took its first table, to have ended without closing
        their store (killed, crashed, or their leases lapsed): rows dirty in their caches
        never reached the tier. Each: ``owner``, ``holder`` ("pid N on HOST"), ``opened``
        (unix time), ``tables``, and the newest ``checkpoint`` and ``steps_done`` it recorded
        (None when it recorded none). Empty for a read-only client; said once: a clean
        `close` forgets them (see `embcache.kv.redis_jobs`)."""
        return [] if self._jobs is None else self._jobs.unclean()

    def save_run_record(self, name: str, record: dict[str, Any]) -> None:
        """Keep ``record`` (JSON-able: a run's tier state, steps, checkpoint) on the server as
        run record ``name`` ("" or a rank's), and note its ``checkpoint`` and ``steps_done``
        as this job's newest (the next job names them if this one dies uncleanly). A
        read-only (``shared``) client records nothing."""
        if self._jobs is None:
            return
        jobs = self._jobs
        steps = int(record.get("steps_done") or 0)
        checkpoint = record.get("checkpoint")
        what = name or "(record)"
        self._call("save_run_record", what, lambda: jobs.save_record(name, record))
        self._call("save_run_record", what, lambda: jobs.note_checkpoint(checkpoint, steps))

    def run_record(self, name: str) -> dict[str, Any] | None:
        """The run record ``name`` kept on the server by `save_run_record` (None: none).

        Raises:
            ValueError: the record is damaged, naming its key.
        """
        return self._call(
            "run_record", name or "(record)", lambda: read_record(self._client, self._ns, name)
        )

    def _check_expected(self, t: TableLayout) -> None:
        self._identity.check_table(t, self._scan_ids, self._written_ids(t))

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
        """A clean end: delete this job's record of an open job on the server (and those of
        the unclean ends it reported), release this client's exclusive leases and close the
        connections. Any later call but `close` raises ``RuntimeError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tables.clear()
        self._leases.close()  # the job's field on the server first (`before_close`)
        self._client.close()

    def __enter__(self) -> RedisKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        mode = ", shared" if self.shared else ""
        return f"RedisKV({self.url!r}, namespace={self.namespace!r}, {kind}{mode})"

    # -- bookkeeping -----------------------------------------------------------------------

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
