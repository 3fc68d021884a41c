"""Passwords never show, on real redis-server processes that require them: URLs are parsed as
URLs, a password with reserved characters must be percent-encoded (and then works), and a URL
such a password would cut in the wrong place is refused with a message that shows no part of
it: no substring of 3 characters or more of the password, in any position of the URL."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from embcache.kv import open_store
from embcache.kv.base import TableSpec
from embcache.kv.redact import redact_text, redact_url
from embcache.kv.redis_kv import RedisKV
from tests.kv.redis_servers import RedisServer, running_server

PASSWORDS = {
    "hash": "My#Secret-77",  # found: redis://:My#Secret-77@... printed 'My'
    "ampersand": "Wr&ngPw",  # found: ?password=Wr&ngPw printed &ngPw
    "ampersand-equals": "Wr&ng=Pw9",
    "slash-question-at": "sl/sh?Qm@Z",
    "percent-plus": "pct%zz+Kq",
    "everything": "Zx:9@#&/?%+Yv",
}
FORMS: dict[str, Callable[[str, str], str]] = {
    "userinfo": lambda host, pw: f"redis://:{pw}@{host}/0",
    "user-and-password": lambda host, pw: f"redis://default:{pw}@{host}/0",
    "query": lambda host, pw: f"redis://{host}/0?password={pw}&namespace=s",
    "tiered": lambda host, pw: f"tiered+redis://:{pw}@{host}/0?capacity_rows=10",
}


def assert_no_part_shown(text: str, password: str) -> None:
    parts = {password[k : k + 3] for k in range(len(password) - 2)}
    shown = sorted(p for p in parts if p in text)
    assert not shown, f"{shown} of the password shown in: {text}"


@pytest.fixture(params=list(PASSWORDS), ids=list(PASSWORDS))
def secured(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[RedisServer, str]]:
    password = PASSWORDS[request.param]
    with running_server(tmp_path, password=password) as server:
        yield server, password


def _opened(url: str, tiered: bool) -> object:
    return open_store(url) if tiered else RedisKV(url)


@pytest.mark.parametrize("form", list(FORMS), ids=list(FORMS))
def test_a_password_typed_as_is_never_shows(secured: tuple[RedisServer, str], form: str) -> None:
    """Typed without encoding, the URL either means what was typed (and works) or is refused
    (a ValueError saying to percent-encode, or the server's refusal): never shown."""
    server, password = secured
    host = server.url.removeprefix("redis://").removesuffix("/0")
    url = FORMS[form](host, password)
    entries = [lambda: open_store(url)] + ([] if form == "tiered" else [lambda: RedisKV(url)])
    for enter in entries:
        try:
            store = enter()
        except Exception as err:  # any error: none may show the password
            text = f"{err}\n{err!r}"
            assert_no_part_shown(text, password)
            if isinstance(err, ValueError):
                assert "percent-encoded" in text and "quote(password" in text, text
            continue
        assert_no_part_shown(repr(store), password)
        store.close()  # type: ignore[attr-defined]
    assert_no_part_shown(redact_url(url), password)
    assert_no_part_shown(redact_text(f"opening {url} failed"), password)


@pytest.mark.parametrize("form", list(FORMS), ids=list(FORMS))
def test_a_percent_encoded_password_works(secured: tuple[RedisServer, str], form: str) -> None:
    server, password = secured
    host = server.url.removeprefix("redis://").removesuffix("/0")
    store = open_store(FORMS[form](host, urllib.parse.quote(password, safe="")))
    store.init_table(TableSpec("t0", dim=2, num_embeddings=10))
    store.put("t0", torch.tensor([1]), torch.ones(1, 2))
    assert torch.equal(store.get("t0", torch.tensor([1])), torch.ones(1, 2))
    assert_no_part_shown(repr(store), password)
    store.close()


@pytest.mark.parametrize(
    "url",
    [
        "redis://:My#Secret-77@127.0.0.1:1/0",
        "redis://127.0.0.1:1/0?password=Wr&ngPw",
        "redis://127.0.0.1:1/0?password=Wr&ng=Pw9",
        "redis://:sl/sh?Qm@127.0.0.1:1/0",
        "redis://:pct%zz@127.0.0.1:1/0",
    ],
    ids=["hash", "ampersand", "ampersand-equals", "slash-question", "bad-percent"],
)
def test_refusals_say_how_to_encode(url: str) -> None:
    with pytest.raises(ValueError, match="must be percent-encoded") as caught:
        open_store(url)
    assert "127.0.0.1" not in str(caught.value), "no part of the URL is shown"


def test_unknown_options_are_named_when_no_password_is_near() -> None:
    with pytest.raises(ValueError, match="unknown option 'nmespace'"):
        open_store("redis://127.0.0.1:1/0?nmespace=x")
