"""What a collection's step is built from below the modules: its input (`JaggedBatch`, or a
torchrec KJT), its outputs (`PooledEmbeddings`, `JaggedRows`), and its table configs
(`TableConfig`)."""

from embcache.engine.inputs import JaggedBatch, PooledEmbeddings
from embcache.engine.jagged import JaggedRows
from embcache.engine.tables import TableConfig

__all__ = ["JaggedBatch", "JaggedRows", "PooledEmbeddings", "TableConfig"]
