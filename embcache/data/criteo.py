"""Criteo display-advertising logs as text: the Kaggle ``train.txt`` and the Terabyte ``day_N``
files, plain or gzip, streamed (never the whole file in memory).

Each line is ``label \\t I1..I13 \\t C1..C26``: a 0/1 label, 13 integer counts and 26
categorical values written as hexadecimal hashes (``68fd1e64``); any field but the label may be
empty. The usual transforms, as torchrec's preprocessing applies them:

* dense: ``log(1 + max(x, 0))`` (an empty count is 0);
* categorical: the hex value as an integer (empty: 0), modulo ``buckets`` rows per table, so
  the 26 tables are bounded (torchrec's ``hashes``; its DLRM example uses 100,000); with
  ``buckets=0`` the raw values go straight in, into unbounded tables (``num_embeddings=None``),
  which need an explicit cache capacity and are best given a tier capacity.

Held out: the last day when ``path`` is a directory of day files (``day_0``, ``day_1.gz``, ...),
else the last ``eval_fraction`` of the file (by bytes for a plain file, by lines, counted once,
for a gzip one). Example::

    data = CriteoText("train.txt.gz", batch_size=4096, buckets=100_000)
    model = DLRM(data.tables(dim=16), dense_in_features=data.num_dense)
    for batch in data.train_batches(): ...        # Batch, parsed on a background thread
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from embcache.data.base import ClickDataset
from embcache.data.batch import Batch
from embcache.data.loader import background, count_lines, open_text
from embcache.engine.inputs import JaggedBatch

NUM_INT = 13
NUM_CAT = 26
FEATURE_NAMES = [f"cat_{i}" for i in range(NUM_CAT)]  # torchrec's DEFAULT_CAT_NAMES
DEFAULT_BUCKETS = 100_000
_DAY_RE = re.compile(r"day_(\d+)(\.[A-Za-z0-9]+)*")
_MAX_HEX = 15  # hex digits that fit an int64
_SMALL = 4 << 20  # bytes of training files whose lines are counted without being asked

_HEX_VALUE = np.full(256, -1, dtype=np.int64)  # ASCII code -> hex digit (-1: not one)
for _digit, _chars in enumerate(zip(b"0123456789abcdef", b"0123456789ABCDEF", strict=True)):
    _HEX_VALUE[list(_chars)] = _digit
_HEX_VALUE[0] = 0  # numpy's padding of shorter strings; weighted out below


def hex_ids(fields: Sequence[bytes], where: str) -> np.ndarray:
    """int64 ``[n]``: each hexadecimal field's value (an empty field is 0), vectorised."""
    codes = np.array(fields, dtype=bytes)
    width = codes.dtype.itemsize
    if width > _MAX_HEX:
        raise ValueError(f"{where}: a categorical value has {width} hex digits (at most 15)")
    chars = np.frombuffer(codes.tobytes(), dtype=np.uint8).reshape(len(fields), width)
    digits = _HEX_VALUE[chars]
    length = (chars != 0).sum(axis=1, keepdims=True)
    if bool((digits < 0).any()):
        bad = int(np.nonzero((digits < 0).any(axis=1))[0][0])
        raise ValueError(f"{where}: categorical value {fields[bad]!r} is not hexadecimal")
    position = np.arange(width)
    shift = np.where(position < length, 4 * (length - 1 - position), 0)
    return ((digits << shift) * (position < length)).sum(axis=1)


def parse_lines(lines: Sequence[bytes], buckets: np.ndarray, where: str, first_line: int) -> Batch:
    """One batch of Criteo text lines.

    Args:
        lines: ``B`` lines of 40 tab-separated fields.
        buckets: int64 ``[26]`` rows of each categorical table (0: raw ids, unbounded).
        where: the file, for error messages.
        first_line: the 1-based line number of ``lines[0]`` in that file.

    Returns:
        dense float32 ``[B, 13]`` (``log(1 + max(x, 0))``), sparse keys ``cat_0..cat_25``
        with one id per bag, labels float32 ``[B]``.
    """
    rows = [line.rstrip(b"\r\n").split(b"\t") for line in lines]
    for k, row in enumerate(rows):
        if len(row) != 1 + NUM_INT + NUM_CAT or row[0] not in (b"0", b"1"):
            shown = lines[k][:80]
            raise ValueError(
                f"{where} line {first_line + k}: expected a 0/1 label and 39 tab-separated "
                f"features (40 fields), got {len(row)} fields: {shown!r}"
            )
    labels = np.array([row[0] == b"1" for row in rows], dtype=np.float32)
    counts = [f or b"0" for row in rows for f in row[1 : 1 + NUM_INT]]
    try:
        dense = np.array(counts).astype(np.int64).reshape(len(rows), NUM_INT)
    except (ValueError, OverflowError):
        raise ValueError(_bad_integer(rows, where, first_line)) from None
    dense = np.log1p(np.maximum(dense, 0)).astype(np.float32)
    fields = [f for row in rows for f in row[1 + NUM_INT :]]
    try:
        cats = hex_ids(fields, where)
    except ValueError as err:
        k = next((k for k, f in enumerate(fields) if not _is_hex(f)), None)
        if k is None:
            raise
        raise ValueError(
            f"{where} line {first_line + k // NUM_CAT}: categorical feature C{k % NUM_CAT + 1} "
            f"is {fields[k][:40]!r}, not a hexadecimal value of at most {_MAX_HEX} digits"
        ) from err
    ids = cats.reshape(len(rows), NUM_CAT)  # [B, 26]
    ids = np.where(buckets > 0, ids % np.maximum(buckets, 1), ids)
    return make_batch(dense, ids, labels)


