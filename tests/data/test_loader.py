"""Background loading: order kept, at most `depth` items ahead, errors delivered where they
happen, the reader stopped when the consumer stops; line counts of plain and gzip files."""

from __future__ import annotations

import gzip
import threading
import time
from pathlib import Path

import pytest

from embcache.data.loader import background, count_lines


def test_items_come_in_order_from_another_thread() -> None:
    threads = []

    def items():
        for i in range(50):
            threads.append(threading.current_thread().name)
            yield i

    assert list(background(items(), depth=3)) == list(range(50))
    assert set(threads) == {"embcache-data"}


def test_the_reader_stays_at_most_depth_ahead() -> None:
    made = []

    def items():
        for i in range(100):
            made.append(i)
            yield i

    it = background(items(), depth=4)
    assert next(it) == 0
    time.sleep(0.3)
    assert len(made) <= 1 + 4 + 1  # the one taken, a full queue, one waiting to go in
    it.close()


def test_an_error_reaches_the_consumer_after_the_good_items() -> None:
    def items():
        yield 1
        yield 2
        raise ValueError("line 3 is bad")

    it = background(items())
    assert [next(it), next(it)] == [1, 2]
    with pytest.raises(ValueError, match="line 3 is bad"):
        next(it)


def test_a_consumer_that_stops_stops_the_reader() -> None:
    stopped = threading.Event()

    def items():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            stopped.set()

    it = background(items(), depth=2)
    next(it)
    it.close()
    assert not any(t.name == "embcache-data" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(ValueError, match="depth"):
        next(background(iter([]), depth=0))


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize(
    "text", ["a\nb\nc\n", "a\nb\nc", "", "\n\n"], ids=["nl", "no-nl", "empty", "blank"]
)
def test_count_lines(tmp_path: Path, gz: bool, text: str) -> None:
    path = tmp_path / "f"
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    assert count_lines(path) == len(text.splitlines())
