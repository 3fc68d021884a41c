"""Kernels: one module per op family not yet moved under `embcache.ops`, each Triton kernel with
its torch twin beside it (``pooling.py`` and ``pooling_ref.py``, ...).

Every public function here takes tensors on any device and dispatches through
`backend.use_triton`: CUDA tensors run Triton, CPU tensors the torch twins, unless
``EMBCACHE_BACKEND`` forces one. ``ids.py`` and ``cache_index.py`` keep the public functions of
the families moved to `embcache.ops` (ids, plan) at their old paths, each binding for its
tensor's device. Nothing here imports the rest of embcache but its id hash
(`embcache.hashing`) and `embcache.ops`.
"""
