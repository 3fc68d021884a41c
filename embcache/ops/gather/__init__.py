"""The gather family: one cache row per value (sequence embeddings), unpooled, and its gradient
-> one row per unique id.

The forward reads rows straight from the cache slots: value j of a batch gets the row
``out[j] = rows[slots[inverse[j]], :dim]``, float32, float16 or bfloat16 rows stored as float32;
a negative slot (an id the cache has not admitted) reads as a row of zeros. Nothing is pooled:
``out`` is ``[nnz, dim]``, the values in batch order, for a sequence model to consume (a
KeyedJaggedTensor's values, one table per call).

The backward sums, per unique id u, the gradient rows of every value j with ``inverse[j] == u``
(an id that occurs k times in the batch collects k rows), in float32. It is deterministic:
value positions are stably sorted by unique id (or taken from `ids.dedup_grouped`'s grouping
when the caller has it), each id's segment is cut into fixed-size chunks summed by separate
programs (a hot id's side by side), and the chunk sums of an id of several are added in chunk
order, so the same inputs give the same bits on every run; no float atomics, and nothing of
table size is allocated.

`GatherOps` is the family's protocol; its implementations are `spec.SpecGather` (torch, the
specification) and `triton.TritonGather` (the Triton kernels), one of them bound per cache by
`embcache.ops.registry`. Nothing outside `embcache.ops` imports an implementation.
"""

from __future__ import annotations

from typing import Protocol

import torch


class GatherOps(Protocol):
    """One implementation of the gather family.

    Attributes:
        name: ``"spec"`` or ``"triton"``.
    """

    name: str

    def gather_rows(
        self,
        rows: torch.Tensor,
        dim: int,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One cache row per value: ``out[j] = rows[slots[inverse[j]], :dim]`` as float32.

        Example: a batch whose values hold ids ``[7, 3, 7]`` dedups to ``unique = [3, 7]``,
        ``inverse = [1, 0, 1]``; with ``slots = [12, -1]`` (id 3 in cache row 12, id 7 not
        admitted) the output is ``[0, rows[12, :dim], 0]``.

        Args:
            rows: ``[R, W]`` float32, float16 or bfloat16, ``W >= dim``, the cache rows (may be a
                strided view).
            dim: embedding dim of this table; columns ``[0, dim)`` of a row are read.
            slots: int64 or int32 ``[U]``, cache row of each unique id; a negative slot reads as a
                row of zeros.
            inverse: int64 or int32 ``[nnz]``, unique index of each value, in ``[0, U)`` (not
                checked: that would cost a device sync).
            out: float32 ``[nnz, dim]``, contiguous, on the rows' device: written in place when
                given; allocated otherwise.

        Returns:
            float32 ``[nnz, dim]``: ``out`` when given.
        """
        ...

    def gather_backward(
        self,
        grad_out: torch.Tensor,
        inverse: torch.Tensor,
        num_unique: int,
        grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Gradient of each unique row from the gradient of `gather_rows`'s output; deterministic.

        Args:
            grad_out: ``[nnz, dim]`` of any float dtype and any strides, the gradient of the loss
                w.r.t. ``out``; converted to float32.
            inverse: int64 or int32 ``[nnz]``, unique index of each value, in ``[0, num_unique)``
                (not checked: that would cost a device sync).
            num_unique: U.
            grouping: optional ``(order, segments)`` from `ids.dedup_grouped` over these values
                (``order`` int64 ``[nnz]``: positions sorted by id, ascending within an id;
                ``segments`` int64 ``[U + 1]``): the very grouping that both paths otherwise find
                by a stable sort of ``inverse``, which they then skip. Same result, bit for bit.

        Returns:
            float32 ``[U, dim]``: row u sums ``grad_out[j]`` over every j with ``inverse[j] == u``
            (zeros for an id with no value). No float atomics on either path: the same inputs
            give the same bits.
        """
        ...
