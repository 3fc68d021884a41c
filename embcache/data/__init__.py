"""Training data: the `Batch` record, the `ClickDataset` interface the training loop reads, the
synthetic Criteo-like stream and the readers of real data (Criteo text and torchrec's npy day
files, MovieLens), with background loading.

    data = open_dataset("movielens:ml-1m", batch_size=1024)  # as `embcache train --data`
"""

from pathlib import Path

from embcache.data.base import ClickDataset
from embcache.data.batch import Batch
from embcache.data.criteo import DEFAULT_BUCKETS, CriteoText
from embcache.data.criteo_npy import CriteoNpy
from embcache.data.loader import background
from embcache.data.movielens import MovieLens
from embcache.data.synthetic import SyntheticConfig, SyntheticCriteo

KINDS = ("criteo", "criteo-npy", "movielens")

__all__ = [
    "DEFAULT_BUCKETS",
    "KINDS",
    "Batch",
    "ClickDataset",
    "CriteoNpy",
    "CriteoText",
    "MovieLens",
    "SyntheticConfig",
    "SyntheticCriteo",
    "background",
    "open_dataset",
]


def open_dataset(
    spec: str,
    batch_size: int = 1024,
    buckets: int = DEFAULT_BUCKETS,
    eval_fraction: float = 0.1,
    progress: bool = False,
) -> ClickDataset:
    """The dataset ``KIND:PATH`` names: ``criteo`` (Kaggle/Terabyte text, plain or gzip, a
    file or a directory of day files), ``criteo-npy`` (torchrec's preprocessed day files) or
    ``movielens`` (an ml-100k or ml-1m directory).

    Args:
        spec: ``KIND:PATH``.
        batch_size: samples per batch.
        buckets: rows of each Criteo categorical table (ids modulo it).
        eval_fraction: the share held out by time where there is no last day to hold out.
        progress: progress bars on long reads.

    Raises:
        ValueError: an unknown kind, or a file that is not in the format.
        FileNotFoundError: PATH does not exist.
    """
    kind, sep, path = spec.partition(":")
    if not sep or not path or kind not in KINDS:
        raise ValueError(f"data {spec!r}: expected KIND:PATH with KIND one of {', '.join(KINDS)}")
    if kind == "criteo":
        return CriteoText(Path(path), batch_size, buckets, eval_fraction, progress)
    if kind == "criteo-npy":
        return CriteoNpy(Path(path), batch_size, buckets, eval_fraction)
    return MovieLens(Path(path), batch_size, eval_fraction, progress)
