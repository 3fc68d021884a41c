"""RecStore's ``recstore/optimizer.py``: its sparse optimizers under their module path.

Every sparse optimizer of `embcache.optim` (RecStore's ``SparseSGD`` and
``SparseRowWiseAdagrad`` spelling included), re-exported as that package lists them, so a rule
added to the registry is here without an edit. ``SparseSGD`` on a
`RecStoreEmbeddingBagCollection` (or `RecStoreEmbeddingCollection`) whose KV client has a
backend optimizer hands the gradients to it (RecStore's path); on `DistEmbedding` it is the
Python-side SGD.
"""

import embcache.optim as optim
from embcache.optim import *  # noqa: F403 (the same names as embcache.optim, by design)

__all__ = list(optim.__all__)
