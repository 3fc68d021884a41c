"""The id hash every layer agrees on: splitmix64's finaliser (``mix64``) on int64 tensors.

The cache's set index (`ops.plan`), the tiers' hash indexes and row initialisers
(`kv`) and the owner map of sharded tables (`distributed.exchange`) all hash ids with it, so it
lives here, below all of them. It wraps like uint64 arithmetic (torch has no uint64 ops), which
the Triton kernel of the set index reproduces bit for bit.
"""

from __future__ import annotations

import torch

# Odd 64-bit constant of the golden ratio, as a signed int64 (splitmix64's increment).
GOLDEN = -7046029254386353131
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
LOW63 = 0x7FFFFFFFFFFFFFFF  # mask to a non-negative int64


def shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64, wrapping like uint64 arithmetic. Shape kept."""
    z = x + GOLDEN
    z = (z ^ shr(z, 30)) * _MIX1
    z = (z ^ shr(z, 27)) * _MIX2
    return z ^ shr(z, 31)


def row_counters(ids: torch.Tensor, salt: int, dim: int) -> torch.Tensor:
    """The counter of each value of a hashed initialiser's rows, int64 ``[len(ids), dim]``:
    ``mix64(id ^ salt) + column``, hashed again by the caller (`kv.base.hashed_init`'s draws),
    on ``ids``' device."""
    cols = torch.arange(dim, dtype=torch.int64, device=ids.device)
    return mix64(ids.to(torch.int64) ^ salt).unsqueeze(1) + cols.unsqueeze(0)
