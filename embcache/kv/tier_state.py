"""Tier identity and generation: how a later run knows it continues from the tier it left.

Write marks (`embcache.kv.write_marks`) catch a server that loses writes while one client is
alive. Between two runs no client is alive, and a server that came back empty looks exactly
like a namespace nobody wrote yet. So the tier keeps a namespace record, written with the
first table declared by a writing client::

    ns:tier    JSON {"format": 1, "id": <random hex>, "created": <unix time>}

and a run records `TierState` (the id, each table's write marks, its row count) where it keeps
its own state (a run directory, a checkpoint). The next run hands it back with
`expect_tier_state` before declaring its tables; each declaration then checks that

* the namespace record is there, with the same id (else: restarted empty, or re-created);
* every write mark is at least the one recorded (else: an older snapshot, a replica behind);
* the table holds at least the rows recorded (else: rows deleted or evicted behind the job);

and raises `TierDataLossError` naming what was lost. The rows found then count as written
(`WrittenIds`): one of them missing later is a loss too, never a row re-created from its
initial value.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from embcache.kv.id_set import IdSet

if TYPE_CHECKING:
    from embcache.kv.base import Store

STATE_FORMAT = 1


@dataclass(frozen=True)
class TableState:
    """One table as a run left it.

    Attributes:
        marks: the table's write marks (one on a single server, one per bucket on a cluster).
        rows: rows on the server (None: not counted).
    """

    marks: tuple[int, ...]
    rows: int | None = None

    @property
    def generation(self) -> int:
        """Acknowledged writes of the table, over all clients (the sum of its marks)."""
        return sum(self.marks)


@dataclass(frozen=True)
class TierState:
    """What a Redis tier held when a run recorded it (`tier_state`), to be handed to the
    next run (`expect_tier_state`). Plain data: `to_dict`/`from_dict` round-trip it through
    JSON.

    Attributes:
        url: the tier's URL, password hidden (for messages only: never compared).
        namespace: the key prefix.
        tier_id: the id of the namespace record (None: the namespace was never written).
        tables: table name -> `TableState`.
    """

    url: str
    namespace: str
    tier_id: str | None
    tables: dict[str, TableState] = field(default_factory=dict)

    @property
    def generation(self) -> int:
        """Acknowledged writes over all tables."""
        return sum(t.generation for t in self.tables.values())

    @property
    def rows(self) -> int | None:
        """Rows over all tables (None when some table was not counted)."""
        counts = [t.rows for t in self.tables.values() if t.rows is not None]
        return sum(counts) if len(counts) == len(self.tables) else None

    def summary(self) -> str:
        """One line for a run's summary: "started on an empty namespace" or "continued
        from N rows"."""
        where = f"Redis tier {self.url} (namespace {self.namespace!r})"
        if self.tier_id is None or (self.generation == 0 and not self.rows):
            return f"{where}: started on an empty namespace"
        rows = "an uncounted number of" if self.rows is None else f"{self.rows:,}"
        return (
            f"{where}: continued from {rows} rows (tier {self.tier_id}, generation "
            f"{self.generation:,})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "url": self.url,
            "namespace": self.namespace,
            "tier_id": self.tier_id,
            "tables": {
                name: {"marks": list(t.marks), "rows": t.rows} for name, t in self.tables.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TierState:
        """The state `to_dict` wrote.

        Raises:
            ValueError: not such a dict, naming the field.
        """
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            raise ValueError(f"not a tier state of format {STATE_FORMAT}")
        try:
            tables = {
                str(name): TableState(
                    tuple(int(m) for m in t["marks"]),
                    None if t["rows"] is None else int(t["rows"]),
                )
                for name, t in data["tables"].items()
            }
            tier_id = data["tier_id"]
            return cls(str(data["url"]), str(data["namespace"]), tier_id, tables)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"a damaged tier state ({type(err).__name__}: {err})") from None


def tier_state(store: Store, count_rows: bool = True) -> TierState | None:
    """What ``store``'s Redis tier holds now for the tables declared through it, to record
    beside a run or a checkpoint; None for a store that keeps nothing between processes
    (`HostKV`). Call it after a flush: rows still in a cache are not on the tier yet.

    Args:
        store: a `RedisKV`, or a `TieredKV` in front of one.
        count_rows: count each table's rows (a SCAN of its keys, as a checkpoint export does).
    """
    return store.tier_state(count_rows=count_rows)


def expect_tier_state(store: Store, state: TierState | dict[str, Any] | None) -> None:
    """Say that the run on ``store`` continues from ``state`` (what `tier_state` recorded at
    the end of an earlier run): each table declared from then on (and each already declared)
    is checked against it, and a tier that came back empty, older or different raises
    `TierDataLossError`. None, or a store that keeps nothing between processes: no check.

    Raises:
        TierDataLossError: (now, for tables already declared, or when a table is declared)
            the tier lost what ``state`` recorded.
        ValueError: ``state`` is damaged, or names another namespace.
    """
    if state is None:
        return
    if isinstance(state, dict):
        state = TierState.from_dict(state)
    store.expect_state(state)


class WrittenIds:
    """Ids of one table whose rows the tier acknowledged as written: a row of these found
    missing was lost, not never created. Bounded tables keep a flag per row (1 byte a row of
    the table); unbounded ones an `IdSet` (a hash set: 16 to 32 bytes a written id, each call
    constant in the ids written). Thread-safe."""

    def __init__(self, num_embeddings: int | None) -> None:
        self._num_embeddings = num_embeddings
        self._flags: torch.Tensor | None = None
        self._set = IdSet() if num_embeddings is None else None
        self._lock = threading.Lock()

    def add(self, ids: torch.Tensor) -> None:
        with self._lock:
            if self._set is not None:
                self._set.add(ids)
                return
            if self._flags is None:
                self._flags = torch.zeros(self._num_embeddings or 0, dtype=torch.bool)
            self._flags[ids] = True

    def discard(self, ids: torch.Tensor) -> None:
        with self._lock:
            if self._set is not None:
                self._set.discard(ids)
            elif self._flags is not None:
                self._flags[ids] = False

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """bool ``[n]``: which of ``ids`` were written."""
        with self._lock:
            if self._set is not None:
                return self._set.contains(ids)
            if self._flags is None:
                return torch.zeros(ids.numel(), dtype=torch.bool)
            return self._flags[ids]

    def ids(self) -> torch.Tensor:
        """Every written id, ascending."""
        with self._lock:
            if self._set is not None:
                return self._set.sorted()
            if self._flags is None:
                return torch.empty(0, dtype=torch.int64)
            return self._flags.nonzero().flatten()

    @property
    def nbytes(self) -> int:
        """Bytes held for the ids (the flags, or the hash set's slots)."""
        with self._lock:
            if self._set is not None:
                return self._set.nbytes
            return 0 if self._flags is None else self._flags.nbytes


def missing_rows_message(describe: str, table: str, lost: torch.Tensor, how: str) -> str:
    """The one-line message of `TierDataLossError` for written rows found missing."""
    shown = ", ".join(str(i) for i in lost[:5].tolist())
    more = f" and {lost.numel() - 5} more" if lost.numel() > 5 else ""
    return (
        f"{describe} lost rows of table {table!r}: {lost.numel()} row(s) written and "
        f"acknowledged earlier are missing (ids {shown}{more}), found by {how}: deleted behind "
        f"this job, evicted (a maxmemory-policy other than noeviction), or a FLUSHDB. They "
        f"would be re-created from their initial values; stop this job and resume from the "
        f"last checkpoint (embcache train --resume DIR, or embcache.load)."
    )


def state_loss_message(describe: str, expected: TierState, what: str) -> str:
    """The one-line message of `TierDataLossError` for a tier that is not the one expected."""
    rows = "" if expected.rows is None else f", {expected.rows:,} rows"
    return (
        f"{describe} is not the tier this run continues from: {what}. The earlier run left "
        f"tier {expected.tier_id} (generation {expected.generation:,}{rows}); its rows would "
        f"be re-created from their initial values. Resume from the last checkpoint (embcache "
        f"train --resume DIR, or embcache.load), or start afresh on a new namespace "
        f"(?namespace=NAME). README 'Durability and security' lists the Redis settings that "
        f"prevent this."
    )
