"""The machinery under every `RedisKV` call: the constructor's option checks, and the call
layer `RedisKV` holds (`RedisCalls`): the connection and its guards, retries with backoff
(`RedisCalls.call`) and the checks made before and after each try (the table still leased to
us, not known lost, the server not evicting keys, the write marks read back).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import redis.cluster

from embcache.kv.errors import (
    TierAuthError,
    TierCommandError,
    TierConfigError,
    TierFullError,
    TierOwnershipError,
    TierUnavailableError,
)
from embcache.kv.redact import check_url, redact_url
from embcache.kv.redis_identity import TierIdentity, eviction_problem
from embcache.kv.redis_lease import RAISE_FENCE, TableLeases
from embcache.kv.redis_tables import RedisTables
from embcache.kv.redis_wire import (
    NAMESPACE_RE,
    TRANSIENT,
    Fenced,
    TableLayout,
    auth_message,
    error_text,
    redis_url_params,
    run_commands,
)
from embcache.kv.write_marks import MarkGuard

_T = TypeVar("_T")
SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


def check_options(
    url: object,
    namespace: object,
    owner: object,
    shared: object,
    lease_ttl_s: object,
    counts: dict[str, object],
    durations: dict[str, object],
    takeover: object = None,
) -> None:
    """`RedisKV`'s constructor arguments, checked before anything connects.

    Args:
        counts: name -> a value that must be a positive int.
        durations: name -> a value that must be a number >= 0.

    Raises:
        ValueError, TypeError: the first bad one, named (a URL without its password).
    """
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        shown = redact_url(url) if isinstance(url, str) else url
        raise ValueError(f"RedisKV url must start with one of {SCHEMES}, got {shown!r}")
    check_url(url, redis_url_params())
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(
            f"namespace must be letters, digits and '_.-/' (no ':' or braces, which would "
            f"change the key layout), got {namespace!r}"
        )
    for name, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in durations.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if isinstance(lease_ttl_s, bool) or not isinstance(lease_ttl_s, int | float):
        raise ValueError(f"lease_ttl_s must be a number > 0, got {lease_ttl_s!r}")
    if not lease_ttl_s > 0:
        raise ValueError(f"lease_ttl_s must be a number > 0, got {lease_ttl_s!r}")
    if not isinstance(shared, bool):
        raise TypeError(f"shared must be a bool, got {shared!r}")
    for name, token in (("owner", owner), ("takeover", takeover)):
        if token is not None and (not isinstance(token, str) or not token or "\n" in token):
            raise ValueError(f"{name} must be a non-empty one-line string or None, got {token!r}")
    if takeover is not None and takeover == owner:
        raise ValueError(
            f"takeover names the job this one continues, not this job: got owner=takeover="
            f"{owner!r} (give the resumed job its own owner token, or none)"
        )


def describe_tier(url: str, namespace: str) -> str:
    """How messages name a tier: "Redis tier URL (namespace 'ns')"."""
    return f"Redis tier {url} (namespace {namespace!r})"


@dataclass(frozen=True)
class Backoff:
    """How one chunk retries a lost connection: for up to ``timeout_s`` in all, pausing
    ``first_s`` at first and twice as long each time after, up to ``max_s``."""

    timeout_s: float
    first_s: float
    max_s: float


class RedisCalls:
    """The connection of one `RedisKV` and its guards, with the retries and checks around each
    network call (`call`).

    Args:
        client: the redis-py client (`embcache.kv.redis_wire.connect`).
        tables: the client's tables (whether it is closed, which tables to verify).
        marks: the write marks of the tables (`MarkGuard`).
        identity: the namespace record and the state it is expected to continue from.
        leases: the tables' owner leases and epochs (`TableLeases`).
        reconnected: set by every new connection: the server behind it may have restarted.
        url: the server's URL without its password; ``namespace``: the key prefix.
        cluster: whether ``client`` talks to a Redis Cluster.
        backoff: the retries of a lost connection.
        verify_interval_s: how often every write mark this client wrote is read back.
    """

    def __init__(
        self,
        client: Any,
        tables: RedisTables,
        marks: MarkGuard,
        identity: TierIdentity,
        leases: TableLeases,
        reconnected: threading.Event,
        *,
        url: str,
        namespace: str,
        cluster: bool,
        backoff: Backoff,
        verify_interval_s: float,
    ) -> None:
        self.client = client
        self.marks = marks
        self.identity = identity
        self.leases = leases
        self.url = url
        self.namespace = namespace
        self.cluster = cluster
        self.backoff = backoff
        self.verify_interval_s = verify_interval_s
        self._tables = tables
        self._reconnected = reconnected
        self._verified_at = time.monotonic()
        self._config_error: str | None = None  # the server may evict keys: why

    @property
    def shared(self) -> bool:
        """True when tables are opened shared, that is read-only (see `RedisKV`)."""
        return self.leases.shared

    def describe(self) -> str:
        return describe_tier(self.url, self.namespace)

    def fence(self, table: str) -> bytes | None:
        """The epoch this client writes ``table`` under (None for a read-only client)."""
        return self.leases.epoch(table)

    def check_writable(self, op: str, table: str) -> None:
        if self.shared:
            raise TierOwnershipError(
                f"{self.describe()}: {op} on table {table!r} refused: this client opened the "
                f"tables shared (?shared=1, RedisKV(shared=True)), which is read-only. Two "
                f"jobs writing one table overwrite each other's updates (each write-back is "
                f"a whole row). Train from one job (the default: its tables are leased to "
                f"it), give every rank of one distributed job the same ?owner=TOKEN, or give "
                f"each job its own ?namespace=NAME."
            )

    def call(self, op: str, table: str, fn: Callable[[], _T]) -> _T:
        """``fn()``, retried on connection errors with exponential backoff for up to
        ``backoff.timeout_s``; then `TierUnavailableError` naming URL, table and operation.

        Before each try the table must still be ours (lease) and not known to be lost; a try
        that finds the table's epoch moved on (another job took it over) is
        `TierOwnershipError`; after a try that needed retries (a reconnect), and every
        ``verify_interval_s``, every write mark this client wrote is read back.
        """
        start = time.monotonic()
        deadline = start + self.backoff.timeout_s
        pause = self.backoff.first_s
        attempts = 0
        restored = False
        while True:
            self._tables.check_open()
            self._check_usable(table)
            attempts += 1
            try:
                if self._config_error is not None:
                    self._recheck_config(table)
                result = fn()
            except Fenced as err:
                if not err.found and not restored and self.leases.restore(table):
                    # The epoch was gone with the server's keys, and nobody took the table:
                    # this client's is back (lost rows are the write marks' business).
                    restored = True
                    self.raise_fences(table)
                    continue
                self.leases.deposed(table, err.found)
            except redis.exceptions.AuthenticationError as err:
                raise TierAuthError(auth_message(self.url, err)) from None
            except TRANSIENT as err:
                now = time.monotonic()
                if now >= deadline:
                    raise TierUnavailableError(
                        f"{self.describe()} unavailable: {op} on table {table!r} failed "
                        f"{attempts} time(s) over {now - start:.2f}s "
                        f"(retry_timeout_s={self.backoff.timeout_s:g}): {error_text(err)}"
                    ) from None
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, self.backoff.max_s)
                self._refresh_topology()
                continue
            except redis.exceptions.ResponseError as err:
                if isinstance(err, redis.exceptions.OutOfMemoryError):
                    raise TierFullError(
                        f"{self.describe()} is full: {op} on table {table!r} was refused "
                        f"({type(err).__name__}): {error_text(err)} Nothing was lost (the rows "
                        f"stay in the cache); "
                        f"raise the server's maxmemory, or bound the tables in front of it "
                        f"(a tier capacity), then repeat the call"
                    ) from None
                raise TierCommandError(
                    f"{self.describe()}: {op} on table {table!r} was refused by the server "
                    f"({type(err).__name__}): {error_text(err)}"
                ) from None
            overdue = time.monotonic() - self._verified_at > self.verify_interval_s
            if attempts > 1 or overdue or self._reconnected.is_set():
                self._reconnected.clear()
                self.verify_tables()
            return result

    def raise_fences(self, table: str, t: TableLayout | None = None) -> None:
        """On a cluster, raise every bucket's fence of ``table`` (laid out as ``t``, or as
        declared) to this client's epoch (taken in bucket 0's), before this client writes; a
        single server has one fence."""
        if t is None:
            t = self._tables.find(table, check_open=False)
        epoch = self.leases.epoch(table)
        if not self.cluster or t is None or not epoch:
            return
        commands = [
            (slot, ("EVAL", RAISE_FENCE, 1, key, epoch))
            for key, slot in zip(t.fence_keys, t.mark_slots, strict=True)
        ]
        run_commands(self.client, commands)

    def verify_tables(self) -> None:
        """`MarkGuard.verify` of every table; a server down again is left to the next call."""
        self._verified_at = time.monotonic()
        tables = self._tables.layouts()
        problem = None
        with contextlib.suppress(*TRANSIENT):
            self.marks.verify(tables, restore=not self.shared)
            if tables:
                problem = eviction_problem(
                    self.client, self.describe(), tables[0].spec.name, running=True
                )
        if problem is not None:
            self._config_error = problem
            raise TierConfigError(problem)

    def check_eviction_policy(self, table: str) -> None:
        """Refuse a server that may evict keys once full: any ``maxmemory-policy`` but
        ``noeviction`` under a ``maxmemory``. ``allkeys-*`` would drop rows, re-created from
        their initial values, silently when their bucket's write mark survived; ``volatile-*``
        evicts the keys with a TTL, which are the owner leases: a lease dropped while its job
        runs lets a second job take the table and both write it. ``noeviction`` refuses writes
        instead (`TierFullError`), and nothing is lost. Checked again every
        ``verify_interval_s`` and on `RedisKV.flush` while the job runs."""
        problem = eviction_problem(self.client, self.describe(), table)
        if problem is not None:
            raise TierConfigError(problem)

    def _check_usable(self, table: str) -> None:
        self.identity.check_usable()
        self.marks.check_usable(table)
        self.leases.check(table)

    def _refresh_topology(self) -> None:
        """On a cluster, re-read the slot map (a node failed over, a slot moved)."""
        if not isinstance(self.client, redis.cluster.RedisCluster):
            return
        # When the cluster is still down this fails too; the next retry tries again.
        with contextlib.suppress(
            redis.exceptions.RedisError, redis.exceptions.RedisClusterException
        ):
            self.client.nodes_manager.initialize()

    def _recheck_config(self, table: str) -> None:
        """While the server may evict keys, every call asks again (one INFO) and is refused
        until the policy is back to noeviction."""
        problem = eviction_problem(self.client, self.describe(), table, running=True)
        self._config_error = problem
        if problem is not None:
            raise TierConfigError(problem)
