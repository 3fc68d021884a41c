"""What the CLI says when a run ends on an error is true of the CLI: a full tier's "nothing was
lost" (true for an API caller that repeats the call) is not said by a process that exits and
drops its cache."""

from __future__ import annotations

from pathlib import Path

from embcache.cli.job import ended_by
from embcache.kv.errors import TierFullError

FULL = (
    "Redis tier redis://127.0.0.1:6379/0 is full: put on table 't0' was refused "
    "(OutOfMemoryError): OOM command not allowed. Nothing was lost (the rows stay in the "
    "cache); raise the server's maxmemory, or bound the tables in front of it (a tier "
    "capacity), then repeat the call"
)


def test_a_full_tier_that_ends_the_run_does_not_say_nothing_was_lost() -> None:
    for checkpoint, resume in ((Path("ck"), "--resume ck"), (None, "a new run")):
        said = str(ended_by(TierFullError(FULL), checkpoint))
        assert "Nothing was lost" not in said and "stay in the cache" not in said
        assert said.startswith("Redis tier redis://127.0.0.1:6379/0 is full: put on table 't0'")
        assert "lost with this process" in said and said.endswith(resume)


def test_other_errors_are_reported_as_they_are() -> None:
    err = TierFullError.__mro__[1]("refused")
    assert ended_by(err, None) is err
