"""Training: the prefetching `TrainPipeline` and the DLRM training loop, evaluation and metrics."""

from embcache.train.pipeline import PrefetchFallbackWarning, TrainPipeline

__all__ = ["PrefetchFallbackWarning", "TrainPipeline"]
