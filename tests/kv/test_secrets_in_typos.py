"""A store URL whose ``://`` was mistyped is echoed without its password, by the API and by
the CLI (a password must never reach a terminal or a log because of a typo)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from embcache.kv.redact import redact_url
from embcache.kv.url import open_store

SECRET = "Hunter2Secret"


@pytest.mark.parametrize(
    "spec, shown",
    [
        (f"redis:/:{SECRET}@127.0.0.1:6379/0", "redis:/:***@127.0.0.1:6379/0"),
        (f"rediss//:{SECRET}@127.0.0.1:6379/0", "rediss//:***@127.0.0.1:6379/0"),
        (f"redis:user:{SECRET}@h:1", "redis:user:***@h:1"),
        (f"tiered+redis//{SECRET}@h:1", "tiered+redis//***@h:1"),
        (f"redis:/h:1/0?password={SECRET}&namespace=m", "redis:/h:1/0?password=***&namespace=m"),
    ],
    ids=["one-slash", "no-colon", "user", "lone-secret", "query"],
)
def test_a_scheme_typo_is_refused_without_the_password(spec: str, shown: str) -> None:
    assert redact_url(spec) == shown
    with pytest.raises(ValueError, match="unknown store") as err:
        open_store(spec)
    assert SECRET not in str(err.value)
    assert repr(shown) in str(err.value)


def test_text_that_is_not_a_url_is_unchanged() -> None:
    assert redact_url("host") == "host"
    assert redact_url("redis:/127.0.0.1:6379/0") == "redis:/127.0.0.1:6379/0"


def test_the_cli_echoes_a_mistyped_store_without_its_password(tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "embcache.cli", "train", "--steps", "1", "--store",
         f"redis:/:{SECRET}@127.0.0.1:6379/0"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0
    assert SECRET not in run.stdout + run.stderr
    assert "***" in run.stderr and "Traceback" not in run.stderr
