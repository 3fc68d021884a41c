"""What ``embcache train`` remembers of a Redis tier between two runs, so that a run that
continues from the tier is refused when the tier lost rows since (restarted empty, rolled
back to an older snapshot, the namespace re-created or rows deleted), instead of re-creating
them from their initial values, and is told when the last job on it ended without closing it.

A run on a persistent tier (``redis://``, ``redis+cluster://``, ``tiered+redis://``...)
records the tier's state (`embcache.kv.tier_state`: the namespace record's id, each table's
write marks and rows) after its final flush and at each checkpoint, with the step and the
checkpoint directory, in three places (the run record's witnesses):

* on the tier itself, ``ns:record`` (``ns:record:rank-<r>-of-<W>`` for each rank of W;
  `embcache.kv.redis_jobs`): seen by a run from any directory or machine;
* in the checkpoint's ``extra`` (``tier_state``), when the run has ``--checkpoint DIR``;
* in a local file keyed by the server and namespace (never a password), outside the working
  directory::

      $XDG_STATE_HOME/embcache/tiers/<key>.json      (default ~/.local/state/embcache/tiers)
      .../<key>.rank-<r>-of-<W>.json                 each rank of W

  or in the directory ``$EMBCACHE_TIER_RECORDS`` names.

The next run (without ``--resume`` or ``--fresh-tier``) reads every witness it can reach (the
tier's, the local file, and the newest checkpoint in its own ``--checkpoint DIR`` when that
checkpoint is of the same server and namespace), and hands the newest to
`embcache.kv.expect_tier_state` before declaring its tables. What each detects:

* rows deleted or evicted behind the job, a namespace re-created: the tier's own record;
* a server restarted empty (the tier's record is gone with it) or rolled back to an older
  snapshot (its record is as old as the rows): the local file, from any directory of the same
  user on the same machine, or the checkpoint, from any machine that gives the same
  ``--checkpoint DIR``. A run with neither (another user or machine, no ``--checkpoint``) sees
  an empty namespace and says so: nothing it can reach remembers the tier.

``--resume DIR`` restores the rows from the checkpoint instead (nothing is refused; the
summary says what the tier held), and ``--fresh-tier`` starts over without the check.

The tier also says which jobs ended without closing it (`RedisKV.unclean_ends`): a run that
finds one says so on stderr and in its summary, naming the newest checkpoint that job recorded
(resume from it: the tier holds none of the rows that job had not written back).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embcache.checkpoint import CheckpointError, read_extra
from embcache.kv import Store, TierCommandError, TierDataLossError, TierState, expect_tier_state

RECORD_DIR_ENV = "EMBCACHE_TIER_RECORDS"  # a directory for the local records
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


def record_dir() -> Path:
    """Where the local run records are kept: ``$EMBCACHE_TIER_RECORDS``, else
    ``$XDG_STATE_HOME/embcache/tiers`` (``~/.local/state/embcache/tiers``): the same for every
    working directory of a user."""
    if os.environ.get(RECORD_DIR_ENV):
        return Path(os.environ[RECORD_DIR_ENV])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "embcache" / "tiers"


def record_name(rank: int = 0, world: int = 1) -> str:
    """The run record's name on the tier: "" for one process, ``rank-<r>-of-<W>`` for a rank."""
    return "" if world == 1 else f"rank-{rank}-of-{world}"


def record_path(
    store_url: str, rank: int = 0, world: int = 1, directory: Path | None = None
) -> Path | None:
    """Where the local run record of ``store_url`` is kept (in ``directory``, default
    `record_dir`); None: a tier with nothing to record."""
    where = tier_location(store_url)
    if where is None:
        return None
    key = hashlib.sha256("\0".join(where).encode()).hexdigest()[:16]
    name = f"{key}.json" if world == 1 else f"{key}.{record_name(rank, world)}.json"
    return (directory or record_dir()) / name


