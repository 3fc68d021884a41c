"""How `RedisKV` lays tables out on a Redis server: key names, the spec record, row bytes.

Key layout, for namespace ``ns``, table ``T``, row id ``i``:

    ns:meta:T             JSON: the spec (name, dim, num_embeddings, state_dim, state_init,
                          seed, dtype; never the init callable) and the table's bucket count B
    ns:{h.b}:T:i          row i: ``dim`` little-endian weights of the table's dtype (float32,
                          float16 or bfloat16), then ``state_dim`` little-endian float32
    ns:seq:T              write mark of the table (single server), see `embcache.kv.write_marks`
    ns:seq:{h.b}:T        write mark of bucket b (cluster: in the slot of the bucket's rows)
    ns:lease:T            the owner lease of the table, see `embcache.kv.redis_lease`
                          (``ns:lease:{h.0}:T`` on a cluster: in the slot of its epoch)
    ns:fence:T            the table's epoch, the fence every write checks (single server)
    ns:fence:{h.b}:T      the same, per bucket b (cluster: in the slot of the bucket's rows)
    ns:tier               the namespace record (the tier's id), see `embcache.kv.tier_state`
    ns:jobs               the jobs that opened tables and have not closed them, and
    ns:record[:R]         the run record of the last save, see `embcache.kv.redis_jobs`

with ``h = table_hash(T)`` (a CRC of the name) and ``b = i % B`` (B = 256 unless the server's
record says otherwise). The braces are Redis Cluster's hash tag: the rows of one bucket share a
slot, so on a cluster a batch costs one MGET/MSET per slot touched (at most B) rather than one
command per row, while a table's B buckets still spread over the slots and hence the nodes. On a
single server the tag is just part of the name and a chunk is one MGET/MSET.

The multi-key commands (MGET, MSET, MSETNX) go out one per slot group of a `KeyBatch`, in one
pipeline per node, each followed by the ``GET`` (reads) or ``INCR`` (writes) of the write marks
of the buckets it touches. A writer's writes are one Lua script per slot group that checks the
table's epoch (the fence) before it writes the rows and bumps the marks, so a writer whose lease
was taken over writes nothing (`Fenced`); its reads check the fence in the same round trip.
Nothing here retries: a connection error propagates to `RedisKV`,
which retries the whole chunk.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import redis.cluster
import torch
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from embcache.kv.base import TableSpec, table_hash
from embcache.kv.errors import TierAuthError, TierCommandError, TierUnavailableError
from embcache.kv.redact import redact_text
from embcache.kv.redact import redact_url as redact_url  # re-exported: its old home

DEFAULT_BUCKETS = 256
MAX_BUCKETS = 16384  # a cluster's slot count: more buckets could not spread any further
ROW_DTYPE = np.dtype("<f4")  # fixed byte order: clients on any machine read the same rows
META_FORMAT = 1
# No ':' or braces: they would change the key layout.
NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-/]+")

Client = redis.Redis | redis.cluster.RedisCluster
Command = tuple[int, tuple[Any, ...]]  # (cluster slot, or -1 on a single server; command)

# Errors after which the same command may succeed: the server restarting, a node failing over.
TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError (a server still loading)
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.ClusterError,
    redis.exceptions.AskError,  # and MovedError: a slot moved; the slot map is refreshed
    ConnectionResetError,
)
# Errors of a first connection that mean nothing answers at the URL.
_UNREACHABLE: tuple[type[BaseException], ...] = (
    *TRANSIENT,
    redis.exceptions.RedisClusterException,
    OSError,
)


def redis_url_params() -> frozenset[str]:
    """Query parameter names redis-py takes from a URL: its parsed ones and the keyword
    arguments of its connections, pools and cluster client."""
    import inspect

    names = set(redis.connection.URL_QUERY_ARGUMENT_PARSERS)
    for cls in (
        redis.connection.AbstractConnection,
        redis.connection.Connection,
        redis.connection.SSLConnection,
        redis.connection.UnixDomainSocketConnection,
        redis.connection.ConnectionPool,
        redis.cluster.RedisCluster,
    ):
        names |= set(inspect.signature(cls.__init__).parameters)
    return frozenset(names - {"self", "kwargs", "connection_kwargs"})


def error_text(err: BaseException) -> str:
    """An error's message without what redis-py quotes of the command (a pipeline error
    starts "Command # 3 (MSET key row-bytes ...) of pipeline caused error: "): rows are data,
    not something to print, and URLs in it lose their password."""
    text = str(err)
    _, cut, reply = text.partition(" of pipeline caused error: ")
    return redact_text(" ".join((reply if cut else text).split()))


def auth_message(shown_url: str, err: BaseException) -> str:
    """What `TierAuthError` says: the server is there and wants (another) password."""
    return (
        f"the Redis tier at {shown_url} refused the connection: {error_text(err)}. The server "
        f"is running but wants a password: give it in the URL (redis://:PASSWORD@host:port/db, "
        f"redis://user:PASSWORD@... for an ACL user, or ?password=...)"
    )


def connect(
    url: str,
    cluster: bool,
    socket_timeout_s: float,
    shown_url: str,
    on_connect: Callable[[], None],
) -> Client:
    """A client on ``url`` that answered PING, or the error saying why not. ``on_connect()``
    runs after every connection it opens (redis-py reconnects by itself, unseen, when a
    pooled connection was closed by a server that restarted).

    Raises:
        TierAuthError: the server wants a password, or refused the one given.
        TierUnavailableError: nothing answers there.
        TierCommandError: the server answered PING with another error.
    """
    # Retries are ours (bounded by time, across reconnects); redis-py's own would stack
    # their backoff on top of ours, so they are off.
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }

    def connected(connection: Any) -> None:
        # A cluster client calls this after its own set-up; a plain one instead of it.
        if not cluster:
            connection.on_connect()
        on_connect()

    options["redis_connect_func"] = connected
    try:
        if cluster:
            plain = url.replace("+cluster://", "://", 1)
            client: Client = redis.cluster.RedisCluster.from_url(plain, **options)
        else:
            client = redis.Redis.from_url(url, **options)
        client.ping()
        return client
    except (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError) as err:
        raise TierAuthError(auth_message(shown_url, err)) from None
    except redis.exceptions.ResponseError as err:
        if "NOAUTH" in str(err) or "WRONGPASS" in str(err):
            raise TierAuthError(auth_message(shown_url, err)) from None
        raise TierCommandError(f"Redis tier {shown_url}: {error_text(err)}") from None
    except _UNREACHABLE as err:
        raise TierUnavailableError(
            f"cannot reach the Redis tier at {shown_url}: {error_text(err)} "
            f"(is redis-server running and listening there?)"
        ) from None


@dataclasses.dataclass
class TableLayout:
    """A declared table and the precomputed parts of its keys."""

    spec: TableSpec
    buckets: int
    meta_key: bytes
    prefixes: list[bytes]  # per bucket b: b"ns:{h.b}:T:"
    bucket_slot: torch.Tensor  # int64 [B], cluster slot of each bucket
    scan_match: bytes  # SCAN MATCH pattern of the table's row keys
    id_re: re.Pattern[bytes]  # a row key of exactly this table -> its id
    mark_keys: list[bytes]  # write marks: one (single server) or one per bucket (cluster)
    mark_slots: list[int]  # cluster slot of each mark (-1 on a single server)
    slot_units: dict[int, list[int]]  # slot (-1: single server) -> marks of its buckets
    fence_keys: list[bytes]  # the table's epoch: one, or one per bucket (cluster), as marks
    # The server's row layout when this client's differs (`view_layout`); None: the same.
    stored: TableSpec | None = None

    @property
    def row_bytes(self) -> int:
        """Bytes of a row as this client sees it (`spec`)."""
        return self.spec.row_bytes

    @property
    def server(self) -> TableSpec:
        """The spec whose layout the rows have on the server."""
        return self.spec if self.stored is None else self.stored


@dataclasses.dataclass
class KeyBatch:
    """Keys of a chunk of ids as sent: ``keys[a:b]`` is one multi-key command per group."""

    keys: list[bytes]
    order: torch.Tensor | None  # keys[k] is the key of ids[order[k]]; None: ids order
    groups: list[tuple[int, int, int]]  # (slot or -1, a, b)


def meta_key(namespace: bytes, table: str) -> bytes:
    """Key of the spec record of ``table``: ``ns:meta:T``."""
    return namespace + b":meta:" + table.encode()


def fence_key(namespace: bytes, table: str, bucket: int | None) -> bytes:
    """Key of the table's epoch (`embcache.kv.redis_lease`): ``ns:fence:T`` on a single
    server (``bucket`` None), ``ns:fence:{h.b}:T`` for bucket b on a cluster."""
    if bucket is None:
        return namespace + b":fence:" + table.encode()
    tag = b"%d.%d" % (table_hash(table), bucket)
    return namespace + b":fence:{" + tag + b"}:" + table.encode()


class Fenced(Exception):  # noqa: N818 (a condition `RedisKV` turns into TierOwnershipError)
    """A write or read found the table's epoch changed: another job took the table over.

    Attributes:
        found: the epoch the server holds (b"" when absent).
    """

    def __init__(self, found: bytes) -> None:
        super().__init__(found)
        self.found = found


def tier_key(namespace: bytes) -> bytes:
    """Key of the namespace record (the tier's id), see `embcache.kv.tier_state`: ``ns:tier``."""
    return namespace + b":tier"


def table_layout(namespace: bytes, spec: TableSpec, buckets: int, cluster: bool) -> TableLayout:
    """The keys of ``spec``'s table in ``namespace``, spread over ``buckets`` hash tags."""
    name = spec.name.encode()
    tag = b"%d" % table_hash(spec.name)
    prefixes = [namespace + b":{" + tag + b".%d}:" % b + name + b":" for b in range(buckets)]
    escaped = re.sub(rb"([*?\[\]\\])", rb"\\\1", name)
    slots = [key_slot(p) for p in prefixes]
    if cluster:
        mark_keys = [namespace + b":seq:{" + tag + b".%d}:" % b + name for b in range(buckets)]
        mark_slots = slots
        slot_units: dict[int, list[int]] = {}
        for b, slot in enumerate(slots):
            slot_units.setdefault(slot, []).append(b)
    else:
        mark_keys, mark_slots, slot_units = [namespace + b":seq:" + name], [-1], {-1: [0]}
    if cluster:
        fence_keys = [fence_key(namespace, spec.name, b) for b in range(buckets)]
    else:
        fence_keys = [fence_key(namespace, spec.name, None)]
    return TableLayout(
        spec=spec,
        buckets=buckets,
        meta_key=meta_key(namespace, spec.name),
        prefixes=prefixes,
        bucket_slot=torch.tensor(slots, dtype=torch.int64),
        scan_match=namespace + b":{" + tag + b".*}:" + escaped + b":*",
        id_re=re.compile(
            re.escape(namespace + b":{" + tag + b".") + rb"\d+\}:" + re.escape(name) + rb":(\d+)"
        ),
        mark_keys=mark_keys,
        mark_slots=mark_slots,
        slot_units=slot_units,
        fence_keys=fence_keys,
    )


def key_batch(t: TableLayout, ids: torch.Tensor, cluster: bool) -> KeyBatch:
    """Keys of ``ids``, grouped so that one multi-key command serves each group.

    Single server: one group, keys in the order of ``ids``. Cluster: one group per slot,
    keys sorted by slot (``order`` says which id each key is).
    """
    buckets, prefixes = t.buckets, t.prefixes
    if not cluster:
        keys = [prefixes[i % buckets] + b"%d" % i for i in ids.tolist()]
        return KeyBatch(keys, None, [(-1, 0, len(keys))])
    slots = t.bucket_slot[ids % buckets]
    order = torch.argsort(slots, stable=True)
    keys = [prefixes[i % buckets] + b"%d" % i for i in ids[order].tolist()]
    group_slots, counts = torch.unique_consecutive(slots[order], return_counts=True)
    stops = torch.cumsum(counts, 0)
    groups = list(zip(group_slots.tolist(), (stops - counts).tolist(), stops.tolist(), strict=True))
    return KeyBatch(keys, order, groups)


def spec_record(spec: TableSpec, buckets: int) -> dict[str, Any]:
    """What the server keeps about a table (everything but the init callable)."""
    return {
        "format": META_FORMAT,
        "name": spec.name,
        "dim": spec.dim,
        "num_embeddings": spec.num_embeddings,
        "state_dim": spec.state_dim,
        "state_init": float(spec.state_init),
        "seed": spec.seed,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "buckets": buckets,
    }


def parse_spec_record(payload: bytes, table: str) -> dict[str, Any]:
    """A spec record read from the server, checked field by field.

    Raises:
        ValueError: the record is not what `spec_record` writes (damaged, or written by
            something else), naming the field; nothing is derived from a bad record.
    """
    try:
        record = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("it is not JSON") from None
    if not isinstance(record, dict):
        raise ValueError(f"it is a JSON {type(record).__name__}, not an object")

    def is_int(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    checks = {
        "format": lambda v: v == META_FORMAT,
        "name": lambda v: v == table,
        "dim": lambda v: is_int(v) and v >= 1,
        "num_embeddings": lambda v: v is None or (is_int(v) and v >= 1),
        "state_dim": lambda v: is_int(v) and v >= 0,
        "state_init": lambda v: isinstance(v, int | float) and math.isfinite(v),
        "seed": lambda v: is_int(v),
        "buckets": lambda v: is_int(v) and 1 <= v <= MAX_BUCKETS,
        "dtype": lambda v: v in _STORED,
    }
    record.setdefault("dtype", "float32")  # written before tables had a dtype
    for name, ok in checks.items():
        if name not in record:
            raise ValueError(f"field {name!r} is missing")
        if not ok(record[name]):
            raise ValueError(f"field {name!r} holds {record[name]!r}")
    return record


# Stored row dtype -> (integer dtype of the same width, its little-endian numpy dtype): rows go
# over the wire as their bits, in a fixed byte order (numpy has no bfloat16).
_STORED: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.int32, np.dtype("<i4")),
    "float16": (torch.int16, np.dtype("<i2")),
    "bfloat16": (torch.int16, np.dtype("<i2")),
}


