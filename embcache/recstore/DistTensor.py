# ruff: noqa: N999 (RecStore's module name, kept so that only the import prefix changes)
"""RecStore's ``recstore/DistTensor.py``: `DistTensor` under its module path."""

from embcache.recstore.dist_tensor import DistTensor

__all__ = ["DistTensor"]
