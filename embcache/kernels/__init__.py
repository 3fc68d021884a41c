"""Kernels: one module per op family not yet moved under `embcache.ops`, each Triton kernel with
its torch twin beside it (``optim.py`` and ``optim_ref.py``, ``rounding.py`` and
``rounding_ref.py``).

Every public function of those takes tensors on any device and dispatches through
`backend.use_triton`: CUDA tensors run Triton, CPU tensors the torch twins, unless
``EMBCACHE_BACKEND`` forces one. ``ids.py``, ``cache_index.py``, ``pooling.py`` and
``gather.py`` keep the public functions of the families moved to `embcache.ops` (ids, plan,
pooling, gather) at their old paths, each binding for its tensor's device. Nothing here
imports the rest of embcache but its id hash (`embcache.hashing`) and `embcache.ops`.
"""
