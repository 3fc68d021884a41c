"""The core operations, one folder per family (``ids``, ``plan``, ``rows``, ``pooling``,
``gather``, ``update``: the optimizer's row update, its rules in ``update/rules.py``):
`spec.py` (the torch specification), `triton.py` (the Triton kernels) and `native.py` (numba's
compiled CPU passes) where they exist, and the family's `Protocol` in its ``__init__``.
`registry` binds one implementation per family, once, for a cache or a collection; nothing
outside this package imports an implementation or asks which is present.
"""
