"""Hiding secrets in tier URLs: what every message, summary and repr prints instead of the URL.

A Redis URL may carry a password in two places: ``redis://user:PASSWORD@host`` and a query
parameter (``?password=...``, as redis-py accepts). Both become ``***``.
"""

from __future__ import annotations

import re
import urllib.parse

_MASK = "***"
# Query parameters whose value is a secret (redis-py takes ``password``; the others are common
# spellings that some tools add).
SECRET_PARAMS = frozenset({"password", "passwd", "pass", "pwd", "auth", "token", "secret"})
# Options shown after a secret parameter; any other name there may be the rest of a password
# typed with '&' unencoded (?password=Wr&ng=Pw), so it is hidden with it.
SHOWN_AFTER_SECRET = frozenset(
    {
        "namespace", "chunk_rows", "retry_timeout_s", "shared", "owner", "lease_ttl_s",
        "verify_interval_s", "capacity_rows", "db", "socket_timeout", "socket_connect_timeout",
        "protocol", "client_name", "max_connections", "health_check_interval", "timeout",
    }
)  # fmt: skip
# A URL inside free text: a scheme, "://", then anything up to white space or a quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
# A scheme whose "://" was mistyped: the scheme word, the ':' and '/' typed instead, the rest.
_MISTYPED_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*|)([:/]*)(.*)", re.DOTALL)


def redact_url(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@``, a lone ``SECRET@``, and secret query
    parameters) as ``***``.

    A URL is cut where a password typed without percent-encoding would be cut, never where
    the parser would: everything up to the last ``@`` is user information, a fragment
    (``#...``) is hidden whole, and query segments after a secret parameter that are not
    known options (`SHOWN_AFTER_SECRET`) are taken for the rest of it (``?password=Wr&ngPw``,
    ``?password=Wr&ng=Pw``) and hidden with it. A spec whose ``://`` was mistyped
    (``redis:/:pw@host``, ``rediss//:pw@host``) is redacted as the URL it was meant to be,
    keeping the typo. Text with no ``://`` and no ``@``, ``?`` or ``#`` comes back unchanged.

    Example:
        >>> redact_url("redis://:hunter2@127.0.0.1:6379/0?password=x&namespace=m")
        'redis://:***@127.0.0.1:6379/0?password=***&namespace=m'
    """
    if not isinstance(url, str):
        return url
    if "://" not in url:
        if not any(c in url for c in "@?#"):
            return url
        typed = _MISTYPED_SCHEME.fullmatch(url)
        assert typed is not None  # the pattern matches any text
        scheme, separator, rest = typed.groups()
        return redact_url(f"x://{rest}").replace("x://", scheme + separator, 1)
    scheme, _, rest = url.partition("://")
    prefix = ""
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        # A lone "SECRET@host" is a user name to redis-py, but people put passwords there.
        plain_user = colon and not any(c in user for c in "/?#&=")
        prefix = f"{user}:{_MASK}@" if plain_user else f"{_MASK}@"
    rest, hash_sign, _ = rest.partition("#")
    path, question, query = rest.partition("?")
    segments, secret = [], False
    for segment in query.split("&") if query else []:
        key, equals, _ = segment.partition("=")
        name = urllib.parse.unquote_plus(key)
        if secret and (not equals or name not in SHOWN_AFTER_SECRET):
            continue  # after a secret: may be the rest of a password holding '&'
        if not equals:
            segments.append(segment)
            continue
        secret = name.lower() in SECRET_PARAMS
        segments.append(f"{key}={_MASK}" if secret else segment)
    out = f"{scheme}://{prefix}{path}"
    if question:
        out += "?" + "&".join(segments)
    if hash_sign:
        out += "#" + _MASK
    return out


_ENCODE_HINT = (
    "A password holding any of # ? / @ & % + (or a user name holding :) must be "
    "percent-encoded in a URL: urllib.parse.quote(password, safe='') gives the text to put "
    "there (# is %23, ? is %3F, / is %2F, @ is %40, & is %26, % is %25, + is %2B)."
)


def check_url(url: str, known_params: frozenset[str] | None = None) -> None:
    """Refuse a URL that a password typed without percent-encoding would cut in the wrong
    place, with a message that shows no part of the URL (any part could be a password).

    Args:
        url: ``scheme://[user[:password]@]host[:port][/path][?query]``.
        known_params: query parameter names accepted (None: any name). An unknown name is
            named in the message only when the URL holds no secret parameter (after one it
            could be the rest of a password holding '&').

    Raises:
        ValueError: a ``#`` (a Redis URL has no fragment: the rest would be dropped); an ``@``
            after the host (a password holding ``/``, ``?`` or ``@``); a ``%`` not followed
            by two hex digits; a query parameter without ``=`` or of an unknown name.
    """
    _, _, rest = url.partition("://")
    refused = "store URL refused (not shown: it may hold a password): "
    if "#" in rest:
        raise ValueError(refused + "it holds '#', which ends a URL. " + _ENCODE_HINT)
    authority_end = min((rest.find(c) for c in "/?" if c in rest), default=len(rest))
    if "@" in rest[authority_end:]:
        raise ValueError(refused + "it holds '@' after the host. " + _ENCODE_HINT)
    if re.search(r"%(?![0-9A-Fa-f]{2})", rest):
        raise ValueError(refused + "it holds '%' not followed by two hex digits. " + _ENCODE_HINT)
    _, _, query = rest.partition("?")
    segments = [s for s in query.split("&") if s] if query else []
    if any("=" not in s for s in segments):
        raise ValueError(refused + "a query parameter has no '='. " + _ENCODE_HINT)
    if known_params is None:
        return
    names = [urllib.parse.unquote_plus(s.partition("=")[0]) for s in segments]
    unknown = [n for n in names if n not in known_params and n.lower() not in SECRET_PARAMS]
    if not unknown:
        return
    if any(n.lower() in SECRET_PARAMS for n in names):
        raise ValueError(
            refused + "a query parameter after the password is not a known option. " + _ENCODE_HINT
        )
    raise ValueError(
        f"unknown option {unknown[0]!r} in the store URL; known: {', '.join(sorted(known_params))}"
    )


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (`redact_url`): for error messages that quote a
    URL someone typed."""
    return _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)
