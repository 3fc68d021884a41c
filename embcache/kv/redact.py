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
# A URL inside free text: a scheme, "://", then anything up to white space or a quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@``, a lone ``SECRET@``, and secret query
    parameters) as ``***``.

    Text that is not a URL comes back unchanged; a URL that cannot be parsed loses everything
    between ``://`` and ``@`` rather than risk showing a password.

    Example:
        >>> redact_url("redis://:hunter2@127.0.0.1:6379/0?password=x&namespace=m")
        'redis://:***@127.0.0.1:6379/0?password=***&namespace=m'
    """
    if not isinstance(url, str) or "://" not in url:
        return url
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{_MASK}@{rest.rpartition('@')[2]}" if "@" in rest else url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        # A lone "SECRET@host" is a user name to redis-py, but people put passwords there.
        netloc = f"{user}:{_MASK}@{hostport}" if colon else f"{_MASK}@{hostport}"
    segments = []
    for segment in parts.query.split("&") if parts.query else []:
        key, equals, _ = segment.partition("=")
        secret = urllib.parse.unquote_plus(key).lower() in SECRET_PARAMS
        segments.append(f"{key}={_MASK}" if secret and equals else segment)
    # Put together by hand: urlunsplit would turn "unix:///path" into "unix:/path".
    out = f"{parts.scheme}://{netloc}{parts.path}"
    if segments:
        out += "?" + "&".join(segments)
    if parts.fragment:
        out += "#" + parts.fragment
    return out


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (`redact_url`): for error messages that quote a
    URL someone typed."""
    return _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)