def _bad_integer(rows: Sequence[Sequence[bytes]], where: str, first_line: int) -> str:
    """The first integer feature of ``rows`` that is not a 64-bit integer, as the error says
    it: its line, its column (I1..I13) and its value."""
    for k, row in enumerate(rows):
        for j, field in enumerate(row[1 : 1 + NUM_INT]):
            try:
                if field:
                    np.int64(int(field))
            except (ValueError, OverflowError):
                return (
                    f"{where} line {first_line + k}: integer feature I{j + 1} is {field[:40]!r}, "
                    "not an integer (Criteo's I1..I13 are counts: 260, not 260.0)"
                )
    return f"{where} lines {first_line}-{first_line + len(rows) - 1}: an integer feature is bad"


def _is_hex(field: bytes) -> bool:
    """Whether a categorical field is one `hex_ids` takes (empty, or up to 15 hex digits)."""
    return len(field) <= _MAX_HEX and all(_HEX_VALUE[c] >= 0 and c for c in field)


def describe_buckets(buckets: np.ndarray) -> str:
    """How the categorical ids are laid out, for a summary."""
    if not bool((buckets > 0).any()):
        return "as raw hashed ids (unbounded tables)"
    return f"hashed into {int(buckets.max()):,} rows each"


def make_batch(dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> Batch:
    """A `Batch` of one id per (sample, feature): ``ids`` int ``[B, 26]``."""
    sparse = JaggedBatch.from_lengths(
        keys=list(FEATURE_NAMES),
        values=torch.from_numpy(np.ascontiguousarray(ids.T, dtype=np.int64).reshape(-1)),
        lengths=torch.ones(ids.size, dtype=torch.int64),
    )
    return Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels))


@dataclass(frozen=True)
class _Segment:
    """Lines of one file: all of them, a byte range (plain files) or a line range."""

    path: Path
    byte_range: tuple[int, int] | None = None
    line_range: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """The file, for error messages (line numbers count from the segment's start)."""
        if self.byte_range and self.byte_range[0]:
            return f"{self.path} (from byte {self.byte_range[0]})"
        return str(self.path)

    def count(self) -> int:
        """Lines of the segment (those `lines` yields), counted in large chunks."""
        if self.line_range is not None and self.line_range[1] is not None:
            return self.line_range[1] - self.line_range[0]
        if self.byte_range is None:
            return count_lines(self.path)
        # The lines that start in [start, stop): the first byte, and each byte after a newline.
        start, stop = self.byte_range
        lines, position = int(start == 0 and stop > 0), max(start - 1, 0)
        with open(self.path, "rb") as stream:
            stream.seek(position)
            while position < stop - 1:
                chunk = stream.read(min(1 << 22, stop - 1 - position))
                if not chunk:
                    break
                lines += chunk.count(b"\n")
                position += len(chunk)
        return lines

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """``(1-based line number, line)`` of the segment's lines."""
        with open_text(self.path) as stream:
            if self.byte_range is None:
                first, last = self.line_range or (0, None)
                for k, line in enumerate(itertools.islice(stream, first, last)):
                    yield first + k + 1, line
                return
            start, stop = self.byte_range
            if start:  # the segment starts with the first line that starts at ``start`` or later
                stream.seek(start - 1)
                stream.readline()
            position = stream.tell()
            for k, line in enumerate(iter(stream.readline, b"")):
                if position >= stop:
                    return
                position += len(line)
                yield k + 1, line


