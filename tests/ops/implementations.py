"""The implementations of an op family the registry lists, as test parameters."""

from __future__ import annotations

import pytest

import embcache.native as native
from embcache.ops.registry import implementations

NO_NUMBA = "numba cannot be imported here: the family has no compiled pass"


def family_params(family: str) -> list:
    """A parameter per implementation of ``family`` (`ops.registry.implementations`), by name;
    the compiled one skipped where numba cannot be imported."""
    return [
        pytest.param(
            name,
            id=name,
            marks=[pytest.mark.skip(reason=NO_NUMBA)]
            if name == "native" and not native.importable()
            else [],
        )
        for name in implementations(family)
    ]
