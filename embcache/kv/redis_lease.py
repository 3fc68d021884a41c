"""Owner leases and fencing: one writer per table, even when a lease is lost.

Opening a table (`RedisKV.init_table`) takes its lease, a key ``ns:lease:T`` (on a cluster
``ns:lease:{h.0}:T``, in the slot of the table's epoch) that expires ``lease_ttl_s`` after its
last renewal and names its holder and the epoch it took::

    x\\n<owner>\\npid 4242 on host-a\\n7   exclusive: held by one job (the default), epoch 7
    s\\n\\npid 4242 on host-a           shared: any client that opens the table shared

A client renews its leases from a background thread every ``lease_ttl_s / 3``, and before a
call when the last renewal is older than half the TTL (a process that was paused, or whose
thread starved). A job that dies stops renewing, so its tables are free at most ``lease_ttl_s``
later. Taking or renewing is one Lua script, so the check and the write are atomic:

* a free table is taken, and its epoch (``ns:fence:T``, kept for good) goes up by one;
* a lease of the same owner and epoch is renewed: the same job (another rank of a distributed
  job shares the token, and joins the lease's epoch); a lease that lapsed with nobody taking
  it meanwhile (the epoch unchanged) is taken back;
* a shared lease is joined by a client opening the table shared;
* anything else is refused with `TierOwnershipError`, naming the namespace and sharing options.

A resumed job never reuses the token of the job that wrote its checkpoint: it has its own, and
names that one as ``takeover``. It takes that job's lease only once the lease is gone, or at
once when the holder is provably dead (on this host, its pid no longer runs); a holder on
another host is watched for up to the lease's remaining time, and one that renews meanwhile is
alive: refused. A live job is never taken over, whatever token the other one holds.

Fencing makes a lost lease harmless: every write of a writer is one script per slot group that
compares the table's epoch with the writer's before it writes (`embcache.kv.redis_wire`), and
its reads compare it in the same round trip. A writer whose lease was taken over (it was paused
past its TTL, or its host lost the network) writes nothing more: its next call raises
`TierOwnershipError` naming the table, instead of overwriting the new owner's rows.

`close` deletes exclusive leases still held (shared ones expire by themselves: other clients
may still hold them), and so does the interpreter's exit for leases never closed: a job that
ends normally frees its tables at once, not ``lease_ttl_s`` later. Collections register their
own exit write-back after the store was opened, so it runs first (atexit runs last-registered
first).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from embcache.kv.base import table_hash
from embcache.kv.errors import TierOwnershipError
from embcache.kv.redis_wire import fence_key

# KEYS: the lease, the table's epoch (its first fence key). ARGV: mode ("x"/"s"), owner,
# holder, ttl in ms, the epoch this client holds ("" before its first take), the exact lease
# value it may take over ("" for none), a random nonce. Returns {"ok", epoch, 1 when newly
# taken else 0}, or {"held", lease value ("" when gone), remaining ms} when refused. An epoch is
# "<n>.<nonce>", n one above the last: unique even after a server lost its keys. A lease and
# epoch both gone (a server restarted empty) are put back for the client that held them.
_TAKE = """
local v = redis.call('GET', KEYS[1])
if ARGV[1] == 's' then
  if v and string.sub(v, 1, 2) ~= 's\\n' then
    return {'held', v, redis.call('PTTL', KEYS[1])}
  end
  redis.call('SET', KEYS[1], 's\\n\\n' .. ARGV[3], 'PX', ARGV[4])
  return {'ok', '', 0}
end
local head = 'x\\n' .. ARGV[2] .. '\\n' .. ARGV[3] .. '\\n'
local f = redis.call('GET', KEYS[2])
if v then
  local mode, owner, epoch = string.match(v, '^(%a)\\n([^\\n]*)\\n[^\\n]*\\n?([^\\n]*)$')
  if mode == 'x' and owner == ARGV[2] and (ARGV[5] == '' or ARGV[5] == epoch) then
    if f and f ~= epoch then
      return {'held', '', -2}
    end
    if not f then
      redis.call('SET', KEYS[2], epoch)
    end
    redis.call('SET', KEYS[1], head .. epoch, 'PX', ARGV[4])
    return {'ok', epoch, 0}
  end
  if ARGV[6] == '' or v ~= ARGV[6] then
    return {'held', v, redis.call('PTTL', KEYS[1])}
  end
