"""The tables one `RedisKV` client declared, and what it keeps about them here: their key
layouts, the rows whose writes the server acknowledged, its traffic counters, whether it is
closed. A part `RedisKV` holds (`RedisTables`), shared with its call layer and row I/O.
"""

from __future__ import annotations

import threading

from embcache.kv.base import IOStats
from embcache.kv.redis_wire import TableLayout
from embcache.kv.tier_state import WrittenIds


class RedisTables:
    """The registry of one `RedisKV` client, behind one lock that every method takes.

    Args:
        url: the server's URL without its password (for the message of a closed client).

    Rows this client wrote are remembered per table (`WrittenIds`), so that one found missing
    is a loss, never a row re-created.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.lock = threading.Lock()
        self._layouts: dict[str, TableLayout] = {}
        self._written: dict[str, WrittenIds] = {}
        self._stats = IOStats()
        self._closed = False

    def check_open(self) -> None:
        """``RuntimeError`` once `close` ran."""
        if self._closed:
            raise RuntimeError(f"RedisKV({self.url}) is closed")

    def table(self, name: str) -> TableLayout:
        """The layout ``name`` was (last) declared with (``KeyError`` naming the known ones)."""
        with self.lock:
            self.check_open()
            table = self._layouts.get(name)
            if table is None:
                raise KeyError(f"unknown table {name!r}; known tables: {sorted(self._layouts)}")
            return table

    def find(self, name: str, check_open: bool = True) -> TableLayout | None:
        """The layout of ``name``, None when it was not declared through this client."""
        with self.lock:
            if check_open:
                self.check_open()
            return self._layouts.get(name)

    def add(self, table: TableLayout) -> None:
        """Declare (or re-declare) ``table``."""
        with self.lock:
            self._layouts[table.spec.name] = table

    def layouts(self, check_open: bool = False) -> list[TableLayout]:
        """Every declared table's layout, in declaration order."""
        with self.lock:
            if check_open:
                self.check_open()
            return list(self._layouts.values())

    def written_ids(self, t: TableLayout) -> WrittenIds:
        """The ids of ``t``'s rows whose writes were acknowledged (an empty set at first)."""
        with self.lock:
            written = self._written.get(t.spec.name)
            if written is None:
                written = self._written[t.spec.name] = WrittenIds(t.spec.num_embeddings)
            return written

    def written(self, table: str) -> WrittenIds | None:
        """The acknowledged ids of ``table``; None when this client wrote none of its rows."""
        with self.lock:
            return self._written.get(table)

    def count(self, direction: str, n: int, t: TableLayout, created: int = 0) -> None:
        """One ``get``/``read`` (``direction="read"``) or ``put`` (``"written"``) of ``n``
        rows, ``created`` of them made on first touch."""
        with self.lock:
            self._stats.count(direction, n, t.row_bytes)
            self._stats["rows_created"] += created

    def io_stats(self) -> dict[str, int]:
        """A copy of the counters (`IOStats`)."""
        with self.lock:
            return dict(self._stats)

    def reset_io_stats(self) -> None:
        with self.lock:
            self._stats.reset()

    def close(self) -> bool:
        """Forget every table; False when the client was closed already."""
        with self.lock:
            if self._closed:
                return False
            self._closed = True
            self._layouts.clear()
            return True
