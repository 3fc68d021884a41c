"""torchrec's preprocessed Criteo: ``day_<d>_dense.npy``, ``day_<d>_sparse.npy`` and
``day_<d>_labels.npy`` per day, as ``BinaryCriteoUtils.tsv_to_npys`` (torchrec's
``npy_preproc_criteo.py``) writes them, read memory-mapped a batch at a time.

* dense: float32 ``[N, 13]``, already log-transformed by the preprocessing (used as stored);
* sparse: int ``[N, 26]``, the categorical values (raw hashes, or contiguous ids after
  ``sparse_to_contiguous``), taken modulo ``buckets`` rows per table as torchrec's ``hashes``;
* labels: int ``[N, 1]`` (or ``[N]``), 0 or 1.

Rows are read with torchrec's ``BinaryCriteoUtils.load_npy_range`` (memory-mapped) where
torchrec is installed, else with ``numpy.load(mmap_mode="r")``: the same rows either way. Held
out: the last day when there are several, else the last ``eval_fraction`` of the rows.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embcache.data.base import ClickDataset
from embcache.data.batch import Batch
from embcache.data.criteo import (
    DEFAULT_BUCKETS,
    FEATURE_NAMES,
    NUM_CAT,
    NUM_INT,
    describe_buckets,
    make_batch,
)
from embcache.data.loader import background

_DENSE_RE = re.compile(r"day_(\d+)_dense\.npy")

RowReader = Callable[[Path, int, int], np.ndarray]
"""``read(path, start, count) -> rows [count, columns]`` of a 2-D ``.npy`` file."""


def numpy_rows(path: Path, start: int, count: int) -> np.ndarray:
    """Rows ``[start, start + count)`` of a ``.npy`` file, memory-mapped (labels ``[N]`` read
    as ``[N, 1]``)."""
    array = np.load(path, mmap_mode="r")
    return np.array(array[start : start + count]).reshape(count, -1)


def torchrec_rows() -> RowReader | None:
    """torchrec's memory-mapped range reader, or None when torchrec (or iopath) is missing."""
    try:
        from torchrec.datasets.criteo import BinaryCriteoUtils
    except ImportError:
        return None

    def read(path: Path, start: int, count: int) -> np.ndarray:
        if len(npy_shape(path)) == 1:  # labels saved flat: torchrec reads 2-D files only
            return numpy_rows(path, start, count)
        rows = BinaryCriteoUtils.load_npy_range(str(path), start, count, mmap_mode=True)
        return np.array(rows)

    return read


def npy_shape(path: Path) -> tuple[int, ...]:
    """The shape of a ``.npy`` file (its header, through a memory map)."""
    return tuple(np.load(path, mmap_mode="r").shape)


@dataclass(frozen=True)
class _Day:
    """One day's three files and the row range of it in a split."""

    dense: Path
    sparse: Path
    labels: Path
    start: int
    stop: int


def _days(path: Path) -> list[tuple[Path, Path, Path, int]]:
    found = sorted(
        (int(m.group(1)), p) for p in path.iterdir() if (m := _DENSE_RE.fullmatch(p.name))
    )
    if not found:
        raise ValueError(f"{path}: no day_<d>_dense.npy files (torchrec's preprocessed Criteo)")
    days = []
    for d, dense in found:
        sparse, labels = path / f"day_{d}_sparse.npy", path / f"day_{d}_labels.npy"
        for f in (sparse, labels):
            if not f.exists():
                raise ValueError(f"{path}: {dense.name} has no {f.name} beside it")
        shapes = {f.name: npy_shape(f) for f in (dense, sparse, labels)}
        n = shapes[dense.name][0]
        expected = {dense.name: (n, NUM_INT), sparse.name: (n, NUM_CAT)}
        bad = [
            f"{name} {shape}"
            for name, shape in shapes.items()
            if (name in expected and shape != expected[name])
            or (name == labels.name and shape not in ((n,), (n, 1)))
        ]
        if bad:
            raise ValueError(
                f"{path}: day {d} should hold {n} rows of 13 dense, 26 sparse and 1 label "
                f"column; got {', '.join(bad)}"
            )
        days.append((dense, sparse, labels, n))
    return days