def _wire(dtype: torch.dtype) -> tuple[torch.dtype, np.dtype]:
    return _STORED[str(dtype).removeprefix("torch.")]


def to_blobs(rows: torch.Tensor) -> list[bytes]:
    """One bytes object per stored row ``[n, W]`` (float32, float16 or bfloat16),
    little-endian."""
    bits, wire = _wire(rows.dtype)
    data = rows.contiguous().view(bits).numpy().astype(wire, copy=False).tobytes()
    width = rows.shape[1] * rows.dtype.itemsize
    return [data[k : k + width] for k in range(0, len(data), width)]


def view_layout(t: TableLayout, spec: TableSpec, state_dim: int, state_init: float) -> TableLayout:
    """``t`` seen by a client that declared ``spec`` while the rows on the server keep the
    state layout ``(state_dim, state_init)``: `from_blobs` gives the client its own layout
    (the server's weights, its own fresh state: none for a weights-only client), and the
    server's rows, state included, stay as they are."""
    if (spec.state_dim, float(spec.state_init)) == (state_dim, float(state_init)):
        return dataclasses.replace(t, spec=spec, stored=None)
    stored = dataclasses.replace(spec, state_dim=state_dim, state_init=state_init)
    return dataclasses.replace(t, spec=spec, stored=stored)


