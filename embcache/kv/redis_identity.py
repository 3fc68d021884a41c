"""What `RedisKV` checks about the tier as a whole: its identity against what an earlier run
left (`embcache.kv.tier_state`), and a configuration that could evict keys behind the job.

Nothing here retries: connection errors propagate to `RedisKV`, which retries the call.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import NoReturn

import redis
import redis.cluster
import torch

from embcache.kv.errors import TierCommandError, TierDataLossError
from embcache.kv.redis_wire import Client, TableLayout, run_commands, tier_key
from embcache.kv.tier_state import TierState, WrittenIds, state_loss_message
from embcache.kv.write_marks import MarkGuard, parse_mark

RECORD_FORMAT = 1


def eviction_problem(
    client: Client, describe: str, table: str, running: bool = False
) -> str | None:
    """Why the server may drop keys behind the job (a ``maxmemory`` with any
    ``maxmemory-policy`` but ``noeviction``, on any primary), or None.

    ``allkeys-*`` drops rows, which would be re-created from their initial values;
    ``volatile-*`` drops the keys with a TTL, which are the owner leases: a second job could
    take a table in use. ``noeviction`` refuses writes instead (`TierFullError`).

    Args:
        client: the redis-py client.
        describe: "Redis tier URL (namespace 'ns')", for the message.
        table: the table being declared or used, for the message.
        running: found while the job runs (the policy changed after the declaration).
    """
    if isinstance(client, redis.cluster.RedisCluster):
        info = client.info("memory", target_nodes=redis.cluster.RedisCluster.PRIMARIES)
        nodes = [v for v in info.values() if isinstance(v, dict)] or [info]
    else:
        nodes = [client.info("memory")]
    for node in nodes:
        policy = str(node.get("maxmemory_policy", "noeviction"))
        if int(node.get("maxmemory", 0) or 0) > 0 and policy != "noeviction":
            dropped = "rows of the model" if policy.startswith("allkeys") else (
                "the tables' owner leases (keys with a TTL), letting another job take a "
                "table in use")  # fmt: skip
            when = " (changed while this job runs)" if running else ""
            return (
                f"{describe}: table {table!r}: the server evicts keys once full "
                f"(maxmemory {node.get('maxmemory')}, maxmemory-policy {policy}{when}), "
                f"which would drop {dropped}; set maxmemory-policy noeviction (a full "
                f"server then refuses writes, and nothing is lost) and bound the tables "
                f"with a tier capacity in front of it if they must stay under maxmemory"
            )
    return None


class TierIdentity:
    """The namespace record of one `RedisKV`, and the state it is expected to continue from.

    Args:
        client: the redis-py client.
        namespace: the key prefix.
        describe: ``describe()`` -> "Redis tier URL (namespace 'ns')".
        marks: the client's write marks (a loss found here makes the table unusable there).
        read_only: a read-only client never writes the record.

    Attributes:
        tier_id: the record's id, once read or written (None before).
        expected: the state an earlier run left (`RedisKV.expect_state`), or None.
    """

    def __init__(
        self,
        client: Client,
        namespace: bytes,
        describe: Callable[[], str],
        marks: MarkGuard,
        read_only: bool,
    ) -> None:
        self._client = client
        self._key = tier_key(namespace)
        self._describe = describe
        self._marks = marks
        self._read_only = read_only
        self.tier_id: str | None = None
        self.expected: TierState | None = None
        self._lost: str | None = None

    def check_usable(self) -> None:
        """Raise `TierDataLossError` again once the tier was found not the expected one."""
        if self._lost is not None:
            raise TierDataLossError(self._lost)

    def check_record(self) -> None:
        """Read (a writer: create) the namespace record and compare it with `expected`: a
        record missing or of another id is `TierDataLossError`, and nothing is written."""
        key, expected = self._key.decode(errors="replace"), self.expected
        stored = self._client.get(self._key)
        if stored is None and expected is not None and expected.tier_id is not None:
            self._lose(
                f"its namespace record {key} is missing (the server restarted empty or from a "
                f"snapshot older than the namespace, or the namespace was deleted)"
            )
        if stored is None:
            if self._read_only:
                return
            new_id = uuid.uuid4().hex
            fresh = {"format": RECORD_FORMAT, "id": new_id, "created": time.time()}
            if self._client.set(self._key, json.dumps(fresh).encode(), nx=True):
                self.tier_id = new_id
                return
            stored = self._client.get(self._key)  # another writer created it first
        try:
            record = json.loads(stored) if stored is not None else {}  # None: deleted again
            tier_id = str(record["id"])
        except (TypeError, ValueError, KeyError):
            raise TierCommandError(
                f"{self._describe()}: the namespace record {key} is damaged or was not written "
                f"by embcache; delete it, or use another namespace"
            ) from None
        if expected is not None and expected.tier_id not in (None, tier_id):
            self._lose(
                f"its namespace record holds tier {tier_id}, another tier (the namespace was "
                f"deleted and written again, or this is another server)"
            )
        self.tier_id = tier_id

    def marks(self, t: TableLayout) -> list[int]:
        """Every write mark of ``t`` as the server holds it (0 where absent)."""
        commands = [(t.mark_slots[u], ("GET", key)) for u, key in enumerate(t.mark_keys)]
        return [parse_mark(reply) for reply in run_commands(self._client, commands)]

    def check_table(
        self,
        t: TableLayout,
        scan_ids: Callable[[TableLayout], torch.Tensor],
        written: WrittenIds,
    ) -> None:
        """Compare a declared table with `expected`: its write marks at least those
        recorded, then (when rows were counted) at least the rows recorded, which count as
        ``written`` from then on. A shortfall is `TierDataLossError` naming it."""
        expected, name = self.expected, t.spec.name
        if expected is None or name not in expected.tables:
            return
        want = expected.tables[name]
        if len(want.marks) != len(t.mark_keys):
            self._lose_table(
                name,
                f"table {name!r} has {len(t.mark_keys)} write mark(s) here, the earlier run's "
                f"had {len(want.marks)} (another server kind or bucket count)",
            )
        for unit, (have, had) in enumerate(zip(self.marks(t), want.marks, strict=True)):
            if have < had:
                mark = t.mark_keys[unit].decode(errors="replace")
                self._lose_table(
                    name,
                    f"table {name!r}: write mark {mark} is {have}, the earlier run left {had} "
                    f"(an older snapshot, or a replica that was behind)",
                )
        self._marks.book(name).expect(list(want.marks))
        if want.rows is None:
            return
        ids = scan_ids(t)
        if ids.numel() < want.rows:
            self._lose_table(
                name,
                f"table {name!r} holds {ids.numel():,} rows, the earlier run left "
                f"{want.rows:,} (rows deleted or evicted behind the job)",
            )
        written.add(ids)

    def _lose(self, what: str) -> NoReturn:
        assert self.expected is not None
        self._lost = state_loss_message(self._describe(), self.expected, what)
        raise TierDataLossError(self._lost)

    def _lose_table(self, table: str, what: str) -> NoReturn:
        assert self.expected is not None
        self._marks.fail(table, state_loss_message(self._describe(), self.expected, what))