elseif ARGV[5] ~= '' then
  if f and f ~= ARGV[5] then
    return {'held', '', -2}
  end
  if not f then
    redis.call('SET', KEYS[2], ARGV[5])
  end
  redis.call('SET', KEYS[1], head .. ARGV[5], 'PX', ARGV[4])
  return {'ok', ARGV[5], 0}
end
local n = tonumber(string.match(f or '0', '^(%d+)') or '0') + 1
local epoch = n .. '.' .. ARGV[7]
redis.call('SET', KEYS[2], epoch)
redis.call('SET', KEYS[1], head .. epoch, 'PX', ARGV[4])
return {'ok', epoch, 1}
"""

# KEYS[1] lease; ARGV[1] owner. Deletes an exclusive lease of this owner.
_DROP = """
local v = redis.call('GET', KEYS[1])
if v and string.match(v, '^x\\n([^\\n]*)\\n') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] a fence key; ARGV[1] an epoch: raise the fence to it (never to an older epoch).
RAISE_FENCE = """
local f = redis.call('GET', KEYS[1])
local have = tonumber(string.match(f or '0', '^(%d+)') or '0')
if have <= tonumber(string.match(ARGV[1], '^(%d+)')) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""


def lease_key(namespace: bytes, table: str, cluster: bool = False) -> bytes:
    """Key of the lease of ``table``: ``ns:lease:T`` (on a cluster ``ns:lease:{h.0}:T``, in the
    slot of `epoch_key`, so that one script takes both)."""
    if not cluster:
        return namespace + b":lease:" + table.encode()
    return namespace + b":lease:{%d.0}:" % table_hash(table) + table.encode()


def epoch_key(namespace: bytes, table: str, cluster: bool = False) -> bytes:
    """Key of the table's epoch: its first fence key (`embcache.kv.redis_wire.fence_key`)."""
    return fence_key(namespace, table, 0 if cluster else None)


def parse_lease(value: bytes) -> tuple[str, str, str, str]:
    """``(mode, owner, holder, epoch)`` of a lease value (empty strings where absent)."""
    mode, _, rest = value.decode(errors="replace").partition("\n")
    owner, _, rest = rest.partition("\n")
    holder, _, epoch = rest.partition("\n")
    return mode, owner, holder, epoch