def decode_blobs(values: list[Any], spec: TableSpec) -> torch.Tensor:
    """Stored rows ``[n, stored_width]`` of ``spec``'s layout from ``n`` row blobs, checking
    each has its width."""
    data = b"".join(values)
    if len(data) != len(values) * spec.row_bytes:
        bad = next(v for v in values if len(v) != spec.row_bytes)
        raise RuntimeError(
            f"table {spec.name!r}: a row on the server has {len(bad)} bytes, expected "
            f"{spec.row_bytes} (dim={spec.dim} {spec.dtype} + state_dim={spec.state_dim} "
            f"float32); was the table re-declared with another state layout by another client?"
        )
    _, wire = _wire(spec.dtype)
    flat = np.frombuffer(data, dtype=wire).astype(wire.newbyteorder("="))
    rows = torch.from_numpy(flat).view(spec.dtype)
    return rows.reshape(len(values), spec.stored_width)


def from_blobs(values: list[Any], t: TableLayout) -> torch.Tensor:
    """Stored rows ``[n, stored_width]`` of the client's layout (``t.spec``) from ``n`` row
    blobs of the server's (``t.server``): the same rows, or, for a view, the server's weights
    with the client's fresh state."""
    rows = decode_blobs(values, t.server)
    if t.stored is None:
        return rows
    weights, _ = t.stored.unpack(rows)
    state = torch.full((len(values), t.spec.state_dim), float(t.spec.state_init))
    return t.spec.pack(weights, state)