class CriteoNpy(ClickDataset):
    """torchrec's preprocessed Criteo day files (see the module docstring).

    Args:
        path: the directory of ``day_<d>_{dense,sparse,labels}.npy`` files.
        batch_size: samples per batch.
        buckets: rows of each categorical table (an int for all 26, or 26 ints); 0: the
            values as they are, in unbounded tables.
        eval_fraction: the share of rows held out when there is a single day.
        reader: how rows are read (default: torchrec's reader where installed, else numpy's).
        depth: batches read ahead of the trainer.
    """

    num_dense = NUM_INT

    def __init__(
        self,
        path: str | Path,
        batch_size: int = 1024,
        buckets: int | Sequence[int] = DEFAULT_BUCKETS,
        eval_fraction: float = 0.1,
        reader: RowReader | None = None,
        depth: int = 4,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: not a directory of .npy day files")
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
        self.read = reader or torchrec_rows() or numpy_rows
        days = _days(self.path)
        if len(days) >= 2:
            self._train = [_Day(*files, 0, n) for *files, n in days[:-1]]
            self._eval = [_Day(*days[-1][:3], 0, days[-1][3])]
            self.split = f"last day held out ({days[-1][0].name})"
        else:
            *files, n = days[0]
            cut = round(n * (1 - eval_fraction))
            self._train, self._eval = [_Day(*files, 0, cut)], [_Day(*files, cut, n)]
            self.split = f"last {eval_fraction:.0%} of the rows held out"
        self.train_rows = sum(d.stop - d.start for d in self._train)

    def describe(self) -> str:
        return (
            f"Criteo npy {self.path}: {self.train_rows:,} training rows, 13 dense, 26 "
            f"categorical features {describe_buckets(self.buckets)}, {self.split}, "
            f"batch {self.batch_size}"
        )

    def _ranges(self, days: list[_Day], drop_last: bool) -> Iterator[list[tuple[_Day, int, int]]]:
        """Row ranges ``(day, start, count)`` of each batch (a batch may span days)."""
        pending: list[tuple[_Day, int, int]] = []
        have = 0
        for day in days:
            row = day.start
            while row < day.stop:
                take = min(self.batch_size - have, day.stop - row)
                pending.append((day, row, take))
                have += take
                row += take
                if have == self.batch_size:
                    yield pending
                    pending, have = [], 0
        if pending and not drop_last:
            yield pending

    def _batch(self, ranges: list[tuple[_Day, int, int]]) -> Batch:
        dense = np.concatenate([self.read(d.dense, a, n) for d, a, n in ranges])
        sparse = np.concatenate([self.read(d.sparse, a, n) for d, a, n in ranges])
        labels = np.concatenate([self.read(d.labels, a, n) for d, a, n in ranges])
        ids = sparse.astype(np.int64)
        ids = np.where(self.buckets > 0, ids % np.maximum(self.buckets, 1), ids)
        return make_batch(dense.astype(np.float32), ids, labels.reshape(-1).astype(np.float32))

    def train_samples(self, count: bool = False) -> int | None:
        return self.train_rows

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        full = self.train_rows // self.batch_size
        if not full:
            raise ValueError(
                f"{self.path}: the training split holds {self.train_rows} rows, fewer than one "
                f"batch of {self.batch_size}"
            )

        def batches() -> Iterator[Batch]:
            epoch_start = start % full  # batches are the same every epoch: skip by index
            while True:
                ranges = self._ranges(self._train, drop_last=True)
                for ranges_of_batch in itertools.islice(ranges, epoch_start, None):
                    yield self._batch(ranges_of_batch)
                epoch_start = 0

        return background(batches(), self.depth)

    def eval_batches(self, limit: int | None = None) -> Iterator[Batch]:
        ranges = itertools.islice(self._ranges(self._eval, drop_last=False), limit)
        return background((self._batch(r) for r in ranges), self.depth)