def holder_is_dead(holder: str) -> bool:
    """True when ``holder`` ("pid N on HOST") is a process of this host that no longer runs
    (or a zombie): it can write nothing more. False when it runs, or cannot be checked."""
    words = holder.split()
    if len(words) != 4 or words[0] != "pid" or words[2] != "on" or not words[1].isdigit():
        return False
    if words[3] != socket.gethostname():
        return False
    pid = int(words[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's process: it runs
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _close_at_exit(leases: weakref.ref[TableLeases], pid: int) -> None:
    """Release the leases at exit, in the process that took them only: a child forked from
    it shares the owner token, and deleting the leases at its exit would free the tables
    while the parent still writes them."""
    held = leases()
    if held is not None and os.getpid() == pid:
        held.close()


class TableLeases:
    """The leases one `RedisKV` holds, their epochs, and the thread that renews them.

    Args:
        client: the redis-py client (a server or a cluster).
        describe: ``describe()`` -> "Redis tier URL (namespace 'ns')", for messages.
        namespace: key prefix.
        owner: this job's token: clients with the same token share exclusive leases.
        shared: open tables shared instead of exclusively.
        ttl_s: lease lifetime after a renewal.
        transient: exceptions that mean "the server is not reachable now" (renewals then wait
            for the next try instead of failing).
        cluster: the client is a Redis Cluster's (the lease key carries a hash tag).
        takeover: the token of the job whose tables this one continues (a resumed job: its
            checkpoint's `owner`): its leases are taken once they lapse, or at once when
            their holder is provably dead. None: no such job.
    """

    def __init__(
        self,
        client: Any,  # redis.Redis or RedisCluster; not imported here to keep this module light
        describe: Callable[[], str],
        namespace: bytes,
        owner: str,
        shared: bool,
        ttl_s: float,
        transient: tuple[type[BaseException], ...],
        cluster: bool = False,
        takeover: str | None = None,
    ) -> None:
        self._client = client
        self._describe = describe
        self._namespace = namespace
        self.owner = owner
        self.shared = shared
        self.ttl_s = ttl_s
        self.cluster = cluster
        self.takeover = takeover
        self._transient = transient
        self._mode = "s" if shared else "x"
        self.holder = f"pid {os.getpid()} on {socket.gethostname()}"
        self._take = client.register_script(_TAKE)
        self._drop = client.register_script(_DROP)
        self._held: dict[str, float] = {}  # table -> monotonic time of its last renewal
        self._epochs: dict[str, bytes] = {}  # table -> the epoch this client writes under
        self._lost: dict[str, str] = {}  # table -> why it is no longer ours
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exit_hook = functools.partial(_close_at_exit, weakref.ref(self), os.getpid())
        atexit.register(self._exit_hook)
        # Run by `close` before the leases go (best effort): a clean end's other records.
        self.before_close: Callable[[], None] | None = None

    # -- taking and checking ----------------------------------------------------------------

    def take(self, table: str) -> bool:
        """Take (or renew, or join) the lease of ``table``, or raise `TierOwnershipError`.

        Returns:
            True when the table was newly taken (its epoch went up: any earlier writer is
            fenced off), False when this job already held it (renewed, or joined by a rank).
        """
        with self._lock:
            known = self._epochs.get(table, b"")
        reply = self._run_take(table, known, b"")
        if reply[0] == b"held" and self.takeover is not None and not self.shared:
            reply = self._take_over(table, reply)
        if reply[0] != b"ok":
            raise TierOwnershipError(self._refusal(table, reply[1], int(reply[2])))
        with self._lock:
            self._held[table] = time.monotonic()
            self._epochs[table] = reply[1]
            self._lost.pop(table, None)
        self._start_thread()
        return bool(reply[2])

    def epoch(self, table: str) -> bytes | None:
        """The epoch this client writes ``table`` under (None: shared, or not taken)."""
        with self._lock:
            return None if self.shared else self._epochs.get(table)

    def check(self, table: str) -> None:
        """Before a call on ``table``: raise if its lease was lost; renew it now when the last
        renewal is older than half the TTL (this process may have been paused)."""
        with self._lock:
            lost = self._lost.get(table)
            renewed = self._held.get(table)
        if lost is not None:
            raise TierOwnershipError(lost)
        if renewed is not None and time.monotonic() - renewed > self.ttl_s / 2:
            self._renew(table)
            with self._lock:
                lost = self._lost.get(table)
            if lost is not None:
                raise TierOwnershipError(lost)

    def restore(self, table: str) -> bool:
        """The table's epoch was found gone (a server restarted empty, a node of a cluster
        that lost its keys): put this client's lease and epoch back unless another job took
        the table meanwhile. True when restored."""
        with self._lock:
            epoch = self._epochs.get(table)
        if not epoch or self.shared:
            return False
        return self._run_take(table, epoch, b"")[0] == b"ok"

    def deposed(self, table: str, found: bytes) -> NoReturn:
        """A write or read found ``table``'s epoch is no longer ours: another job took the
        table over. The table stays unusable for this client; `TierOwnershipError`."""
        with self._lock:
            mine = self._epochs.get(table, b"").decode()
            message = (
                f"{self._describe()}: table {table!r} was taken over by another job (its epoch "
                f"is {found.decode(errors='replace') or 'gone'}, this job's was {mine}): this "
                f"job's lease lapsed (no renewal for over lease_ttl_s={self.ttl_s:g} s: was "
                f"the process paused?) or another job was started on it, and this job's "
                f"writes are refused so that they cannot overwrite that job's rows. Stop this "
                f"job; continue from the last checkpoint once the other job is done "
                f"(embcache train --resume DIR), or give each job its own ?namespace=NAME"
            )
            self._lost.setdefault(table, message)
            message = self._lost[table]
        raise TierOwnershipError(message)

    def close(self) -> None:
        """Stop renewing and delete the exclusive leases still held (best effort: a server
        that is down lets them expire)."""
        atexit.unregister(self._exit_hook)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            tables, self._held = list(self._held), {}
        if self.shared:
            return
        if self.before_close is not None:
            with contextlib.suppress(Exception):  # a server down: the next job reports it
                self.before_close()
            self.before_close = None
        for table in tables:
            try:
                self._drop(keys=[self._lease_key(table)], args=[self.owner])
            except Exception:
                break  # unreachable: each further try would wait out its socket timeout

    # -- internals --------------------------------------------------------------------------

    def _lease_key(self, table: str) -> bytes:
        return lease_key(self._namespace, table, self.cluster)

    def _run_take(self, table: str, epoch: bytes, takeover: bytes) -> list[Any]:
        keys = [self._lease_key(table), epoch_key(self._namespace, table, self.cluster)]
        ttl_ms = max(1, int(self.ttl_s * 1000))
        nonce = uuid.uuid4().hex[:12]
        args = [self._mode, self.owner, self.holder, ttl_ms, epoch, takeover, nonce]
        return list(self._take(keys=keys, args=args))

    def _take_over(self, table: str, refused: list[Any]) -> list[Any]:
        """The lease of ``table`` is held: take it if its holder is the job named by
        ``takeover`` and provably dead, or once it lapses; else the refusal stands."""
        value = refused[1]
        mode, owner, holder, _ = parse_lease(value)
        if mode != "x" or owner != self.takeover:
            return refused
        if holder_is_dead(holder):
            return self._run_take(table, b"", value)
        if holder.endswith(f" on {socket.gethostname()}"):
            return refused  # a live process of this host: the job still runs
        # On another host: a live job renews within a third of the TTL. Watch the lease.
        deadline = time.monotonic() + int(refused[2]) / 1000 + 0.5
        last = int(refused[2])
        while time.monotonic() < deadline:
            time.sleep(min(0.25, self.ttl_s / 10))
            reply = self._run_take(table, b"", b"")
            if reply[0] == b"ok" or reply[1] != value or int(reply[2]) > last:
                return reply  # taken (the lease lapsed), or renewed: its job is alive
            last = int(reply[2])
        return refused

    def _renew(self, table: str) -> None:
        with self._lock:
            epoch = self._epochs.get(table, b"")
        try:
            reply = self._run_take(table, epoch, b"")
        except self._transient:
            return  # not reachable now: the calls themselves report it; try again later
        with self._lock:
            if table not in self._held:
                return
            if reply[0] == b"ok":
                self._held[table] = time.monotonic()
            else:
                self._lost[table] = (
                    f"this job's lease on table {table!r} lapsed (no renewal for over "
                    f"lease_ttl_s={self.ttl_s:g} s: was the process paused?) and was taken over. "
                    + self._refusal(table, reply[1], int(reply[2]))
                )

    def _renew_all(self) -> None:
        with self._lock:
            tables = list(self._held)
        for table in tables:
            with contextlib.suppress(Exception):  # the thread must outlive any one failure
                self._renew(table)

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._heartbeat, name="embcache-redis-lease", daemon=True
        )
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self._renew_all()

    def _refusal(self, table: str, holder: bytes, remaining_ms: int) -> str:
        mode, owner, who, _ = parse_lease(holder)
        expires = f"{remaining_ms / 1000:.1f} s" if remaining_ms >= 0 else "no expiry"
        if not holder:
            held = "was taken by another job meanwhile (its lease is gone now)"
            fix = "give each job its own namespace (?namespace=NAME in the URL)"
        elif mode == "s":
            held = f"is open shared by other jobs (last {who}; lease expires in {expires})"
            fix = (
                "open it shared too (?shared=1 in the URL, RedisKV(shared=True)), or give this "
                "job its own namespace (?namespace=NAME, RedisKV(namespace=...))"
            )
        elif self.takeover is not None and owner == self.takeover:
            held = (
                f"is still held by the job that wrote the checkpoint this one resumes from "
                f"({who}; its lease expires in {expires}), which is alive"
            )
            fix = (
                "two jobs writing one table overwrite each other's rows: stop that job first "
                "(a job that was killed frees its tables at once for a job on its host, "
                "within lease_ttl_s for one elsewhere), or give this job its own namespace "
                "(?namespace=NAME)"
            )
        else:
            held = f"is in use by another job ({who}; its lease expires in {expires})"
            fix = (
                "give this job its own namespace (?namespace=NAME in the URL, "
                "RedisKV(namespace=...)); to train the same tables from several jobs on purpose, "
                "open them shared in every job (?shared=1, RedisKV(shared=True)); a job that "
                "died frees its tables within lease_ttl_s"
            )
        return f"Table {table!r} on {self._describe()} {held}: {fix}"
