"""Kernels: the public functions of the op families moved to `embcache.ops` at their old paths
(``ids.py``, ``cache_index.py``, ``pooling.py``, ``gather.py``, ``optim.py``, ``rounding.py``),
each binding for its tensor's device (`embcache.ops.registry.ops_for`), and the optimizer rules
at their old path (``optim_rules.py``, re-exporting `embcache.ops.update.rules`).
``backend.py`` keeps `use_triton`, the per-call choice for the code that still asks.
Nothing here imports the rest of embcache but the backend and `embcache.ops`.
"""
