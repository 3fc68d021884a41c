"""What the training loop reads: a click-prediction dataset with a training stream and a held-out
split, whatever its format.

    data = open_dataset("criteo:/data/criteo/train.txt.gz", batch_size=4096)  # or any reader
    model = DLRM(data.tables(dim=16), dense_in_features=data.num_dense, ...)
    for batch in data.train_batches():            # Batch: dense [B, N], sparse, labels [B]
        ...                                       # endless: the training split, epoch after epoch
    for batch in data.eval_batches():             # the held-out split, once
        ...

Each feature has its own table (``t_<feature>``) of ``rows[i]`` rows (None: unbounded, raw
hashed ids); a feature's bag holds one id (Criteo) or several (MovieLens genres). A sequence
feature (`ClickDataset.sequence_features`: a MovieLens user's history) is in the batches'
sparse features too, and looks up the table of the feature it names.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Iterator

from embcache.data.batch import Batch
from embcache.engine.tables import TableConfig
from embcache.kernels.pooling import PoolingMode


class ClickDataset(abc.ABC):
    """A click-prediction dataset: tables, a training stream and a held-out split.

    Attributes:
        feature_names: the sparse features, in the order of their tables.
        rows: rows of each feature's table (None: unbounded).
        poolings: how each feature's bag is pooled (``"sum"`` unless a reader says otherwise).
        num_dense: dense features per sample (0 for none).
        batch_size: samples per batch.
    """

    feature_names: list[str]
    rows: list[int | None]
    poolings: dict[str, str]
    num_dense: int
    batch_size: int

    def tables(self, dim: int, pooling: PoolingMode | str | None = None) -> list[TableConfig]:
        """One `TableConfig` per feature (table ``t_<feature>`` looks up ``<feature>``);
        ``pooling`` overrides each feature's own."""
        return [
            TableConfig(
                name=f"t_{f}",
                embedding_dim=dim,
                num_embeddings=n,
                feature_names=[f],
                pooling=pooling or self.poolings.get(f, "sum"),
            )
            for f, n in zip(self.feature_names, self.rows, strict=True)
        ]

    def sequence_features(self) -> dict[str, str]:
        """The sequence features its batches carry besides the bags (one id per past event,
        looked up unpooled), each mapped to the feature whose table its ids index (MovieLens
        `with_history`: ``{"history": "item"}``); none by default."""
        return {}

    def train_samples(self, count: bool = False) -> int | None:
        """Samples in the training split: None when endless, or unknown without reading the
        files through (and ``count`` is False; with it, a reader counts them)."""
        return None

    @abc.abstractmethod
    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """Training batches from number ``start`` on, without end (the training split over and
        over; a last batch smaller than ``batch_size`` is dropped)."""

    @abc.abstractmethod
    def eval_batches(self, limit: int | None = None) -> Iterator[Batch]:
        """The held-out split once (at most ``limit`` batches; the last may be smaller)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for a summary: format, source, sizes, split."""


def skip(batches: Iterator[Batch], count: int) -> Iterator[Batch]:
    """``batches`` without its first ``count`` items."""
    return itertools.islice(batches, count, None)