def run_commands(client: Client, commands: list[Command]) -> list[Any]:
    """Replies to ``(slot, command)`` pairs, in order: one pipeline (a round trip) per node.

    On a cluster, commands go straight to the node that owns their slot, as redis-py's own
    cluster pipeline would send them but without its per-key slot checks (they cost more
    than the round trip). A slot that moved raises MovedError/AskError; `RedisKV` refreshes
    the slot map and retries.
    """
    if not isinstance(client, redis.cluster.RedisCluster):
        if len(commands) == 1:
            return [client.execute_command(*commands[0][1])]
        pipe = client.pipeline(transaction=False)
        for _, command in commands:
            pipe.execute_command(*command)
        return pipe.execute()
    nodes = client.nodes_manager
    by_node: dict[str, tuple[redis.cluster.ClusterNode, list[int]]] = {}
    for k, (slot, _) in enumerate(commands):
        node = nodes.get_node_from_slot(slot)
        by_node.setdefault(node.name, (node, []))[1].append(k)
    replies: list[Any] = [None] * len(commands)
    for node, positions in by_node.values():
        pipe = client.get_redis_connection(node).pipeline(transaction=False)
        for k in positions:
            pipe.execute_command(*commands[k][1])
        for k, reply in zip(positions, pipe.execute(), strict=True):
            replies[k] = reply
    return replies


