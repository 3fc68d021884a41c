"""Kernels: one module per op family, each Triton kernel with its torch twin beside it
(``ids.py`` and ``ids_ref.py``, ``pooling.py`` and ``pooling_ref.py``, ...).

Every public function here takes tensors on any device and dispatches through
`backend.use_triton`: CUDA tensors run Triton, CPU tensors the torch twins, unless
``EMBCACHE_BACKEND`` forces one. Nothing here imports the rest of embcache but its id hash
(`embcache.hashing`).
"""
