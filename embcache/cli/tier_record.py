"""What ``embcache train`` remembers of a Redis tier between two runs, so that a run that
continues from the tier is refused when the tier lost rows since (restarted empty, rolled
back to an older snapshot, the namespace re-created or rows deleted), instead of re-creating
them from their initial values.

A run on a persistent tier (``redis://``, ``redis+cluster://``, ``tiered+redis://``...)
records the tier's state (`embcache.kv.tier_state`: the namespace record's id, each table's
write marks and rows) after its final flush and at each checkpoint, in a run record keyed by
the server and namespace::

    ./.embcache/tiers/<key>.json              one process
    ./.embcache/tiers/<key>.rank-<r>-of-<W>.json   each rank of W

(under the current directory, or the directory ``$EMBCACHE_TIER_RECORDS`` names; the key
hashes the server's address and the namespace, never a password), and in the checkpoint's
``extra`` (``tier_state``). The next run of the command in the same directory hands the
record to `embcache.kv.expect_tier_state` before declaring its tables. ``--resume DIR``
restores the rows from the checkpoint instead (nothing is refused; the summary says what the
tier held), and ``--fresh-tier`` starts over without the check.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embcache.kv import Store, TierDataLossError, TierState, expect_tier_state

RECORD_DIR = Path(".embcache") / "tiers"
RECORD_DIR_ENV = "EMBCACHE_TIER_RECORDS"  # a directory instead of ./.embcache/tiers
RECORD_FORMAT = 1


def tier_location(store_url: str) -> tuple[str, str] | None:
    """``(server, namespace)`` of a Redis store URL: the server as scheme, host, port and
    database (or socket path), without password or options; None for a tier that keeps
    nothing between processes ('host')."""
    scheme, sep, rest = store_url.partition("://")
    if not sep:
        return None
    scheme = scheme.lower().removeprefix("tiered+")
    parts = urllib.parse.urlsplit(f"{scheme}://{rest}")
    namespace = dict(urllib.parse.parse_qsl(parts.query)).get("namespace", "embcache")
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or ""
    server = f"{scheme}://{host}{'' if port is None else f':{port}'}{parts.path or ''}"
    if scheme == "unix":
        db = dict(urllib.parse.parse_qsl(parts.query)).get("db", "0")
        server = f"unix://{parts.path}?db={db}"
    return server, namespace


def record_path(
    store_url: str, rank: int = 0, world: int = 1, root: Path | None = None
) -> Path | None:
    """Where the run record of ``store_url`` is kept (None: a tier with nothing to record)."""
    where = tier_location(store_url)
    if where is None:
        return None
    key = hashlib.sha256("\0".join(where).encode()).hexdigest()[:16]
    name = f"{key}.json" if world == 1 else f"{key}.rank-{rank}-of-{world}.json"
    if root is None and os.environ.get(RECORD_DIR_ENV):
        return Path(os.environ[RECORD_DIR_ENV]) / name
    return (root or Path.cwd()) / RECORD_DIR / name


def read_record(path: Path) -> dict[str, Any] | None:
    """The tier state a run recorded in ``path`` (None: no record there).

    Raises:
        ValueError: the file is damaged, naming it.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if data.get("format") != RECORD_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {RECORD_FORMAT}")
        TierState.from_dict(data["state"])
        return data["state"]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"the run record {path} is damaged ({err}): delete it, or give --fresh-tier"
        ) from None


def write_record(path: Path, state: TierState, steps_done: int) -> None:
    """Record ``state`` in ``path``, atomically (a crash keeps the previous record)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "format": RECORD_FORMAT,
        "written": time.time(),
        "steps_done": steps_done,
        "state": state.to_dict(),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


@dataclass
class TierRecord:
    """One job's side of the run record (see the module docstring).

    Args:
        path: the run record (None: the tier keeps nothing between processes).
        expected: the state the last run recorded, checked by `expect` (None: nothing to
            check: no record, ``--resume``, ``--fresh-tier``).
        resumed_from: the tier state ``--resume``'s checkpoint recorded, for the summary.
    """

    path: Path | None
    expected: dict[str, Any] | None = None
    resumed_from: dict[str, Any] | None = None
    start: TierState | None = field(default=None, init=False)

    @classmethod
    def for_job(
        cls,
        store_url: str,
        rank: int,
        world: int,
        resume_extra: dict[str, Any] | None,
        fresh: bool,
    ) -> TierRecord:
        """The record of a job on ``store_url``; ``resume_extra``: ``--resume``'s checkpoint
        extra (None without ``--resume``).

        Raises:
            ValueError: the record is damaged.
        """
        path = record_path(store_url, rank, world)
        if path is None:
            return cls(None)
        if resume_extra is not None:
            saved = resume_extra.get("tier_state")
            return cls(path, resumed_from=saved if isinstance(saved, dict) else None)
        return cls(path, expected=None if fresh else read_record(path))

    def expect(self, store: Store) -> None:
        """`expect_tier_state` with the recorded state: right after opening the store."""
        if self.expected is not None:
            expect_tier_state(store, self.expected)

    def refusal(self, err: TierDataLossError) -> TierDataLossError:
        """``err`` with what to do from the command line, when the run record caused it."""
        if self.expected is None:
            return err
        return TierDataLossError(
            f"{' '.join(str(err).split())} (checked against the last run's record "
            f"{self.path}; --fresh-tier starts over on this namespace without the check)"
        )

    def started(self, store: Store) -> None:
        """The tier as the job found it, its tables declared (for the summary)."""
        self.start = store.tier_state()

    def save(self, store: Store, steps_done: int) -> TierState | None:
        """Record the tier's state now, the caches flushed into ``store`` before: ``store``
        is flushed too (a tiered store writes its host rows through); returns the state
        (None: nothing kept)."""
        if self.path is None:
            return None
        store.flush()
        state = store.tier_state()
        if state is not None:
            write_record(self.path, state, steps_done)
        return state

    def summary(self, resume_dir: Path | None) -> str | None:
        """The summary's line on the tier: started empty, continued from N rows, or (with
        ``--resume``) restored from the checkpoint, and whether the tier had lost rows."""
        if self.start is None:
            return None
        if resume_dir is None:
            return self.start.summary()
        start = self.start
        if start.tier_id is None or (start.generation == 0 and not start.rows):
            before = "was empty"
        else:
            before = "held " + ("uncounted" if start.rows is None else f"{start.rows:,}") + " rows"
        line = (
            f"Redis tier {start.url} (namespace {start.namespace!r}): rows restored from the "
            f"checkpoint {resume_dir} (the tier {before} before)"
        )
        if self.resumed_from is not None:
            saved = TierState.from_dict(self.resumed_from)
            rows = start.rows
            if saved.tier_id not in (None, start.tier_id) or (
                saved.rows is not None and rows is not None and rows < saved.rows
            ):
                line += (
                    f"; it had lost rows since the checkpoint (tier {saved.tier_id}, "
                    f"{saved.rows if saved.rows is not None else 'uncounted'} rows then)"
                )
        return line
