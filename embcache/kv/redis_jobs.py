"""What a Redis tier remembers about the jobs that trained it: which are open, which ended
without closing, and the run record of the last save.

Two keys per namespace, beside the tables::

    ns:jobs        HASH: owner token -> JSON {"holder", "opened", "tables", "checkpoint",
                   "steps_done"}: one field per job that opened tables as a writer and has not
                   closed its store (ranks of one job share the field)
    ns:record[:R]  JSON {"format", "written", "steps_done", "checkpoint", "state"}: the run
                   record of the last save (`embcache.cli.tier_record`; R names a rank)

A writer adds its field when it takes its first table and deletes it in `RedisKV.close`. A
field whose job holds none of its tables' leases any more is an unclean end: the job was
killed, crashed, or lost its leases, and the rows dirty in its cache never reached the tier
(which may now mix rows of different steps). The next writer on the namespace reads those
fields when it takes its first table and reports them (`RedisKV.unclean_ends`, said by
``embcache train``, naming the newest checkpoint the dead job recorded); it deletes them when
it closes cleanly, having said so. A job resumed from the dead job's checkpoint (``takeover``)
deletes that job's field at once: it restores the rows.

These keys live and die with the tier: a server that restarted empty holds none of them, which
is why the run record is also kept in the checkpoint and in a local file
(`embcache.cli.tier_record`).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from redis.crc import key_slot

from embcache.kv.redis_lease import lease_key, parse_lease
from embcache.kv.redis_wire import Client, run_commands

JOB_FORMAT = 1


def jobs_key(namespace: bytes) -> bytes:
    """Key of the open-jobs hash: ``ns:jobs``."""
    return namespace + b":jobs"


def record_key(namespace: bytes, name: str = "") -> bytes:
    """Key of a run record: ``ns:record`` (``ns:record:NAME`` for a rank's)."""
    return namespace + b":record" + (b":" + name.encode() if name else b"")


def read_record(client: Client, namespace: bytes, name: str) -> dict[str, Any] | None:
    """The run record ``name`` (None: none there).

    Raises:
        ValueError: it is not JSON of an object, naming the key.
    """
    key = record_key(namespace, name)
    payload = client.get(key)
    if payload is None:
        return None
    try:
        record = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        record = None
    if not isinstance(record, dict):
        raise ValueError(
            f"the run record {key.decode(errors='replace')} on the tier is damaged or was not "
            f"written by embcache: delete it, or give --fresh-tier"
        )
    return record


class JobRegistry:
    """One writer's side of ``ns:jobs`` and ``ns:record`` (see the module docstring).

    Args:
        client: the redis-py client.
        namespace: the key prefix.
        owner: this job's token (its field).
        holder: "pid N on HOST", for the next job's message.
        takeover: the token of the job this one resumes (its field is deleted, not reported).
        cluster: keys are spread over a cluster's slots.
    """

    def __init__(
        self,
        client: Client,
        namespace: bytes,
        owner: str,
        holder: str,
        takeover: str | None,
        cluster: bool,
    ) -> None:
        self._client = client
        self._ns = namespace
        self._key = jobs_key(namespace)
        self._owner = owner
        self._takeover = takeover
        self._cluster = cluster
        self._entry: dict[str, Any] = {
            "format": JOB_FORMAT,
            "holder": holder,
            "opened": time.time(),
            "tables": [],
            "checkpoint": None,
            "steps_done": None,
        }
        self._unclean: list[dict[str, Any]] | None = None  # read at the first table
        self._lock = threading.Lock()

    def opened(self, table: str) -> None:
        """This job took ``table``'s lease: record it in the job's field (and, at the first
        table, read the fields of jobs that ended without closing)."""
        with self._lock:
            if table not in self._entry["tables"]:
                self._entry["tables"].append(table)
            payload = json.dumps(self._entry, sort_keys=True)
            first = self._unclean is None
        if first:
            found = self._find_unclean()
            with self._lock:
                self._unclean = found
        self._client.hset(self._key, self._owner, payload)

    def note_checkpoint(self, checkpoint: str | None, steps_done: int) -> None:
        """Record the newest checkpoint of this job in its field (the next job names it if
        this one dies)."""
        with self._lock:
            if checkpoint is not None:
                self._entry["checkpoint"] = checkpoint
            self._entry["steps_done"] = steps_done
            payload = json.dumps(self._entry, sort_keys=True)
            opened = bool(self._entry["tables"])
        if opened:
            self._client.hset(self._key, self._owner, payload)

    def unclean(self) -> list[dict[str, Any]]:
        """The jobs found to have ended without closing (each its field, with its token as
        ``owner``), when this job took its first table; empty before."""
        with self._lock:
            return [dict(job) for job in self._unclean or []]

    def close(self) -> None:
        """A clean end: delete this job's field and those of the unclean ends it reported."""
        with self._lock:
            fields = [self._owner, *(job["owner"] for job in self._unclean or [])]
            opened = bool(self._entry["tables"])
        if opened:
            self._client.hdel(self._key, *fields)

    def save_record(self, name: str, record: dict[str, Any]) -> None:
        """Write the run record ``name`` (JSON-able ``record``)."""
        self._client.set(record_key(self._ns, name), json.dumps(record, sort_keys=True))

    def _find_unclean(self) -> list[dict[str, Any]]:
        """Fields of other jobs none of whose tables' leases they still hold."""
        fields = self._client.hgetall(self._key)
        jobs: list[dict[str, Any]] = []
        for owner, payload in fields.items():
            token = owner.decode(errors="replace") if isinstance(owner, bytes) else str(owner)
            if token == self._owner:
                continue
            try:
                job = json.loads(payload)
                tables = [str(t) for t in job["tables"]]
            except (ValueError, TypeError, KeyError, UnicodeDecodeError):
                job, tables = {"holder": "an unknown job"}, []
            job["owner"] = token
            jobs.append({**job, "tables": tables})
        if not jobs:
            return []
        keys = [lease_key(self._ns, t, self._cluster) for job in jobs for t in job["tables"]]
        commands = [(key_slot(k) if self._cluster else -1, ("GET", k)) for k in keys]
        held = iter(run_commands(self._client, commands) if commands else [])
        dead = []
        for job in jobs:
            owners = {parse_lease(v)[1] for v in (next(held) for _ in job["tables"]) if v}
            if job["owner"] not in owners:
                dead.append(job)
        superseded = [job["owner"] for job in dead if job["owner"] == self._takeover]
        if superseded:
            self._client.hdel(self._key, *superseded)
        return [job for job in dead if job["owner"] != self._takeover]
