"""The README and the docs speak to users, not about how this project's own work is organised.

README.md, docs/*.md and benchmarks/README.md must not say "lent", "device minute(s)", or
"task" for a unit of this project's work ("no task so far", "the tasks that measured them").
"task" in its technical sense stays: a phrase is allowed when a technical word qualifies the
task ("an asyncio task is cancelled", "the background task that flushes"). A phrase may be
wrapped over two lines; it is reported at the line where it starts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
DOCUMENTS += sorted((ROOT / "docs").glob("*.md"))

LENT = re.compile(r"\blent\b", re.IGNORECASE)
DEVICE_MINUTES = re.compile(r"\bdevice[\s-]+minutes?\b", re.IGNORECASE)
# "task" after a determiner, or before a verb or relative pronoun: the work-assignment sense.
TASK = re.compile(
    r"\b(?:no|a|per|this|each|every|one|later|earlier|next|drawn)\s+tasks?\b"
    r"|\btasks?\s+(?:that|is|was|were|so\s+far|has|had|gets?|got)\b",
    re.IGNORECASE,
)
# Words that make "task" a technical one (asyncio, a thread pool, a scheduler of work items).
TECHNICAL = frozenset(
    {"async", "asyncio", "background", "worker", "prefetch", "celery", "io", "thread", "pool"}
)


def findings(text: str) -> list[tuple[int, str]]:
    """(line number, phrase) of each forbidden phrase in ``text``, in order."""
    found = []
    for pattern in (LENT, DEVICE_MINUTES, TASK):
        for m in pattern.finditer(text):
            if pattern is TASK:
                at = m.start() + m[0].lower().index("task")
                before = re.findall(r"[\w/-]+", text[:at])[-1:]
                if before and before[0].lower() in TECHNICAL:
                    continue
            found.append((text.count("\n", 0, m.start()) + 1, " ".join(m[0].split())))
    return sorted(found)


def test_the_documents_exist() -> None:
    names = {str(p.relative_to(ROOT)) for p in DOCUMENTS}
    for name in ("README.md", "benchmarks/README.md", "docs/design.md", "docs/gpu-check.md"):
        assert (ROOT / name).is_file() and name in names, name


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_documents_speak_to_users(path: Path) -> None:
    found = findings(path.read_text())
    where = [f"{path.relative_to(ROOT)}:{line}: {phrase!r}" for line, phrase in found]
    assert not where, "words about this project's logistics:\n" + "\n".join(where)


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("No kernel has run (no task so far was given one).", "no task"),
        ("Run it before a GPU is lent.", "lent"),
        ("LENT: a word in capitals", "LENT"),
        ("one rerun within the 15 device minutes", "device minutes"),
        ("a device-minute", "device-minute"),
        ("the tasks that measured them", "tasks that"),
        ("This task adds a test.", "This task"),
        ("measured per task", "per task"),
        ("A task is drawn at random.", "A task"),
        ("the next task\ngets one", "next task"),
    ],
    ids=[
        "no-task",
        "lent",
        "capitals",
        "device-minutes",
        "hyphen",
        "tasks-that",
        "this-task",
        "per-task",
        "a-task",
        "wrapped",
    ],
)
def test_each_phrase_is_found(text: str, phrase: str) -> None:
    assert phrase in [p for _, p in findings(text)], findings(text)


@pytest.mark.parametrize(
    "text",
    [
        "rows come back silently",
        "an equivalent, excellent, talented lentil",
        "an asyncio task is cancelled at exit",
        "the background task that flushes rows",
        "the prefetch worker's task queue",
        "a thread pool task has finished",
        "the device's minutes of busy time",
    ],
    ids=["silently", "inside-words", "asyncio", "background", "task-queue", "pool", "device-s"],
)
def test_technical_words_are_allowed(text: str) -> None:
    assert findings(text) == []


def test_the_line_of_a_wrapped_phrase_is_where_it_starts() -> None:
    text = "# Title\n\nplain words\nthe tasks\nthat measured it\n"
    assert findings(text) == [(4, "tasks that")]
