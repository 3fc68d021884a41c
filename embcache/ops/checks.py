"""Input checks shared by the ops' public functions: one wording for every kernel.

A bad argument raises before anything is allocated or launched: ``TypeError`` for the wrong
kind or dtype, ``ValueError`` for the wrong shape, device or value, each naming the argument.
"""

from __future__ import annotations

from typing import cast

import torch

INDEX_DTYPES = (torch.int64, torch.int32)


def require(cond: bool, message: str) -> None:
    """``ValueError(message)`` unless ``cond``."""
    if not cond:
        raise ValueError(message)


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    dtypes: torch.dtype | tuple[torch.dtype, ...],
    ndim: int | None = None,
    device: torch.device | None = None,
) -> None:
    """``t`` is a tensor of one of ``dtypes``, with ``ndim`` dimensions, on ``device``."""
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_names(dtypes)}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def as_index(name: str, t: object, device: torch.device | None = None) -> torch.Tensor:
    """A 1-D int64/int32 index tensor (on ``device``), as contiguous int64."""
    check_tensor(name, t, INDEX_DTYPES, 1, device)
    return cast(torch.Tensor, t).to(torch.int64).contiguous()  # a tensor: checked just above


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` is an int (not a bool) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={value} must be {bound if hi is None else 'in ' + bound}")
    return value
