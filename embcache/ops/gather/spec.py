"""The gather family's specification in plain torch: one cache row per value (sequence
embeddings) and its backward, one gradient row per unique id.

Each twin (``*_ref``) computes exactly what its Triton kernel (`ops.gather.triton`) computes,
with vectorised torch ops; `SpecGather` is the family's implementation built on them
(`GatherOps`): the CPU path, the ``torch`` backend everywhere, and what the Triton kernels are
tested against. Its operations check their inputs, for every implementation.
"""

from __future__ import annotations

import torch

from embcache.ops.checks import as_index, check_int, require
from embcache.ops.gather import GatherOps

ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ----------------------------------------------------------------------------------------------
# the twins
# ----------------------------------------------------------------------------------------------

_EMBEDDING_BAG_SUM = 0  # torch.embedding_bag's mode number for a sum


def gather_rows_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    inverse: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[j] = rows[slots[inverse[j]], :dim]`` in float32; the twin of `GatherOps.gather_rows`.

    Args:
        rows: ``[R, W]`` float32, float16 or bfloat16, ``W >= dim``, may be a strided view.
        dim: columns gathered.
        slots: int64 ``[U]`` row of each unique id; a negative slot reads as a row of zeros.
        inverse: int64 ``[nnz]`` unique index of each value, in ``[0, U)``.
        out: float32 ``[nnz, dim]``, contiguous, written in place.

    Returns:
        ``out``.
    """
    if inverse.numel() == 0:
        return out
    if rows.shape[0] == 0:  # nothing admitted: every slot is negative, every row zeros
        return out.zero_()
    slot_of_value = slots.index_select(0, inverse)  # [nnz]
    # A negative slot reads some row through the clamp, and its output row is zeroed after.
    picked = slot_of_value.clamp(min=0)
    if rows.dtype == torch.float32:
        torch.index_select(rows[:, :dim], 0, picked, out=out)
    else:
        out.copy_(rows[:, :dim].index_select(0, picked))
    negative = slot_of_value < 0
    if out.device.type == "cpu":
        # Finding the few negative slots is free on the CPU, and zeroing only their rows saves
        # a second pass over the whole output (as long as the gather itself).
        return out.index_fill_(0, negative.nonzero().squeeze(1), 0.0)
    return out.masked_fill_(negative.unsqueeze(1), 0.0)  # no host read (a device sync)


def gather_backward_ref(
    grad_out: torch.Tensor,
    inverse: torch.Tensor,
    num_unique: int,
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``grad_unique[u] = Σ_{j: inverse[j] = u} grad_out[j]``; the twin of
    `GatherOps.gather_backward`.

    Args:
        grad_out: float32 ``[nnz, dim]``, any strides.
        inverse: int64 ``[nnz]`` unique index of each value, in ``[0, num_unique)``.
        num_unique: U.
        grouping: ``(order, segments)`` of `dedup_grouped_ref` for these values, or None:
            found then by a stable sort of ``inverse``, which gives that very grouping.

    Returns:
        float32 ``[U, dim]``; an id with no value gets zeros. The same inputs give the same
        bits, with or without ``grouping``.
    """
    nnz, dim = grad_out.shape
    device = grad_out.device
    if nnz == 0 or num_unique == 0:
        return torch.zeros(num_unique, dim, dtype=torch.float32, device=device)
    if grouping is not None:
        order, segments = grouping
    else:
        order = torch.sort(inverse, stable=True).indices
        # Segment ends from the counts: one pass over the values, cheaper on the CPU than a
        # binary search per id.
        counts = torch.bincount(inverse, minlength=num_unique)[:num_unique]
        segments = torch.nn.functional.pad(counts.cumsum(0), (1, 0))  # [U + 1]
    # Each id's rows summed by one embedding_bag over its segment of positions (a fused
    # gather-sum, one bag per id, each walked in ascending position order, on CUDA too: one
    # thread per bag and column): no float atomics, and on the CPU faster than a
    # scatter_add_/index_add_ over the values even with the sort.
    return torch.embedding_bag(
        grad_out, order, segments, False, _EMBEDDING_BAG_SUM, False, None, True
    )[0]


# ----------------------------------------------------------------------------------------------
# the implementation
# ----------------------------------------------------------------------------------------------


class SpecGather:
    """The gather family in torch (`GatherOps`): each operation checks its inputs, then runs
    its twin (``_gather_rows``, ``_gather_backward``, which `triton.TritonGather` replaces)."""

    name = "spec"

    def gather_rows(
        self,
        rows: torch.Tensor,
        dim: int,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor) or rows.dtype not in ROW_DTYPES or rows.dim() != 2:
            raise TypeError("rows must be a float32, float16 or bfloat16 [R, W] tensor")
        device = rows.device
        check_int("dim", dim, 1, rows.shape[1])
        slots = as_index("slots", slots, device)
        inverse = as_index("inverse", inverse, device)
        nnz = inverse.numel()
        if out is None:
            out = torch.empty(nnz, dim, dtype=torch.float32, device=device)
        else:
            if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 2:
                raise TypeError("out must be a float32 [nnz, dim] tensor")
            require(out.device == device, f"out is on {out.device}, rows on {device}")
            require(
                tuple(out.shape) == (nnz, dim),
                f"out has shape {tuple(out.shape)}, expected (nnz, dim) = ({nnz}, {dim})",
            )
            require(out.is_contiguous(), "out must be contiguous")
        return self._gather_rows(rows, dim, slots, inverse, out)

    def _gather_rows(
        self,
        rows: torch.Tensor,
        dim: int,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        return gather_rows_ref(rows, dim, slots, inverse, out)

    def gather_backward(
        self,
        grad_out: torch.Tensor,
        inverse: torch.Tensor,
        num_unique: int,
        grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if not isinstance(grad_out, torch.Tensor) or not grad_out.is_floating_point():
            raise TypeError("grad_out must be a floating-point [nnz, dim] tensor")
        if grad_out.dim() != 2:
            raise ValueError(f"grad_out must be 2-D [nnz, dim], got shape {tuple(grad_out.shape)}")
        device = grad_out.device
        check_int("num_unique", num_unique, 0)
        inverse = as_index("inverse", inverse, device)
        require(
            grad_out.shape[0] == inverse.numel(),
            f"grad_out has {grad_out.shape[0]} rows, expected one per value: "
            f"inverse.numel() = {inverse.numel()}",
        )
        if grouping is not None:
            if not isinstance(grouping, tuple) or len(grouping) != 2:
                raise TypeError("grouping must be a tuple (order, segments) or None")
            order = as_index("grouping order", grouping[0], device)
            segments = as_index("grouping segments", grouping[1], device)
            require(
                order.numel() == inverse.numel() and segments.numel() == num_unique + 1,
                f"grouping covers {order.numel()} values and {segments.numel() - 1} ids, expected "
                f"{inverse.numel()} and {num_unique}",
            )
            grouping = (order, segments)
        if grad_out.dtype != torch.float32:
            grad_out = grad_out.to(torch.float32)
        return self._gather_backward(grad_out, inverse, num_unique, grouping)

    def _gather_backward(
        self,
        grad_out: torch.Tensor,
        inverse: torch.Tensor,
        num_unique: int,
        grouping: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        return gather_backward_ref(grad_out, inverse, num_unique, grouping)


IMPLEMENTATION: GatherOps = SpecGather()  # checked against the protocol
