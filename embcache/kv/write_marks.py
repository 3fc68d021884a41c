"""Write marks: how `RedisKV` notices a server that lost writes it had acknowledged.

A Redis server can come back from a restart empty (no persistence), from an older RDB snapshot,
or as a replica that had not caught up; a cluster node can restart with no data. Its replies
are then well-formed, and a row that is missing would simply be created again from its initial
value: a silent reset of training. Write marks turn that into `TierDataLossError`.

Each table has mark keys beside its rows: one per table on a single server
(``ns:seq:T``), one per hash-tag bucket on a cluster (``ns:seq:{h.b}:T``, in the slot of the
bucket's rows, so a node that lost its rows lost their marks too). Every write of rows runs
``INCR`` of the marks of the buckets it wrote in the same script (the fenced write of
`embcache.kv.redis_wire`): the server applies them in order, so any state of the server
(live, AOF, RDB, replica) that holds a mark value also holds every row write that came
before it. This client remembers, per mark, the highest value its acknowledged writes returned:

* a write whose ``INCR`` returns a value not above the one remembered when it was sent ran on a
  server that had lost writes (a missing mark counts as 0);
* a read sends ``GET`` of the marks before its ``MGET``; a mark below the value remembered when
  the read was sent means the rows read may be stale or re-created;
* after every reconnect, and every ``verify_interval_s``, every mark this client has written is
  read back, with the table's spec record.

Concurrent writers (threads, or jobs sharing tables) only ever raise a mark, so no healthy
server trips the check. Rows created on first touch do not count as writes: their value is
the initialiser's, which a server that lost them gives back identically.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, NoReturn

from redis.crc import key_slot

from embcache.kv.errors import TierCommandError, TierDataLossError
from embcache.kv.redis_wire import (
    Client,
    KeyBatch,
    TableLayout,
    read_marked,
    run_commands,
    spec_record,
    write_marked,
)


@dataclass
class MarkBook:
    """What one client knows about one table's marks.

    Attributes:
        units: number of marks (1 on a single server, the bucket count on a cluster).
        acked: per mark, the highest value an acknowledged write of this client returned.
        lost: once a loss was seen, its message: the table stays unusable for this client.
    """

    units: int
    acked: list[int] = field(init=False)
    lost: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.acked = [0] * self.units

    def snapshot(self) -> list[int]:
        """The values every mark must still have on the server: taken before a call is sent,
        so that writes acknowledged to other threads meanwhile do not count against it."""
        with self._lock:
            return list(self.acked)

    def expect(self, values: list[int]) -> None:
        """Count ``values`` (marks an earlier run recorded) as acknowledged: a mark found below
        one of them from now on is a loss, as if this client had written it."""
        with self._lock:
            self.acked = [max(a, v) for a, v in zip(self.acked, values, strict=True)]

    def written(self) -> list[int]:
        """Marks this client has written (acknowledged value above 0)."""
        with self._lock:
            return [u for u, value in enumerate(self.acked) if value > 0]

    @staticmethod
    def check_read(
        units: list[int], expected: list[int], found: list[object]
    ) -> tuple[int, int, int] | None:
        """``(unit, found, expected)`` of the first mark read below its ``expected[unit]``
        (a `snapshot`), or None."""
        for unit, value in zip(units, found, strict=True):
            have = parse_mark(value)
            if have < expected[unit]:
                return unit, have, expected[unit]
        return None

    def record_write(
        self, units: list[int], expected: list[int], replies: list[object]
    ) -> tuple[int, int, int] | None:
        """Take the ``INCR`` replies of a write sent after the `snapshot` ``expected``: the
        first mark that shows a loss, as ``(unit, value before the write, expected)``, or None
        (and the new values are remembered)."""
        values = [parse_mark(reply) for reply in replies]
        for unit, value in zip(units, values, strict=True):
            if value <= expected[unit]:
                return unit, value - 1, expected[unit]
        with self._lock:
            for unit, value in zip(units, values, strict=True):
                self.acked[unit] = max(self.acked[unit], value)
        return None


def parse_mark(value: object) -> int:
    """A mark as the server returned it (None when absent: 0), or a ValueError."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise ValueError(f"a write mark on the server holds {value!r}, not a count")
    return number


def loss_message(url: str, namespace: str, table: str, mark: str, found: int, expected: int) -> str:
    """The one-line message of `TierDataLossError` for a table whose mark went back."""
    state = "is missing" if found == 0 else f"is {found}"
    return (
        f"Redis tier {url} (namespace {namespace!r}) lost acknowledged writes of table "
        f"{table!r}: its write mark {mark} {state}, but this client had {expected} writes "
        f"acknowledged (the server restarted without persistence, came back from an older "
        f"snapshot, failed over to a replica that was behind, or a cluster node lost its data). "
        f"Rows updated since then are gone and would be re-created from their initial values; "
        f"stop this job and resume from the last checkpoint (embcache train --resume DIR, or "
        f"embcache.load). README 'Durability and security' lists the Redis settings that "
        f"prevent this."
    )


