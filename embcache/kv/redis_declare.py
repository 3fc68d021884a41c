"""How `RedisKV` declares a table (`RedisKV.init_table`), a part it holds
(`TableDeclarations`): the lease taken first, the table's spec record on the server claimed
(``SET NX``) or compared, another state layout given to the rows (a view, or the rows
rewritten), the key layout entered in the client's registry, and the tier checked against the
state an earlier run left. The same part records what the declared tables hold
(`RedisKV.tier_state`) and takes the state to check them against (`RedisKV.expect_state`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from functools import partial
from typing import Any

from embcache.kv.base import TableSpec
from embcache.kv.redis_calls import RedisCalls
from embcache.kv.redis_jobs import JobRegistry
from embcache.kv.redis_rows import RedisRowIO
from embcache.kv.redis_tables import RedisTables
from embcache.kv.redis_wire import (
    TableLayout,
    meta_key,
    parse_spec_record,
    spec_record,
    table_layout,
    view_layout,
)
from embcache.kv.tier_state import TableState, TierState


class TableDeclarations:
    """The declarations of one `RedisKV` client's tables, one at a time (a declaration may
    rewrite rows).

    Args:
        calls: the client's call layer (connection, guards, retries).
        rows: its row I/O (a state layout's rewrite, the SCAN of a table's ids).
        tables: its registry, where a declared table is entered.
        jobs: this job's record among the open jobs on the server (None for a read-only
            client, which takes no lease).
        buckets: hash-tag buckets of tables this client creates (an existing table keeps the
            count recorded on the server).
    """

    def __init__(
        self,
        calls: RedisCalls,
        rows: RedisRowIO,
        tables: RedisTables,
        jobs: JobRegistry | None,
        buckets: int,
    ) -> None:
        self._calls = calls
        self._rows = rows
        self._tables = tables
        self._jobs = jobs
        self._buckets = buckets
        self._ns = calls.namespace.encode()
        self._lock = threading.Lock()

    def declare(self, spec: TableSpec) -> None:
        """`RedisKV.init_table` (its docstring says what each state layout does)."""
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
        calls, name = self._calls, spec.name
        with self._lock:
            known = self._tables.find(name)
            if known is not None:
                self._check_compatible(spec, spec_record(known.spec, known.buckets), "here")
            calls.call("init_table", name, lambda: calls.check_eviction_policy(name))
            # The lease first: a job refused here has changed nothing on the server.
            if self._jobs is not None:
                jobs = self._jobs
                calls.call("init_table", name, lambda: calls.leases.take(name))
                calls.call("init_table", name, lambda: jobs.opened(name))
            if calls.identity.tier_id is None:
                calls.call("init_table", name, calls.identity.check_record)
            key = meta_key(self._ns, name)
            record = spec_record(spec, self._buckets)
            payload = json.dumps(record, sort_keys=True).encode()
            stored = calls.call("init_table", name, lambda: self._claim_meta(key, payload, name))
            if stored is not None:
                self._check_compatible(spec, stored, "on the server")
                table = self._layout(spec, int(stored["buckets"]))
                server_state = (stored["state_dim"], float(stored["state_init"]))
                if server_state != (spec.state_dim, float(spec.state_init)):
                    if calls.shared or spec.state_dim == 0:
                        # A view: the rows keep the server's state (`view_layout`).
                        table = view_layout(table, spec, *server_state)
                        record.update(state_dim=server_state[0], state_init=server_state[1])
                    else:
                        self._rows.reset_state(table)
                if calls.shared:
                    pass  # a reader records nothing
                elif any(stored[k] != record[k] for k in ("state_dim", "state_init", "seed")):
                    record["buckets"] = table.buckets
                    payload = json.dumps(record, sort_keys=True).encode()
                    calls.call("init_table", name, lambda: calls.client.set(key, payload))
            else:
                table = self._layout(spec, self._buckets)
            self._tables.add(table)
            calls.call("init_table", name, lambda: self.check_expected(table))

    def state(self, count_rows: bool) -> TierState:
        """`RedisKV.tier_state`: the namespace record's id, each declared table's write marks
        and (``count_rows``) its rows, the marks checked first."""
        calls, identity = self._calls, self._calls.identity
        tables = self._tables.layouts(check_open=True)
        if identity.tier_id is None:
            name = tables[0].spec.name if tables else "(none)"
            calls.call("tier_state", name, identity.check_record)
        states = {}
        for t in tables:
            calls.call("tier_state", t.spec.name, partial(calls.marks.verify, [t], False))
            marks = calls.call("tier_state", t.spec.name, partial(identity.marks, t))
            rows = None
            if count_rows:
                scan = partial(self._rows.scan_ids, t)
                rows = calls.call("tier_state", t.spec.name, scan).numel()
            states[t.spec.name] = TableState(tuple(marks), rows)
        return TierState(calls.url, calls.namespace, identity.tier_id, states)

    def expect(self, state: TierState) -> None:
        """`RedisKV.expect_state`: ``state`` is what the tier must hold, checked now for the
        tables declared and at each later declaration."""
        calls = self._calls
        if not isinstance(state, TierState):
            raise TypeError(f"expect_state takes a TierState, got {type(state).__name__}")
        if state.namespace != calls.namespace:
            raise ValueError(
                f"{calls.describe()}: the expected tier state is of namespace "
                f"{state.namespace!r}; open the store with ?namespace={state.namespace}"
            )
        tables = self._tables.layouts(check_open=True)
        calls.identity.expected = state
        name = tables[0].spec.name if tables else "(none)"
        calls.call("expect_state", name, calls.identity.check_record)
        for t in tables:
            calls.call("expect_state", t.spec.name, partial(self.check_expected, t))

    def check_expected(self, t: TableLayout) -> None:
        """``t`` holds at least what the state this run continues from recorded
        (`RedisKV.expect_state`), else `TierDataLossError`."""
        self._calls.identity.check_table(t, self._rows.scan_ids, self._tables.written_ids(t))

    def _layout(self, spec: TableSpec, buckets: int) -> TableLayout:
        """The table's key layout; its mark book is created on first declaration and kept
        across re-declarations (the acknowledged writes stay acknowledged)."""
        calls = self._calls
        table = table_layout(self._ns, spec, buckets, calls.cluster)
        calls.marks.register(table)
        if calls.cluster:
            # The epoch was taken in bucket 0's fence; every bucket's fence follows it before
            # this job writes (a fence is only ever raised: an older job's epoch never wins).
            calls.call("init_table", spec.name, lambda: calls.raise_fences(spec.name, table))
        return table

    def _claim_meta(self, key: bytes, payload: bytes, table: str) -> dict[str, Any] | None:
        """Record a spec unless one is there; returns the one there (None when ours won, or
        when a read-only client found none)."""
        client, shared = self._calls.client, self._calls.shared
        if not shared and client.set(key, payload, nx=True):
            return None
        stored = client.get(key)
        if stored is None and shared:
            return None
        if stored is None:  # deleted between the two commands: claim again
            return self._claim_meta(key, payload, table)
        try:
            return parse_spec_record(stored, table)
        except ValueError as err:
            raise ValueError(
                f"{self._calls.describe()}: the record {key.decode(errors='replace')} of table "
                f"{table!r} is damaged or was not written by embcache ({err}); delete it and "
                f"the table's rows, or use another namespace"
            ) from None

    def _check_compatible(self, spec: TableSpec, stored: dict[str, Any], where: str) -> None:
        url, namespace = self._calls.url, self._calls.namespace
        dtype = str(spec.dtype).removeprefix("torch.")
        if stored.get("dtype", "float32") != dtype:
            raise ValueError(
                f"table {spec.name!r} is declared with dtype {stored.get('dtype')} {where} "
                f"(Redis tier {url}, namespace {namespace!r}); cannot declare it "
                f"with dtype {dtype}"
            )
        for field in ("dim", "num_embeddings"):
            if stored[field] != getattr(spec, field):
                raise ValueError(
                    f"table {spec.name!r} is declared with {field}={stored[field]} {where} "
                    f"(Redis tier {url}, namespace {namespace!r}); cannot declare it "
                    f"with {field}={getattr(spec, field)}. Another model using this namespace? "
                    f"Give each model its own namespace."
                )
