"""Sparse optimizers over cached collections: state beside each row, fused in-place updates.

One class per optimizer rule (`embcache.ops.update.rules.RULES`, each spec's ``sparse_class``),
exported from `sparse.RULE_CLASSES`, so a new rule's class appears here with no list to edit.
The classes written by hand are imported by name too, for type checkers.
"""

from embcache.optim.sparse import RULE_CLASSES
from embcache.optim.sparse import SparseAdaGrad as SparseAdaGrad
from embcache.optim.sparse import SparseAdam as SparseAdam
from embcache.optim.sparse import SparseAdamW as SparseAdamW
from embcache.optim.sparse import SparseOptimizer as SparseOptimizer
from embcache.optim.sparse import SparseRowWiseAdaGrad as SparseRowWiseAdaGrad
from embcache.optim.sparse import SparseRowWiseAdagrad as SparseRowWiseAdagrad
from embcache.optim.sparse import SparseSGD as SparseSGD

globals().update(RULE_CLASSES)

__all__ = sorted({"SparseOptimizer", "SparseRowWiseAdagrad", *RULE_CLASSES})