class MarkGuard:
    """The marks of every table of one `RedisKV`: checked reads and writes, and read-backs.

    Args:
        client: the redis-py client.
        url: the tier's URL, password hidden.
        namespace: the key prefix.
        cluster: a Redis Cluster (marks per bucket) or a single server (one per table).
    """

    def __init__(self, client: Client, url: str, namespace: str, cluster: bool) -> None:
        self._client = client
        self.url = url
        self.namespace = namespace
        self.cluster = cluster
        self._books: dict[str, MarkBook] = {}
        self._lock = threading.Lock()

    def register(self, t: TableLayout) -> None:
        """Start tracking a declared table (kept across re-declarations: the acknowledged
        writes stay acknowledged)."""
        with self._lock:
            book = self._books.get(t.spec.name)
            if book is None or book.units != len(t.mark_keys):
                self._books[t.spec.name] = MarkBook(len(t.mark_keys))

    def check_usable(self, table: str) -> None:
        """Raise `TierDataLossError` again for a table already found lost."""
        with self._lock:
            book = self._books.get(table)
        if book is not None and book.lost is not None:
            raise TierDataLossError(book.lost)

    def book(self, table: str) -> MarkBook:
        """The mark book of a registered table."""
        with self._lock:
            return self._books[table]

    def fail(self, table: str, message: str) -> NoReturn:
        """Record a loss found by other means (rows missing, a tier that is not the expected
        one): the table stays unusable, as after a mark that went back."""
        self.book(table).lost = message
        raise TierDataLossError(message)

    def read(
        self, t: TableLayout, batch: KeyBatch, fence: bytes | None = None
    ) -> list[bytes | None]:
        """Values of ``batch.keys`` (None where absent), after checking the marks of their
        buckets, read in the same round trip just before them (and, given ``fence``, the
        writer's epoch: `Fenced` when the table was taken over)."""
        book = self._book(t)
        expected = book.snapshot()
        values, units, marks = read_marked(self._client, t, batch, fence)
        self._check(t, book, units, expected, marks)
        return values

    def write(
        self, t: TableLayout, batch: KeyBatch, blobs: list[bytes] | None, fence: bytes
    ) -> None:
        """Write ``blobs`` (in the batch's key order; None deletes the keys), each group
        with its marks' INCR, if the table's epoch is still ``fence`` (else `Fenced`); a
        mark not above the value remembered is `TierDataLossError`."""
        book = self._book(t)
        expected = book.snapshot()
        units, replies = write_marked(self._client, t, batch, blobs, fence)
        self._check(t, book, units, expected, replies, wrote=True)

    def verify(self, tables: list[TableLayout], restore: bool = True) -> None:
        """Read back every mark written through this client and the tables' spec records: a
        mark gone back is `TierDataLossError`; a record gone while no write of ours was lost
        (a restarted server we had only read from) is recorded again unless ``restore`` is
        False (a read-only client). Connection errors propagate (the caller retries or leaves
        it to the next call)."""
        commands: list[tuple[int, tuple[Any, ...]]] = []
        plan: list[tuple[TableLayout, MarkBook, list[int], list[int]]] = []
        for t in tables:
            book = self._book(t)
            units, expected = book.written(), book.snapshot()
            commands.append((key_slot(t.meta_key) if self.cluster else -1, ("GET", t.meta_key)))
            commands.extend((t.mark_slots[u], ("GET", t.mark_keys[u])) for u in units)
            plan.append((t, book, units, expected))
        replies = run_commands(self._client, commands)
        k = 0
        for t, book, units, expected in plan:
            meta, marks = replies[k], replies[k + 1 : k + 1 + len(units)]
            k += 1 + len(units)
            self._check(t, book, units, expected, marks)
            if meta is None and restore:
                payload = json.dumps(spec_record(t.spec, t.buckets), sort_keys=True).encode()
                self._client.set(t.meta_key, payload, nx=True)

    def _book(self, t: TableLayout) -> MarkBook:
        with self._lock:
            return self._books[t.spec.name]

    def _check(
        self,
        t: TableLayout,
        book: MarkBook,
        units: list[int],
        expected: list[int],
        found: list[Any],
        wrote: bool = False,
    ) -> None:
        try:
            if wrote:
                lost = book.record_write(units, expected, found)
            else:
                lost = book.check_read(units, expected, found)
        except ValueError as err:
            raise TierCommandError(
                f"Redis tier {self.url} (namespace {self.namespace!r}): table {t.spec.name!r}: "
                f"{err} (damaged, or written by something other than embcache)"
            ) from None
        if lost is None:
            return
        unit, value, want = lost
        mark = t.mark_keys[unit].decode(errors="replace")
        book.lost = loss_message(self.url, self.namespace, t.spec.name, mark, value, want)
        raise TierDataLossError(book.lost)
