"""The input checks every op shares, now in `embcache.ops.checks` (kept here for the kernel
modules not yet moved under `embcache.ops`)."""

from __future__ import annotations

from embcache.ops.checks import INDEX_DTYPES, as_index, check_int, check_tensor, require

__all__ = ["INDEX_DTYPES", "as_index", "check_int", "check_tensor", "require"]