def set_nx(client: Client, batch: KeyBatch, positions: list[int], blobs: list[bytes]) -> list[bool]:
    """Create the keys at ``positions`` of the batch unless they exist: True where created.

    One MSETNX per slot group sets the whole group when none of its keys exists (the usual
    case, one command); a group where some key exists (another writer got there first) is
    redone key by key with ``SET NX``, so each key keeps whichever value came first.
    """
    slot_at = [-1] * len(batch.keys)
    for slot, a, b in batch.groups:
        slot_at[a:b] = [slot] * (b - a)
    groups: dict[int, list[int]] = {}
    for j, k in enumerate(positions):
        groups.setdefault(slot_at[k], []).append(j)
    commands = []
    for slot, members in groups.items():
        args: list[bytes] = [b""] * (2 * len(members))
        args[0::2] = [batch.keys[positions[j]] for j in members]
        args[1::2] = [blobs[j] for j in members]
        commands.append((slot, ("MSETNX", *args)))
    created = [True] * len(positions)
    retry: list[tuple[int, int]] = []
    for (slot, members), reply in zip(groups.items(), run_commands(client, commands), strict=True):
        if not reply:
            retry.extend((slot, j) for j in members)
    if retry:
        one_by_one = [
            (slot, ("SET", batch.keys[positions[j]], blobs[j], "NX")) for slot, j in retry
        ]
        for (_, j), reply in zip(retry, run_commands(client, one_by_one), strict=True):
            created[j] = bool(reply)
    return created


