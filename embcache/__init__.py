"""embcache: a GPU-resident embedding cache for training recommendation models."""

__version__ = "0.1.0"