def read_record(path: Path) -> dict[str, Any] | None:
    """The run record in ``path`` (None: no record there), its state checked.

    Raises:
        ValueError: the file is damaged, naming it.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return checked_record(json.loads(text))
    except ValueError as err:
        raise ValueError(
            f"the run record {path} is damaged ({err}): delete it, or give --fresh-tier"
        ) from None


def checked_record(data: Any) -> dict[str, Any]:
    """A run record (``{"format", "written", "steps_done", "checkpoint", "state"}``) whose
    state parses; ValueError otherwise."""
    try:
        if data.get("format") != RECORD_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {RECORD_FORMAT}")
        TierState.from_dict(data["state"])
        float(data.get("written", 0))
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{type(err).__name__}: {err}") from None
    return dict(data)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path``, atomically (a crash keeps the previous record; a failed
    write leaves no partial file).

    Raises:
        OSError: the write failed (a full disk), its message naming ``path``.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as out:
            out.write(json.dumps(record, indent=1, sort_keys=True))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        why = err.strerror or type(err).__name__
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            why += " (the disk is full)"
        raise OSError(err.errno, f"cannot write the tier record {path}: {why}") from None


def _checkpoint_record(checkpoint: Path, store_url: str) -> dict[str, Any] | None:
    """The tier state the newest checkpoint in ``checkpoint`` recorded, as a run record, when
    it is of the same server and namespace (None otherwise, or when it cannot be read: it is
    a witness here, and `--resume` reports a damaged checkpoint)."""
    current = checkpoint / "CURRENT"
    if not current.is_file():
        return None
    try:
        extra = read_extra(checkpoint)
        written = current.stat().st_mtime
    except (CheckpointError, OSError, ValueError):
        return None
    state, store = extra.get("tier_state"), extra.get("store")
    if not isinstance(state, dict) or not isinstance(store, str):
        return None
    if tier_location(store) != tier_location(store_url):
        return None
    try:
        return checked_record(
            {
                "format": RECORD_FORMAT,
                "written": written,
                "steps_done": extra.get("steps_done"),
                "checkpoint": str(checkpoint),
                "state": state,
            }
        )
    except ValueError:
        return None


@dataclass
class TierRecord:
    """One job's side of the run record (see the module docstring).

    Args:
        path: the local run record (None: the tier keeps nothing between processes).
        name: the run record's name on the tier (`record_name`).
        store_url: the tier's URL (to match a checkpoint's).
        checkpoint: ``--checkpoint DIR`` (this job's), or None.
        rank: this process's rank (rank 0 speaks).
        world: the number of ranks.
        local: the local record read at start (None: none, or not to be checked).
        check: whether `expect` checks the tier (not with ``--resume`` or ``--fresh-tier``).
        resumed_from: the tier state ``--resume``'s checkpoint recorded, for the summary.
    """

    path: Path | None
    name: str = ""
    store_url: str = ""
    checkpoint: Path | None = None
    rank: int = 0
    world: int = 1
    local: dict[str, Any] | None = None
    check: bool = False
    resumed_from: dict[str, Any] | None = None
    expected: dict[str, Any] | None = field(default=None, init=False)
    source: str | None = field(default=None, init=False)
    start: TierState | None = field(default=None, init=False)
    unclean: list[dict[str, Any]] = field(default_factory=list, init=False)

    @classmethod
    def for_job(
        cls,
        store_url: str,
        rank: int,
        world: int,
        resume_extra: dict[str, Any] | None,
        fresh: bool,
        checkpoint: Path | None = None,
    ) -> TierRecord:
        """The record of a job on ``store_url``; ``resume_extra``: ``--resume``'s checkpoint
        extra (None without ``--resume``); ``checkpoint``: ``--checkpoint DIR``.

        Raises:
            ValueError: the local record is damaged.
        """
        path = record_path(store_url, rank, world)
        if path is None:
            return cls(None)
        common: dict[str, Any] = {
            "name": record_name(rank, world),
            "store_url": store_url,
            "checkpoint": None if checkpoint is None else Path(checkpoint),
            "rank": rank,
            "world": world,
        }
        if resume_extra is not None:
            saved = resume_extra.get("tier_state")
            resumed = saved if isinstance(saved, dict) else None
            return cls(path, resumed_from=resumed, **common)
        if fresh:
            return cls(path, **common)
        return cls(path, local=read_record(path), check=True, **common)

    def _rank_checkpoint(self) -> Path | None:
        if self.checkpoint is None:
            return None
        return self.checkpoint if self.world == 1 else self.checkpoint / f"rank-{self.rank}"

    def expect(self, store: Store) -> None:
        """`expect_tier_state` with the newest recorded state among the witnesses: right
        after opening the store, before its tables are declared.

        Raises:
            TierCommandError: the tier's own run record is damaged.
        """
        if not self.check:
            return
        witnesses: list[tuple[dict[str, Any], str]] = []
        try:
            on_tier = store.run_record(self.name)
        except ValueError as err:
            raise TierCommandError(str(err)) from None
        if on_tier is not None:
            try:
                witnesses.append((checked_record(on_tier), "the run record on the tier"))
            except ValueError as err:
                raise TierCommandError(
                    f"the run record on the tier is damaged ({err}): delete it, or give "
                    f"--fresh-tier"
                ) from None
        if self.local is not None:
            witnesses.append((self.local, f"the run record {self.path}"))
        where = self._rank_checkpoint()
        saved = None if where is None else _checkpoint_record(where, self.store_url)
        if saved is not None:
            witnesses.append((saved, f"the checkpoint {where}"))
        if not witnesses:
            return
        record, self.source = max(witnesses, key=lambda w: float(w[0].get("written", 0)))
        self.expected = record["state"]
        expect_tier_state(store, self.expected)

    def refusal(self, err: TierDataLossError) -> TierDataLossError:
        """``err`` with what to do from the command line, when a run record caused it."""
        if self.expected is None:
            return err
        return TierDataLossError(
            f"{' '.join(str(err).split())} (checked against {self.source}, the newest record "
            f"of the last run; --fresh-tier starts over on this namespace without the check)"
        )

    def started(self, store: Store) -> None:
        """The tier as the job found it, its tables declared (for the summary), and the jobs
        that ended on it without closing it (said at once on stderr, by rank 0)."""
        self.start = store.tier_state()
        self.unclean = store.unclean_ends()
        if self.unclean and self.rank == 0:
            print(f"embcache train: warning: {self.unclean_line()}", file=sys.stderr, flush=True)

    def unclean_line(self) -> str:
        """One line on the jobs that ended without closing the tier ("" when none)."""
        if not self.unclean:
            return ""
        job = max(self.unclean, key=lambda j: float(j.get("opened") or 0))
        opened = job.get("opened")
        when = ""
        if isinstance(opened, int | float):
            when = time.strftime(", started %Y-%m-%d %H:%M:%S UTC", time.gmtime(opened))
        others = f" (and {len(self.unclean) - 1} other job(s))" if len(self.unclean) > 1 else ""
        checkpoint, steps = job.get("checkpoint"), job.get("steps_done")
        if checkpoint:
            at = f" (step {steps})" if steps is not None else ""
            resume = (
                f"to continue from a consistent state, resume from its newest checkpoint: "
                f"embcache train --resume {checkpoint}{at}"
            )
        else:
            resume = (
                "it recorded no checkpoint on the tier: continue knowingly, or start over on a "
                "new namespace (?namespace=NAME)"
            )
        return (
            f"the last job on this tier ({job.get('holder', 'unknown')}{when}){others} ended "
            f"without closing it (killed, crashed, or its leases lapsed): the rows it had not "
            f"written back are not on the tier, which may mix rows of different steps; {resume}"
        )

    def save(self, store: Store, steps_done: int) -> TierState | None:
        """Record the tier's state now, the caches flushed into ``store`` before: ``store``
        is flushed too (a tiered store writes its host rows through); returns the state
        (None: nothing kept). The record goes to the tier and to the local file; a local file
        that cannot be written (a full disk) is said on stderr in one line naming it, and the
        run goes on: the tier's record (and the checkpoint's) hold the state."""
        if self.path is None:
            return None
        store.flush()
        state = store.tier_state()
        if state is None:
            return None
        record = {
            "format": RECORD_FORMAT,
            "written": time.time(),
            "steps_done": steps_done,
            "checkpoint": None if self.checkpoint is None else str(self.checkpoint.resolve()),
            "state": state.to_dict(),
        }
        store.save_run_record(self.name, record)
        try:
            write_record(self.path, record)
        except OSError as err:
            print(
                f"embcache train: warning: {err.strerror}; the run record on the tier still "
                f"holds this run's state",
                file=sys.stderr,
                flush=True,
            )
        return state

    def summary(self, resume_dir: Path | None) -> str | None:
        """The summary's line on the tier: started empty, continued from N rows, or (with
        ``--resume``) restored from the checkpoint, whether the tier had lost rows, and the
        jobs that ended on it without closing it."""
        if self.start is None:
            return None
        line = self._rows_line(resume_dir)
        if self.unclean:
            line += f"; WARNING: {self.unclean_line()}"
        return line

    def _rows_line(self, resume_dir: Path | None) -> str:
        start = self.start
        assert start is not None
        if resume_dir is None:
            return start.summary()
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
