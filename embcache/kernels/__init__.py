"""Kernels: one module per op family, each Triton kernel with a torch twin in `reference.py`.

Every public function here takes tensors on any device and dispatches through
`backend.use_triton`: CUDA tensors run Triton, CPU tensors the torch twins, unless
``EMBCACHE_BACKEND`` forces one. Nothing in this package imports the rest of embcache.
"""
