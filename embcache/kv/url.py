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

Schemes are a registry (`SCHEMES`): `open_store` looks a URL's scheme up there and hands the
URL to that scheme's opener, a function of a `StoreRequest`. The built-in tiers are registered
in the table at the end of this module; a new tier is its module and one line there, or, for a
tier defined elsewhere, a `register_scheme` call of its own:

    register_scheme("toy", lambda request: ToyKV(request.spec), "'toy://name' (ToyKV)")
    store = open_store("toy://name")

`embcache.kv.contract` holds the tests every tier must pass.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from embcache.kv.base import Store
from embcache.kv.redact import check_url, redact_url

DEFAULT_TIERED_CAPACITY_ROWS = 1_000_000


@dataclass(frozen=True)
class StoreRequest:
    """What `open_store` hands a scheme's opener.

    Attributes:
        spec: the URL as given, ``scheme://...`` (a message shows it through `redact_url`
            only: it may hold a password).
        scheme: the registered scheme it starts with.
        owner: the job's lease token (`open_store`'s ``owner``), for a tier with leases.
        takeover: the lease token of the job this one continues, for a tier with leases.
    """

    spec: str
    scheme: str
    owner: str | None = None
    takeover: str | None = None


Opener = Callable[[StoreRequest], Store]


@dataclass(frozen=True)
class Scheme:
    """A registered scheme: its opener, and the form the message of an unknown store shows
    for it (None: another scheme's form covers it)."""

    opener: Opener
    form: str | None = None


SCHEMES: dict[str, Scheme] = {}
"""Every scheme `open_store` opens, by name (the text before ``://``), in registration order."""

_SCHEME_NAME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")  # RFC 3986's scheme characters


def register_scheme(scheme: str, opener: Opener, form: str | None = None) -> None:
    """Make `open_store` open ``scheme://...`` URLs with ``opener``.

    Args:
        scheme: the text before ``://`` (a letter, then letters, digits, ``+``, ``-``, ``.``).
        opener: builds the store from the `StoreRequest` (parsing the rest of the URL and its
            options, raising ValueError for a malformed one).
        form: how the message of an unknown store lists this form (``"'toy://name' (ToyKV)"``).

    Raises:
        ValueError: a malformed scheme, or one registered already.
    """
    if not isinstance(scheme, str) or not _SCHEME_NAME.fullmatch(scheme):
        raise ValueError(
            f"a store URL scheme is a letter, then letters, digits, +, - or .; got {scheme!r}"
        )
    if scheme in SCHEMES:
        raise ValueError(f"store URL scheme {scheme!r} is registered already")
    SCHEMES[scheme] = Scheme(opener, form)


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
            passes the same). Handed to a scheme's opener in its `StoreRequest`; HostKV
            ignores it.
        takeover: the lease token of the job this one continues (a resumed job passes the one
            its checkpoint recorded; see `RedisKV`). Handed on as ``owner`` is.

    Raises:
        ValueError: an unknown form (with the accepted forms and the registered schemes
            listed) or a malformed option.
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
    registered = SCHEMES.get(scheme) if sep else None
    if registered is None:
        raise ValueError(_unaccepted(spec))
    return registered.opener(StoreRequest(spec, scheme, owner, takeover))


def open_redis(request: StoreRequest) -> Store:
    """The Redis forms: `RedisKV` on one server or a cluster, and behind a ``tiered+`` scheme
    a `TieredKV` of ``capacity_rows`` host rows in front of it (options: the module
    docstring)."""
    spec, owner, takeover = request.spec, request.owner, request.takeover
    tiered = request.scheme.startswith("tiered+")
    scheme = request.scheme.removeprefix("tiered+")
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


def accepted_forms() -> list[str]:
    """The forms `open_store` takes, as its message of an unknown store lists them."""
    registered = [s.form for s in SCHEMES.values() if s.form is not None]
    return ["None or 'host' (HostKV in this process)", *registered, "a Store instance"]


def _unaccepted(spec: object) -> str:
    forms = "\n  ".join(accepted_forms())
    shown = redact_url(spec) if isinstance(spec, str) else spec
    schemes = ", ".join(f"{name}://" for name in SCHEMES)
    return f"unknown store {shown!r}; accepted forms:\n  {forms}\nregistered schemes: {schemes}"


# The built-in schemes, one line each; a new tier adds its own (see the module docstring).
register_scheme("redis", open_redis, "'redis://host:port/db' (also rediss://, unix://)")
register_scheme("rediss", open_redis)
register_scheme("unix", open_redis)
register_scheme("redis+cluster", open_redis, "'redis+cluster://host:port'")
register_scheme("rediss+cluster", open_redis)
register_scheme(
    "tiered+redis",
    open_redis,
    "'tiered+redis://host:port/db' or 'tiered+redis+cluster://host:port' "
    "(TieredKV host row cache in front of RedisKV; ?capacity_rows=N)",
)
register_scheme("tiered+rediss", open_redis)
register_scheme("tiered+unix", open_redis)
register_scheme("tiered+redis+cluster", open_redis)
register_scheme("tiered+rediss+cluster", open_redis)
