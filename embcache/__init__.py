"""embcache: a GPU-resident embedding cache for training recommendation models.

Tables far larger than the device live in a backing tier (host memory by default, Redis when
shared or persistent); the rows a batch needs sit in a fixed-size cache on the device, where
kernels dedup ids, pool bags and apply the optimizer in place. Dirty rows are written back on
eviction or flush.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

from embcache.ops.update.rules import RULES

__version__ = "0.1.0"

# Where each public name lives. They are imported on first use (PEP 562), so that `import
# embcache` and the `embcache` command's parsing and --help do not import torch and triton
# (seconds, tens of seconds on a busy machine). Each optimizer rule's class comes from the
# rules' registry (`RuleSpec.sparse_class`, which imports neither), listed nowhere here.
_HOMES = {
    "CacheConfig": "embcache.cache",
    "CacheOverflowWarning": "embcache.cache",
    "CachePolicy": "embcache.cache",
    "HotCache": "embcache.cache",
    "load": "embcache.checkpoint",
    "save": "embcache.checkpoint",
    "Batch": "embcache.data",
    "SyntheticConfig": "embcache.data",
    "SyntheticCriteo": "embcache.data",
    "ShardedEmbeddingBagCollection": "embcache.distributed",
    "ShardedEmbeddingCollection": "embcache.distributed",
    "CollectionOptions": "embcache.engine.options",
    "JaggedBatch": "embcache.engine",
    "JaggedRows": "embcache.engine",
    "PooledEmbeddings": "embcache.engine",
    "TableConfig": "embcache.engine",
    "PoolingMode": "embcache.kernels.pooling",
    "HostKV": "embcache.kv",
    "Store": "embcache.kv",
    "TableSpec": "embcache.kv",
    "TierDataLossError": "embcache.kv",
    "TierError": "embcache.kv",
    "TierOwnershipError": "embcache.kv",
    "TierUnavailableError": "embcache.kv",
    "open_store": "embcache.kv",
    "DLRM": "embcache.models",
    "CachedEmbeddingBagCollection": "embcache.models",
    "CachedEmbeddingCollection": "embcache.models",
    "FusedPrefetchHandle": "embcache.models",
    "SequenceRecommender": "embcache.models",
    "SparseOptimizer": "embcache.optim",
    "SparseRowWiseAdagrad": "embcache.optim",
    "DistEmbedding": "embcache.recstore",
    "DistTensor": "embcache.recstore",
    "KVClient": "embcache.recstore",
    "KVOptimizer": "embcache.recstore",
    "RecStoreEmbeddingBagCollection": "embcache.recstore",
    "RecStoreEmbeddingCollection": "embcache.recstore",
    "get_kv_client": "embcache.recstore",
    "reset_kv_client": "embcache.recstore",
    "flush_on_signal": "embcache.signals",
    "PrefetchFallbackWarning": "embcache.train.pipeline",
    "TrainPipeline": "embcache.train.pipeline",
}
_HOMES.update({spec.sparse_class: "embcache.optim" for spec in RULES.values()})

__all__ = sorted(_HOMES, key=str.lower)


def __getattr__(name: str) -> Any:
    """A public name (imported from its home now), or a subpackage (``embcache.kv``)."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


class _DropMessage(logging.Filter):
    """Drops the log records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


# torch's own metaclass of torchrec's KeyedJaggedTensor calls the deprecated
# torch.fx.is_fx_tracing on every construction, which logs this once per process: a warning
# neither we nor the user can act on, printed on the first KJT a run builds.
logging.getLogger("torch.fx._symbolic_trace").addFilter(
    _DropMessage("is_fx_tracing will return true for both fx.symbolic_trace and torch.export")
)
