"""Errors a tier raises when it cannot be trusted or reached: one base class, `TierError`, so a
caller (the CLI, a training loop) can catch every tier failure in one place and print its
one-line message.

None of them needs redis-py: `import embcache` works without it.
"""

from __future__ import annotations


class TierError(Exception):
    """Base of the errors a tier raises about itself (not about bad arguments, which are
    ``ValueError``/``TypeError``). The message is one line and never holds a password."""


class TierUnavailableError(TierError, ConnectionError):
    """The tier cannot be reached: at start, or still after ``retry_timeout_s`` of retries.

    The message names the URL (password hidden) and, mid-run, the table and operation. The call
    that raised it changed nothing that a retry would not redo: once the tier is back, the same
    call can be made again.
    """


class TierDataLossError(TierError):
    """The tier no longer holds writes it acknowledged: the server restarted empty, came back
    from an older snapshot, a replica behind its primary took over, or a cluster node lost
    its data.

    Raised instead of silently re-creating the missing rows from their initial values. The
    message names the URL, the table and what to do: stop, and resume from the last
    checkpoint. The store keeps raising it for that table; open a new store to go on.
    """


class TierOwnershipError(TierError):
    """Another live job holds the table (its lease has not expired), or this job's lease was
    taken over after it lapsed. The message names the namespace and sharing options."""


class TierCommandError(TierError):
    """The tier refused a command (out of memory, read-only replica, no permission): not a
    connection problem, so it is not retried. The message names the URL, table and operation
    and the server's reply, never the row bytes the command carried."""


class TierAuthError(TierError, ConnectionError):
    """The server refused the credentials: no password given where one is required, or a
    wrong one. The message says how to give it, without showing it."""


class TierFullError(TierCommandError):
    """The tier refused a write for lack of memory (Redis at ``maxmemory`` under
    ``maxmemory-policy noeviction``). Nothing was lost: the rows stay dirty in the cache and
    the call can be made again once there is room. The message says how to make room."""


class TierConfigError(TierError, ValueError):
    """The tier is configured so that it could drop keys without telling us (a Redis
    ``maxmemory`` with any eviction policy but ``noeviction``: rows, or the owner leases):
    refused when a table is declared."""
