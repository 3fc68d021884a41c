"""Background loading and long reads: the readers parse on a thread of their own, a few batches
ahead of the trainer, and show a progress bar when a read takes a while.

    for batch in background(reader_batches(), depth=4):   # parsed while the model trains
        ...

The queue between the two is bounded (``depth`` batches), so a fast reader never holds more than
that in memory; an error in the reader reaches the consumer at the batch where it happened, and
a consumer that stops early (``break``, an exception, garbage collection) stops the reader.
"""

from __future__ import annotations

import gzip
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TypeVar

_T = TypeVar("_T")
_DONE = object()
_CHUNK = 1 << 22  # bytes per read when counting lines


class _Failed:
    """An exception raised in the reader, carried to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def background(items: Iterator[_T], depth: int = 4) -> Iterator[_T]:
    """``items``, produced on a daemon thread at most ``depth`` ahead of the consumer."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as error:  # handed to the consumer, which raises it
            put(_Failed(error))
            return
        put(_DONE)

    worker = threading.Thread(target=produce, name="embcache-data", daemon=True)
    worker.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        worker.join(timeout=5.0)


def open_text(path: Path) -> IO[bytes]:
    """A file for reading bytes, decompressed when it is gzip (by its magic number)."""
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def count_lines(path: Path, progress: bool = False) -> int:
    """Lines of a (possibly gzip) text file, read once in large chunks; a last line without a
    newline counts. A tqdm bar over the file's bytes when ``progress``."""
    from tqdm import tqdm

    total = path.stat().st_size
    lines = 0
    last = b"\n"
    with (
        open(path, "rb") as raw,
        tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"counting lines of {path.name}",
            disable=not progress,
            leave=False,
        ) as bar,
    ):
        gzipped = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        stream: IO[bytes] = gzip.GzipFile(fileobj=raw) if gzipped else raw
        while chunk := stream.read(_CHUNK):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
            bar.update(raw.tell() - bar.n)
    return lines + (last != b"\n")