# One slot group of a fenced write. KEYS: the fence, the group's marks. ARGV: the writer's
# epoch, "set" or "del", then the rows' keys and values interleaved ("set") or the keys ("del"),
# all in the slot of KEYS (so passed as arguments: no Lua table is built per row). Returns the
# marks' new values, or {"fenced", epoch found} having written nothing. MSET/DEL go in parts:
# Lua's unpack has a bounded stack.
_WRITE = """
local fence = redis.call('GET', KEYS[1])
if fence ~= ARGV[1] then
  return {'fenced', fence or ''}
end
local command = ARGV[2] == 'del' and 'DEL' or 'MSET'
local last = #ARGV
for i = 3, last, 4000 do
  redis.call(command, unpack(ARGV, i, math.min(i + 3999, last)))
end
local marks = {}
for u = 2, #KEYS do
  marks[u - 1] = redis.call('INCR', KEYS[u])
end
return marks
"""


def _group_units(t: TableLayout, batch: KeyBatch) -> list[list[int]]:
    """Write marks of each group's buckets (on a single server: the table's one mark)."""
    return [t.slot_units[slot] for slot, _, _ in batch.groups]


def read_marked(
    client: Client, t: TableLayout, batch: KeyBatch, fence: bytes | None = None
) -> tuple[list[bytes | None], list[int], list[Any]]:
    """``(values, mark units, mark values)`` of ``batch.keys``: each group's marks are read
    first, then its rows, in one round trip per node. With ``fence`` (a writer's epoch), each
    group's fence is read too, and one that differs raises `Fenced`."""
    if not batch.keys:
        return [], [], []
    commands: list[Command] = []
    units: list[int] = []
    for (slot, a, b), group_units in zip(batch.groups, _group_units(t, batch), strict=True):
        if fence is not None:
            commands.append((slot, ("GET", t.fence_keys[group_units[0]])))
        commands.extend((slot, ("GET", t.mark_keys[u])) for u in group_units)
        units.extend(group_units)
        commands.append((slot, ("MGET", *batch.keys[a:b])))
    replies = run_commands(client, commands)
    marks, values, k = [], [], 0
    for group_units in _group_units(t, batch):
        if fence is not None:
            if replies[k] != fence:
                raise Fenced(replies[k] or b"")
            k += 1
        marks.extend(replies[k : k + len(group_units)])
        values.extend(replies[k + len(group_units)])
        k += len(group_units) + 1
    return values, units, marks


def write_marked(
    client: Client, t: TableLayout, batch: KeyBatch, blobs: list[bytes] | None, fence: bytes
) -> tuple[list[int], list[Any]]:
    """Write ``blobs`` (in the batch's key order) to ``batch.keys`` (``None``: delete the
    keys) and ``INCR`` the group's marks, one script per group that first checks the table's
    fence is ``fence`` (the writer's epoch); returns ``(mark units, INCR replies)``.

    Raises:
        Fenced: a group found another epoch (and wrote nothing; groups before it may have
            been written, all with this writer's epoch still current when they ran).
    """
    commands: list[Command] = []
    units: list[int] = []
    for (slot, a, b), group_units in zip(batch.groups, _group_units(t, batch), strict=True):
        keys = [t.fence_keys[group_units[0]], *(t.mark_keys[u] for u in group_units)]
        if blobs is None:
            rows: list[bytes] = batch.keys[a:b]
        else:
            rows = [b""] * (2 * (b - a))
            rows[0::2] = batch.keys[a:b]
            rows[1::2] = blobs[a:b]
        mode = b"del" if blobs is None else b"set"
        commands.append((slot, ("EVAL", _WRITE, len(keys), *keys, fence, mode, *rows)))
        units.extend(group_units)
    if not commands:
        return [], []
    incrs: list[Any] = []
    for reply in run_commands(client, commands):
        if reply and reply[0] == b"fenced":
            raise Fenced(reply[1])
        incrs.extend(reply)
    return units, incrs
