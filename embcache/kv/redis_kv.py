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

The class reads top to bottom as its public calls, each handed to a part it holds: the
connection with its guards and the retries and checks around each round trip
(`embcache.kv.redis_calls`, `RedisCalls`), the chunked row I/O under them
(`embcache.kv.redis_rows`, `RedisRowIO`), the declaration of a table
(`embcache.kv.redis_declare`, `TableDeclarations`) and the registry of the tables declared
through this client (`embcache.kv.redis_tables`, `RedisTables`).
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from embcache.kv.base import Store, TableSpec
from embcache.kv.errors import TierUnavailableError
from embcache.kv.redact import redact_url
from embcache.kv.redis_calls import Backoff, RedisCalls, check_options, describe_tier
from embcache.kv.redis_declare import TableDeclarations
from embcache.kv.redis_identity import TierIdentity
from embcache.kv.redis_jobs import JobRegistry, read_record
from embcache.kv.redis_lease import TableLeases
from embcache.kv.redis_rows import RedisRowIO
from embcache.kv.redis_tables import RedisTables
from embcache.kv.redis_wire import DEFAULT_BUCKETS, TRANSIENT, connect
from embcache.kv.tier_state import TierState
from embcache.kv.write_marks import MarkGuard

__all__ = ["RedisKV", "TierUnavailableError"]


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
        self.verify_interval_s = float(verify_interval_s)
        self._ns = namespace.encode()
        self._tables = RedisTables(self.url)
        describe = partial(describe_tier, self.url, namespace)
        # Set by every new connection: the server behind it may have restarted.
        reconnected = threading.Event()
        self._client = connect(url, self.cluster, socket_timeout_s, self.url, reconnected.set)
        marks = MarkGuard(self._client, self.url, namespace, self.cluster)
        identity = TierIdentity(self._client, self._ns, describe, marks, shared)
        self._leases = TableLeases(
            self._client,
            describe,
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
        self._calls = RedisCalls(
            self._client,
            self._tables,
            marks,
            identity,
            self._leases,
            reconnected,
            url=self.url,
            namespace=namespace,
            cluster=self.cluster,
            backoff=Backoff(self.retry_timeout_s, self.backoff_s, self.max_backoff_s),
            verify_interval_s=self.verify_interval_s,
        )
        self._rows = RedisRowIO(self._calls, self._tables, chunk_rows)
        self._declarations = TableDeclarations(
            self._calls, self._rows, self._tables, self._jobs, buckets
        )

    @property
    def owner(self) -> str:
        """This client's owner token (a later run that continues this one gives it as
        ``takeover=``; ranks of this job give it as ``owner=``)."""
        return self._leases.owner

    @property
    def lease_owner(self) -> str | None:
        return self.owner

    @property
    def shared(self) -> bool:
        """True when tables are opened shared, that is read-only."""
        return self._leases.shared

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
        self._declarations.declare(spec)

    def table_spec(self, table: str) -> TableSpec:
        """A copy of the spec ``table`` was (last) declared with through this client."""
        return dataclasses.replace(self._tables.table(table).spec)

    def tables(self) -> list[str]:
        """Tables declared through this client, in declaration order."""
        return [t.spec.name for t in self._tables.layouts(check_open=True)]

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
        return self._rows.get(self._tables.table(table), ids)

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
        return self._rows.read(self._tables.table(table), ids)

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite (creating) the rows of ``ids``.

        Chunks are written in order; if one fails for good, the earlier chunks are written and
        the rest are not. Writes are whole rows, so repeating the whole `put` is always safe.

        Args:
            table: a declared table.
            ids: integer ``[n]``, in range for the table.
            rows: stored rows, or floating ``[n, dim + state_dim]``.
        """
        t = self._tables.table(table)
        self._rows.write(t, "put", ids, rows)
        self._tables.count("written", ids.numel(), t)

    def remove(self, table: str, ids: torch.Tensor) -> None:
        """Delete the rows of ``ids`` (DEL, with the write marks incremented like any write)."""
        self._rows.remove(self._tables.table(table), ids)

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
        return self._rows.export(self._tables.table(table), chunk_rows)

    def import_rows(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        """Load checkpointed rows: `put` without counting in `io_stats` (no scores: no table
        is bounded here)."""
        del scores
        self._rows.write(self._tables.table(table), "import_rows", ids, rows)

    # -- accounting and life cycle ---------------------------------------------------------

    def flush(self) -> None:
        """Nothing is buffered here; a flush re-checks the tier: every write mark this client
        wrote and the eviction policy (`TierDataLossError`, `TierConfigError`)."""
        tables = self._tables.layouts()
        if tables:
            self._calls.call("flush", tables[0].spec.name, self._calls.verify_tables)

    # -- the tier's identity ---------------------------------------------------------------

    def tier_state(self, count_rows: bool = True) -> TierState:
        """What the tier holds now for the tables declared through this client: the
        namespace record's id, each table's write marks and (``count_rows``: a SCAN of its
        keys) its rows. Record it beside a run or checkpoint, after a flush, and hand it to the
        next run's `expect_state`. Checks the marks first (`TierDataLossError`)."""
        return self._declarations.state(count_rows)

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
        self._declarations.expect(state)

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
        self._calls.call("save_run_record", what, lambda: jobs.save_record(name, record))
        self._calls.call("save_run_record", what, lambda: jobs.note_checkpoint(checkpoint, steps))

    def run_record(self, name: str) -> dict[str, Any] | None:
        """The run record ``name`` kept on the server by `save_run_record` (None: none).

        Raises:
            ValueError: the record is damaged, naming its key.
        """
        return self._calls.call(
            "run_record", name or "(record)", lambda: read_record(self._client, self._ns, name)
        )

    def io_stats(self) -> dict[str, int]:
        """Traffic through `get`/`read`/`put` since creation or the last `reset_io_stats`.

        Keys as `HostKV`'s: ``rows_read``, ``rows_written``, ``bytes_read``, ``bytes_written``
        (row payload, not protocol bytes), ``get_calls``, ``put_calls``, ``rows_created``
        (rows this client created on the server on first touch, which `get` also writes).
        """
        return self._tables.io_stats()

    def reset_io_stats(self) -> None:
        self._tables.reset_io_stats()

    def close(self) -> None:
        """A clean end: delete this job's record of an open job on the server (and those of
        the unclean ends it reported), release this client's exclusive leases and close the
        connections. Any later call but `close` raises ``RuntimeError``."""
        if not self._tables.close():
            return
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