def _day_files(path: Path) -> list[Path]:
    days = [(int(m.group(1)), p) for p in path.iterdir() if (m := _DAY_RE.fullmatch(p.name))]
    if not days:
        raise ValueError(f"{path}: no Criteo day files (day_0, day_1.gz, ...) in this directory")
    numbers = [n for n, _ in days]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"{path}: two files for one day in {sorted(p.name for _, p in days)}")
    return [p for _, p in sorted(days)]


class CriteoText(ClickDataset):
    """Criteo text logs (see the module docstring).

    Args:
        path: a file (plain or gzip) or a directory of day files.
        batch_size: samples per batch.
        buckets: rows of each categorical table (an int for all 26, or 26 ints); 0: the raw
            hashed values, in unbounded tables.
        eval_fraction: the share held out when there are no day files to hold out.
        progress: show a bar while counting the lines of a gzip file.
        depth: batches parsed ahead of the trainer.
    """

    num_dense = NUM_INT

    def __init__(
        self,
        path: str | Path,
        batch_size: int = 1024,
        buckets: int | Sequence[int] = DEFAULT_BUCKETS,
        eval_fraction: float = 0.1,
        progress: bool = False,
        depth: int = 4,
    ) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no such file or directory")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        rows = [buckets] * NUM_CAT if isinstance(buckets, int) else list(buckets)
        if len(rows) != NUM_CAT or any(isinstance(n, bool) or n < 0 for n in rows):
            raise ValueError(
                f"buckets must be an int >= 0 (0: raw ids) or 26 of them, got {buckets!r}"
            )
        self.batch_size = batch_size
        self.buckets = np.array(rows, dtype=np.int64)
        self.rows = [n or None for n in rows]
        self.feature_names = list(FEATURE_NAMES)
        self.poolings = {}
        self.depth = depth
        if self.path.is_dir():
            days = _day_files(self.path)
            if len(days) >= 2:
                self.split = f"last day held out ({days[-1].name})"
                self._train = [_Segment(p) for p in days[:-1]]
                self._eval = [_Segment(days[-1])]
                return
            self.path = days[0]
        self._train, self._eval = self._split_file(self.path, eval_fraction, progress)
        self.split = f"last {eval_fraction:.0%} held out"

    @staticmethod
    def _split_file(path: Path, fraction: float, progress: bool) -> tuple[list, list]:
        with open(path, "rb") as probe:
            gzipped = probe.read(2) == b"\x1f\x8b"
        if gzipped:
            n = count_lines(path, progress)
            cut = round(n * (1 - fraction))
            return [_Segment(path, line_range=(0, cut))], [_Segment(path, line_range=(cut, n))]
        size = path.stat().st_size
        cut = round(size * (1 - fraction))
        return [_Segment(path, byte_range=(0, cut))], [_Segment(path, byte_range=(cut, size))]

    def describe(self) -> str:
        return (
            f"Criteo text {self.path}: 13 dense, 26 categorical features "
            f"{describe_buckets(self.buckets)}, {self.split}, batch {self.batch_size}"
        )

    def train_samples(self, count: bool = False) -> int | None:
        """Lines of the training split: counted when ``count``, or when its files are small
        (a few MiB); else None."""
        if not count and sum(s.path.stat().st_size for s in self._train) > _SMALL:
            return None
        return sum(s.count() for s in self._train)

    def _chunks(self, segments: list[_Segment], drop_last: bool) -> Iterator[tuple]:
        """``(where, first line, lines)`` of batch_size lines; a batch may span files."""
        pending: list[bytes] = []
        where, first = "", 1
        for segment in segments:
            for number, line in segment.lines():
                if not pending:
                    where, first = segment.label, number
                pending.append(line)
                if len(pending) == self.batch_size:
                    yield where, first, pending
                    pending = []
        if pending and not drop_last:
            yield where, first, pending

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        return background(self._train_batches(start), self.depth)

    def _train_batches(self, start: int) -> Iterator[Batch]:
        skipped = 0
        while True:
            produced = 0
            for where, first, lines in self._chunks(self._train, drop_last=True):
                produced += 1
                if skipped < start:  # resuming: read, not parsed
                    skipped += 1
                    continue
                yield parse_lines(lines, self.buckets, where, first)
            if not produced:
                raise ValueError(
                    f"{self.path}: the training split holds fewer than one batch of "
                    f"{self.batch_size} samples"
                )

    def eval_batches(self, limit: int | None = None) -> Iterator[Batch]:
        chunks = self._chunks(self._eval, drop_last=False)
        parsed = (parse_lines(lines, self.buckets, w, f) for w, f, lines in chunks)
        return background(itertools.islice(parsed, limit), self.depth)
