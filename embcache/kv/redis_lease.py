"""Owner leases: two jobs cannot train the same Redis tables by accident.

Opening a table (`RedisKV.init_table`) takes its lease, a key ``ns:lease:T`` that expires
``lease_ttl_s`` after its last renewal and names its holder::

    x\\n<owner>\\npid 4242 on host-a       exclusive: held by one owner (the default)
    s\\n\\npid 4242 on host-a              shared: any client that opens the table shared

A client renews its leases from a background thread every ``lease_ttl_s / 3``, and before a
call when the last renewal is older than half the TTL (a process that was paused, or whose
thread starved). A job that dies stops renewing, so its tables are free at most ``lease_ttl_s``
later. Taking or renewing is one Lua script, so the check and the write are atomic:

* a free table is taken;
* a lease of the same owner is renewed: the same job again (a resumed run given the owner
  token its checkpoint recorded, or another rank of a distributed job);
* a shared lease is joined by a client opening the table shared;
* anything else is refused with `TierOwnershipError`, naming the namespace and sharing options.

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
import weakref
from collections.abc import Callable
from typing import Any

from embcache.kv.errors import TierOwnershipError

# KEYS[1] lease; ARGV: mode ("x"/"s"), owner, full value, ttl in ms. Returns nil when taken or
# renewed, else {holder value, remaining ms}.
_TAKE = """
local v = redis.call('GET', KEYS[1])
if v then
  local mode, owner = string.match(v, '^(%a)\\n([^\\n]*)\\n')
  if mode ~= ARGV[1] or (mode == 'x' and owner ~= ARGV[2]) then
    return {v, redis.call('PTTL', KEYS[1])}
  end
  if mode == 's' then
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    return false
  end
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
return false
"""

# KEYS[1] lease; ARGV[1] owner. Deletes an exclusive lease of this owner.
_DROP = """
local v = redis.call('GET', KEYS[1])
if v and string.match(v, '^x\\n([^\\n]*)\\n') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def lease_key(namespace: bytes, table: str) -> bytes:
    """Key of the lease of ``table``: ``ns:lease:T``."""
    return namespace + b":lease:" + table.encode()


def _close_at_exit(leases: weakref.ref[TableLeases], pid: int) -> None:
    """Release the leases at exit, in the process that took them only: a child forked from
    it shares the owner token, and deleting the leases at its exit would free the tables
    while the parent still writes them."""
    held = leases()
    if held is not None and os.getpid() == pid:
        held.close()


class TableLeases:
    """The leases one `RedisKV` holds, and the thread that renews them.

    Args:
        client: the redis-py client (a server or a cluster).
        describe: ``describe()`` -> "Redis tier URL (namespace 'ns')", for messages.
        namespace: key prefix.
        owner: this job's token: clients with the same token share exclusive leases.
        shared: open tables shared instead of exclusively.
        ttl_s: lease lifetime after a renewal.
        transient: exceptions that mean "the server is not reachable now" (renewals then wait
            for the next try instead of failing).
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
    ) -> None:
        self._client = client
        self._describe = describe
        self._namespace = namespace
        self.owner = owner
        self.shared = shared
        self.ttl_s = ttl_s
        self._transient = transient
        mode = "s" if shared else "x"
        holder = f"pid {os.getpid()} on {socket.gethostname()}"
        self._mode = mode
        self._value = f"{mode}\n{'' if shared else owner}\n{holder}".encode()
        self._take = client.register_script(_TAKE)
        self._drop = client.register_script(_DROP)
        self._held: dict[str, float] = {}  # table -> monotonic time of its last renewal
        self._lost: dict[str, str] = {}  # table -> why it is no longer ours
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exit_hook = functools.partial(_close_at_exit, weakref.ref(self), os.getpid())
        atexit.register(self._exit_hook)

    # -- taking and checking ----------------------------------------------------------------

    def take(self, table: str) -> None:
        """Take (or renew) the lease of ``table``, or raise `TierOwnershipError`."""
        refused = self._run_take(table)
        if refused is not None:
            raise TierOwnershipError(self._refusal(table, *refused))
        with self._lock:
            self._held[table] = time.monotonic()
            self._lost.pop(table, None)
        self._start_thread()

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
        for table in tables:
            try:
                self._drop(keys=[lease_key(self._namespace, table)], args=[self.owner])
            except Exception:
                break  # unreachable: each further try would wait out its socket timeout

    # -- internals --------------------------------------------------------------------------

    def _run_take(self, table: str) -> tuple[bytes, int] | None:
        key = lease_key(self._namespace, table)
        ttl_ms = max(1, int(self.ttl_s * 1000))
        reply = self._take(keys=[key], args=[self._mode, self.owner, self._value, ttl_ms])
        if not reply:
            return None
        return reply[0], int(reply[1])

    def _renew(self, table: str) -> None:
        try:
            refused = self._run_take(table)
        except self._transient:
            return  # not reachable now: the calls themselves report it; try again later
        with self._lock:
            if table not in self._held:
                return
            if refused is None:
                self._held[table] = time.monotonic()
            else:
                self._lost[table] = (
                    f"this job's lease on table {table!r} lapsed (no renewal for over "
                    f"lease_ttl_s={self.ttl_s:g} s: was the process paused?) and was taken over. "
                    + self._refusal(table, *refused)
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
        text = holder.decode(errors="replace")
        mode, _, rest = text.partition("\n")
        _, _, who = rest.partition("\n")
        expires = f"{remaining_ms / 1000:.1f} s" if remaining_ms >= 0 else "no expiry"
        if mode == "s":
            held = f"is open shared by other jobs (last {who}; lease expires in {expires})"
            fix = (
                "open it shared too (?shared=1 in the URL, RedisKV(shared=True)), or give this "
                "job its own namespace (?namespace=NAME, RedisKV(namespace=...))"
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
