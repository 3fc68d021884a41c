"""Training data: the `Batch` record and the synthetic Criteo-like stream."""

from embcache.data.batch import Batch
from embcache.data.synthetic import SyntheticConfig, SyntheticCriteo

__all__ = ["Batch", "SyntheticConfig", "SyntheticCriteo"]
