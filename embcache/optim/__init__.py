"""Sparse optimizers over cached collections: state beside each row, fused in-place updates."""

from embcache.optim.sparse import (
    SparseAdaGrad,
    SparseAdam,
    SparseAdamW,
    SparseOptimizer,
    SparseRowWiseAdaGrad,
    SparseRowWiseAdagrad,
    SparseSGD,
)

__all__ = [
    "SparseAdaGrad",
    "SparseAdam",
    "SparseAdamW",
    "SparseOptimizer",
    "SparseRowWiseAdaGrad",
    "SparseRowWiseAdagrad",
    "SparseSGD",
]
