"""`open_store`: a `Store` from a short spec string (a CLI flag, a config field).

Accepted forms:

    None, "host"                          HostKV(): in-process host memory (the default)
    "redis://host:port/db"                RedisKV on one server (also rediss://, unix://)
    "redis+cluster://host:port"           RedisKV on a Redis Cluster (any node's address)
    "tiered+redis://host:port/db"         TieredKV(RedisKV(...)): a host-memory write-back
    "tiered+redis+cluster://host:port"    row cache of capacity_rows rows in front of Redis
    a Store instance                      returned as is

Options go in the query string and are taken out before the rest reaches redis-py:
``namespace`` (default "embcache"), ``chunk_rows`` (4096), ``retry_timeout_s`` (10),
``shared`` (0/1, default 0: tables are leased to this job alone; 1: read-only, beside the
job that trains them), ``owner`` (the job's lease
token), ``lease_ttl_s`` (30), ``verify_interval_s`` (5) and, for the tiered forms,
``capacity_rows`` (default 1_000_000); see `RedisKV`. Any other query parameter is a redis-py
connection option (``password`` among them). Example:
``tiered+redis://127.0.0.1:6379/0?namespace=dlrm&capacity_rows=200000``.

Messages never show a password given in the URL (`embcache.kv.redact`). URLs are parsed as
URLs: a password holding a reserved character (``# ? / @ & % +``) must be percent-encoded
(``urllib.parse.quote(password, safe='')``); a URL that such a password would cut in the wrong
place is refused with a message that shows no part of it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

from embcache.kv.base import Store
from embcache.kv.redact import check_url, redact_url

DEFAULT_TIERED_CAPACITY_ROWS = 1_000_000

ACCEPTED_FORMS = (
    "None or 'host' (HostKV in this process)",
    "'redis://host:port/db' (also rediss://, unix://)",
    "'redis+cluster://host:port'",
    "'tiered+redis://host:port/db' or 'tiered+redis+cluster://host:port' "
    "(TieredKV host row cache in front of RedisKV; ?capacity_rows=N)",
    "a Store instance",
)

_REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def _flag(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


_STORE_OPTIONS: dict[str, Callable[[str], object]] = {
    "namespace": str,
    "chunk_rows": int,
    "retry_timeout_s": float,
    "shared": _flag,
    "owner": str,
    "lease_ttl_s": float,
    "verify_interval_s": float,
}


def open_store(
    spec: str | Store | None, *, owner: str | None = None, takeover: str | None = None
) -> Store:
    """The `Store` that ``spec`` names (see the module docstring for the forms).

    Args:
        spec: the form.
        owner: lease token of a Redis form (as its ``?owner=`` option; every rank of one job
            passes the same). Ignored by the other forms.
        takeover: the lease token of the job this one continues (a resumed job passes the one
            its checkpoint recorded; see `RedisKV`). Ignored by the other forms.

    Raises:
        ValueError: an unknown form or a malformed option, with the accepted forms listed.
        TierUnavailableError: a Redis form whose server does not answer.
        TierAuthError: a Redis form whose server wants another password.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "host"):
        from embcache.kv.host import HostKV

        return HostKV()
    if not isinstance(spec, str):
        if isinstance(spec, Store):
            return spec
        raise ValueError(_unaccepted(spec))
    scheme, sep, _ = spec.partition("://")
    tiered = scheme.startswith("tiered+")
    if tiered:
        scheme = scheme.removeprefix("tiered+")
    if not sep or scheme not in _REDIS_SCHEMES:
        raise ValueError(_unaccepted(spec))
    redis_kv_class()  # a clear ImportError when redis-py is missing
    from embcache.kv.redis_wire import redis_url_params

    check_url(spec, redis_url_params() | set(_STORE_OPTIONS) | {"capacity_rows"})
    url, options = _split_options(f"{scheme}://{spec.partition('://')[2]}", spec)
    capacity = options.pop("capacity_rows", None)
    if capacity is not None and not tiered:
        raise ValueError(
            f"store {redact_url(spec)!r}: capacity_rows is an option of the tiered+ forms only"
        )
    if owner is not None:
        if options.get("owner", owner) != owner:
            raise ValueError(
                f"store {redact_url(spec)!r}: its owner option differs from owner={owner!r}"
            )
        options["owner"] = owner
    if takeover is not None:
        options["takeover"] = takeover

    back = redis_kv_class()(url, **options)
    if not tiered:
        return back
    from embcache.kv.tiered import TieredKV

    return TieredKV(
        back, capacity_rows=DEFAULT_TIERED_CAPACITY_ROWS if capacity is None else capacity
    )


def redis_kv_class() -> type:
    """`RedisKV`, imported on first use: only the Redis tiers need redis-py.

    Raises:
        ImportError: redis-py is not installed, naming the package to install.
    """
    try:
        import redis  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "the Redis tier needs the redis-py package, which is not installed: "
            "pip install 'redis[hiredis]>=5.0'"
        ) from err
    from embcache.kv.redis_kv import RedisKV

    return RedisKV


def _split_options(url: str, original: str) -> tuple[str, dict[str, Any]]:
    """``url`` without our options in its query string, and those options, typed."""
    parts = urllib.parse.urlsplit(url)
    kept, options = [], {}
    types: dict[str, Callable[[str], object]] = {**_STORE_OPTIONS, "capacity_rows": int}
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if key not in types:
            kept.append((key, value))
            continue
        try:
            options[key] = types[key](value)
        except ValueError:
            kind = "0 or 1" if types[key] is _flag else f"a valid {types[key].__name__}"
            raise ValueError(
                f"store {redact_url(original)!r}: option {key}={value!r} is not {kind}"
            ) from None
    query = urllib.parse.urlencode(kept)
    return urllib.parse.urlunsplit(parts._replace(query=query)), options


def _unaccepted(spec: object) -> str:
    forms = "\n  ".join(ACCEPTED_FORMS)
    shown = redact_url(spec) if isinstance(spec, str) else spec
    return f"unknown store {shown!r}; accepted forms:\n  {forms}"
