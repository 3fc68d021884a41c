"""The pooling family's specification in plain torch: bags of cache rows pooled (SUM, MEAN, MAX,
per-sample weights) and their backward, one gradient row per unique id.

Each twin (``*_ref``) computes exactly what its Triton kernel (`ops.pooling.triton`) computes,
with vectorised torch ops; `SpecPooling` is the family's implementation built on them
(`PoolingOps`): the CPU path, the ``torch`` backend everywhere, and what the Triton kernels are
tested against. Its operations check their inputs (`check_bags`), for every implementation.
"""

from __future__ import annotations

import torch

from embcache.ops.checks import as_index, require
from embcache.ops.pooling import PoolingMode, PoolingOps

ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ----------------------------------------------------------------------------------------------
# the twins
# ----------------------------------------------------------------------------------------------

# Pooling modes, the values of `PoolingMode` (what `torch.embedding_bag` takes).
POOL_SUM = int(PoolingMode.SUM)
POOL_MEAN = int(PoolingMode.MEAN)
POOL_MAX = int(PoolingMode.MAX)


def _pool_bag_of_values(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """int64 ``[nnz]``: the bag of each value, from the CSR ``offsets`` ``[num_bags + 1]``."""
    num_bags = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    bags = torch.arange(num_bags, dtype=torch.int64, device=offsets.device)
    return torch.repeat_interleave(bags, lengths, output_size=nnz)


def _pool_columns(col_offsets: torch.Tensor, dim: int) -> torch.Tensor:
    """int64 ``[F * dim]``: output column of each (feature, column) pair, feature-major."""
    o_d = torch.arange(dim, dtype=torch.int64, device=col_offsets.device)
    return (col_offsets.to(torch.int64).unsqueeze(1) + o_d).reshape(-1)


def _pool_column_block(
    t: torch.Tensor, col_offsets: torch.Tensor, dim: int, col_start: int | None = None
) -> torch.Tensor | None:
    """``t[:, c0 : c0 + F*dim]`` viewed as ``[B, F, dim]`` when feature i's columns start at
    ``c0 + i*dim`` (the usual layout), else None. A view: writing it writes ``t``.
    ``col_start``: the caller knows the columns are so laid out from ``c0 = col_start`` (no
    host read of ``col_offsets``, which costs a device sync)."""
    num_features = col_offsets.numel()
    if num_features == 0 or t.stride(1) != 1:
        return None
    if col_start is not None:
        c0 = col_start
    else:
        c0 = int(col_offsets[0])
        expected = c0 + dim * torch.arange(num_features, device=col_offsets.device)
        if not torch.equal(col_offsets, expected):
            return None
    if c0 < 0 or c0 + num_features * dim > t.shape[1]:
        return None
    return t.narrow(1, c0, num_features * dim).unflatten(1, (num_features, dim))


def _pool_first_value_of(
    inverse: torch.Tensor,
    num_unique: int,
    bag_of_value: torch.Tensor,
    bags: torch.Tensor,
    uniques: torch.Tensor,
) -> torch.Tensor:
    """First value index j of bag ``bags[q]`` with ``inverse[j] == uniques[q]``, for every q.

    A pair that does not occur (an empty bag's query) gets some in-range index; mask it after.
    Shapes of ``bags`` and ``uniques`` are kept.
    """
    keys = bag_of_value * num_unique + inverse  # [nnz], unique per (bag, unique id)
    sorted_keys, order = torch.sort(keys, stable=True)
    pos = torch.searchsorted(sorted_keys, (bags * num_unique + uniques).reshape(-1))
    pos = pos.clamp_(max=keys.numel() - 1)
    return order.index_select(0, pos).reshape(bags.shape)


def _unique_rows(rows: torch.Tensor, dim: int, slots: torch.Tensor) -> torch.Tensor:
    """float32 ``[U, dim]``: the rows at ``slots``, zeros where a slot is -1."""
    # Ids not admitted (slot -1) read a zero row; no host read to find whether there are any.
    picked = rows[:, :dim].index_select(0, slots.clamp(min=0)).to(torch.float32)
    return picked.masked_fill_((slots < 0).unsqueeze(1), 0.0)


def pool_forward_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mode: int,
    out: torch.Tensor,
    batch_size: int,
    col_offsets: torch.Tensor,
    col_start: int | None = None,
) -> torch.Tensor | None:
    """Pool bags of cache rows into columns of ``out``; the twin of `PoolingOps.pool_forward`.

    Bag ``q = i * batch_size + b`` holds values ``offsets[q] <= j < offsets[q + 1]``; value j
    reads ``x_j = rows[slots[inverse[j]], :dim]`` in float32 (zeros where the slot is -1) with
    weight ``w_j`` (1 without weights). The
    bag's result goes to ``out[b, col_offsets[i] : col_offsets[i] + dim]``: SUM ``Σ w_j x_j``,
    MEAN ``Σ w_j x_j / len``, MAX the elementwise ``max w_j x_j``; an empty bag gives zeros.

    Args:
        rows: ``[R, W]`` float32, float16 or bfloat16, ``W >= dim``, may be a strided view.
        dim: columns pooled.
        slots: int64 ``[U]`` row of each unique id, -1 for a row of zeros.
        inverse: int64 ``[nnz]`` unique index of each value.
        offsets: int64 ``[F * B + 1]`` CSR bag offsets, bags feature-major.
        per_sample_weights: float32 ``[nnz]`` or None.
        mode: ``POOL_SUM``, ``POOL_MEAN`` or ``POOL_MAX``.
        out: float32 ``[B, C]``, written in place.
        batch_size: B.
        col_offsets: int64 ``[F]`` first output column of each feature.
        col_start: when given, ``col_offsets`` is ``col_start + dim * arange(F)`` (the caller
            knows it: nothing read on the host).

    Returns:
        MAX: int64 ``[F * B, dim]``, per bag and column the first value index j of the bag that
        holds the winning row (-1 for empty bags); when distinct rows tie exactly, which one
        wins is ``embedding_bag``'s choice (unweighted) or the first j (weighted). Otherwise None.
    """
    num_bags = offsets.numel() - 1
    nnz = inverse.numel()
    num_features = col_offsets.numel()
    lengths = offsets[1:] - offsets[:-1]  # [F*B]
    unique_rows = _unique_rows(rows, dim, slots)  # [U, dim] float32
    argmax = None
    if nnz == 0:
        pooled = unique_rows.new_zeros(num_bags, dim)
        if mode == POOL_MAX:
            argmax = torch.full((num_bags, dim), -1, dtype=torch.int64, device=rows.device)
    elif mode == POOL_MAX and per_sample_weights is not None:
        bag_of_value = _pool_bag_of_values(offsets, nnz)
        vals = unique_rows.index_select(0, inverse) * per_sample_weights.unsqueeze(1)  # [nnz, D]
        index = bag_of_value.unsqueeze(1).expand(nnz, dim)
        pooled = unique_rows.new_zeros(num_bags, dim).scatter_reduce_(
            0, index, vals, "amax", include_self=False
        )
        o_j = torch.arange(nnz, dtype=torch.int64, device=rows.device).unsqueeze(1)
        candidate = torch.where(vals == pooled.index_select(0, bag_of_value), o_j, nnz)
        argmax = torch.full((num_bags, dim), nnz, dtype=torch.int64, device=rows.device)
        argmax.scatter_reduce_(0, index, candidate, "amin")
        argmax.masked_fill_(argmax == nnz, -1)
    elif mode == POOL_MEAN and per_sample_weights is not None:
        # embedding_bag has no weighted MEAN: weighted SUM, then divide by the bag length.
        pooled = torch.embedding_bag(
            unique_rows, inverse, offsets, False, POOL_SUM, False, per_sample_weights, True
        )[0]
        pooled = pooled / lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)
    else:
        pooled, _, _, max_unique = torch.embedding_bag(
            unique_rows, inverse, offsets, False, int(mode), False, per_sample_weights, True
        )
        if mode == POOL_MAX:
            # embedding_bag names the unique row that won; name the first value that holds it.
            bags = torch.arange(num_bags, dtype=torch.int64, device=rows.device)
            bags = bags.unsqueeze(1).expand(num_bags, dim)
            empty = (lengths == 0).unsqueeze(1)
            max_unique = max_unique.masked_fill(empty, 0)
            bag_of_value = _pool_bag_of_values(offsets, nnz)
            argmax = _pool_first_value_of(inverse, slots.numel(), bag_of_value, bags, max_unique)
            argmax = argmax.masked_fill(empty, -1)
    # [F*B, D] -> [B, F*D], feature-major columns, matching _pool_columns.
    by_sample = pooled.reshape(num_features, batch_size, dim).transpose(0, 1)  # [B, F, D]
    block = _pool_column_block(out, col_offsets, dim, col_start)
    if block is not None:
        block.copy_(by_sample)
    else:
        out.index_copy_(1, _pool_columns(col_offsets, dim), by_sample.reshape(batch_size, -1))
    return argmax


def pool_backward_ref(
    grad_out: torch.Tensor,
    dim: int,
    inverse: torch.Tensor,
    num_unique: int,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mode: int,
    batch_size: int,
    col_offsets: torch.Tensor,
    argmax: torch.Tensor | None,
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
    col_start: int | None = None,
) -> torch.Tensor:
    """Gradient of each unique row from the gradient of the pooled output.

    Value j of bag q contributes ``w_j * g_q`` (SUM), ``w_j * g_q / len_q`` (MEAN), or, MAX,
    ``w_j * g_q[c]`` in the columns c where ``argmax[q, c] == j``; contributions are summed per
    unique id. ``g_q`` is ``grad_out[b, col_offsets[i] : col_offsets[i] + dim]`` for
    ``q = i * batch_size + b``.

    Args:
        grad_out: float32 ``[B, C]``.
        dim: columns pooled.
        inverse: int64 ``[nnz]`` unique index of each value.
        num_unique: U.
        offsets: int64 ``[F * B + 1]``.
        per_sample_weights: float32 ``[nnz]`` or None.
        mode: ``POOL_SUM``, ``POOL_MEAN`` or ``POOL_MAX``.
        batch_size: B.
        col_offsets: int64 ``[F]``.
        col_start: as in `pool_forward_ref`.
        argmax: int64 ``[F * B, dim]`` from the forward (MAX only), else None.
        grouping: ``(order, segments)`` of `dedup_grouped_ref` for these values, or None.
            With it, SUM and MEAN sum each unique id's gradient rows with one
            ``embedding_bag`` over the grouped values (a fused gather-sum, in the same order
            as the scatter) instead of gathering them and scattering the sums.

    Returns:
        float32 ``[U, dim]``.
    """
    num_bags = offsets.numel() - 1
    nnz = inverse.numel()
    num_features = col_offsets.numel()
    grad_unique = torch.zeros(num_unique, dim, dtype=torch.float32, device=grad_out.device)
    if nnz == 0 or num_unique == 0:
        return grad_unique
    g_block = None
    if mode != POOL_MAX and grad_out.dtype == torch.float32:
        g_block = _pool_column_block(grad_out, col_offsets, dim, col_start)  # [B, F, D] view
    if g_block is None:
        g = grad_out.index_select(1, _pool_columns(col_offsets, dim)).to(torch.float32)
        g = g.reshape(batch_size, num_features, dim).transpose(0, 1).reshape(num_bags, dim)
    if mode == POOL_MAX:
        if argmax is None:
            raise ValueError("MAX pooling backward needs the argmax returned by the forward")
        won = argmax >= 0  # [F*B, D]
        j = argmax[won]  # [k]
        contrib = g[won]
        if per_sample_weights is not None:
            contrib = contrib * per_sample_weights.index_select(0, j)
        o_d = torch.arange(dim, dtype=torch.int64, device=g.device).expand(num_bags, dim)[won]
        flat = inverse.index_select(0, j) * dim + o_d
        grad_unique.view(-1).index_add_(0, flat, contrib)
        return grad_unique
    bag_of_value = _pool_bag_of_values(offsets, nnz)
    scale = None
    if mode == POOL_MEAN:
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(torch.float32)
        scale = lengths.reciprocal().index_select(0, bag_of_value)
    if per_sample_weights is not None:
        w = per_sample_weights.to(torch.float32)
        scale = w if scale is None else scale * w
    if g_block is not None and grouping is not None:
        # Bag q = i*B + b reads g_block[b, i]; each unique id sums its grouped values' rows.
        order, segments = grouping
        row = (bag_of_value % batch_size) * num_features + bag_of_value // batch_size
        weights = None if scale is None else scale.index_select(0, order)
        return torch.embedding_bag(
            g_block.reshape(batch_size * num_features, dim),
            row.index_select(0, order),
            segments,
            False,
            POOL_SUM,
            False,
            weights,
            True,
        )[0]
    if g_block is not None:
        # Bag q = i*B + b reads g_block[b, i]: gather straight from grad_out, no transpose.
        row = (bag_of_value % batch_size) * num_features + bag_of_value // batch_size
        contrib = g_block.reshape(batch_size * num_features, dim).index_select(0, row)
    else:
        contrib = g.index_select(0, bag_of_value)  # [nnz, D]
    if scale is not None:
        contrib = contrib * scale.unsqueeze(1)
    # scatter_add_ is serial on the CPU (deterministic) and faster there than index_add_.
    grad_unique.scatter_add_(0, inverse.unsqueeze(1).expand(nnz, dim), contrib)
    return grad_unique


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------


def check_bags(
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_size: int,
    col_offsets: torch.Tensor,
) -> None:
    num_features = col_offsets.numel()
    require(batch_size >= 0, f"batch_size={batch_size} must be >= 0")
    require(
        offsets.numel() == num_features * batch_size + 1,
        f"offsets has {offsets.numel()} entries, expected F * B + 1 = "
        f"{num_features} * {batch_size} + 1 for F = col_offsets.numel()",
    )
    if per_sample_weights is not None:
        if per_sample_weights.dtype != torch.float32:
            raise TypeError(f"per_sample_weights must be float32, got {per_sample_weights.dtype}")
        require(
            per_sample_weights.shape == inverse.shape,
            f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
            f"expected {tuple(inverse.shape)} like inverse",
        )
        require(
            per_sample_weights.device == inverse.device,
            f"per_sample_weights is on {per_sample_weights.device}, expected {inverse.device}",
        )


# ----------------------------------------------------------------------------------------------
# the implementation
# ----------------------------------------------------------------------------------------------


class SpecPooling:
    """The pooling family in torch (`PoolingOps`): each operation checks its inputs, then runs
    its twin (``_pool_forward``, ``_pool_backward``, which `triton.TritonPooling` replaces)."""

    name = "spec"

    def pool_forward(
        self,
        rows: torch.Tensor,
        dim: int,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mode: PoolingMode,
        out: torch.Tensor,
        batch_size: int,
        col_offsets: torch.Tensor,
        col_start: int | None = None,
    ) -> torch.Tensor | None:
        mode = PoolingMode(mode)
        if not isinstance(rows, torch.Tensor) or rows.dtype not in ROW_DTYPES or rows.dim() != 2:
            raise TypeError("rows must be a float32, float16 or bfloat16 [R, W] tensor")
        device = rows.device
        require(1 <= dim <= rows.shape[1], f"dim={dim} must be in [1, {rows.shape[1]}] (row width)")
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 2:
            raise TypeError("out must be a float32 [B, C] tensor")
        require(out.device == device, f"out is on {out.device}, rows on {device}")
        require(out.shape[0] == batch_size, f"out has {out.shape[0]} rows, batch_size={batch_size}")
        slots = as_index("slots", slots, device)
        inverse = as_index("inverse", inverse, device)
        offsets = as_index("offsets", offsets, device)
        col_offsets = as_index("col_offsets", col_offsets, device)
        check_bags(inverse, offsets, per_sample_weights, batch_size, col_offsets)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.contiguous()
        args = (rows, dim, slots, inverse, offsets, per_sample_weights, mode, out, batch_size)
        return self._pool_forward(*args, col_offsets, col_start)

    def _pool_forward(
        self,
        rows: torch.Tensor,
        dim: int,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mode: PoolingMode,
        out: torch.Tensor,
        batch_size: int,
        col_offsets: torch.Tensor,
        col_start: int | None,
    ) -> torch.Tensor | None:
        return pool_forward_ref(
            rows, dim, slots, inverse, offsets, per_sample_weights, mode, out, batch_size,
            col_offsets, col_start,
        )  # fmt: skip

    def pool_backward(
        self,
        grad_out: torch.Tensor,
        dim: int,
        inverse: torch.Tensor,
        num_unique: int,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mode: PoolingMode,
        batch_size: int,
        col_offsets: torch.Tensor,
        argmax: torch.Tensor | None,
        grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
        col_start: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        mode = PoolingMode(mode)
        if not isinstance(grad_out, torch.Tensor) or grad_out.dim() != 2:
            raise TypeError("grad_out must be a float32 [B, C] tensor")
        if grad_out.dtype != torch.float32:
            grad_out = grad_out.to(torch.float32)
        device = grad_out.device
        require(dim >= 1, f"dim={dim} must be >= 1")
        require(num_unique >= 0, f"num_unique={num_unique} must be >= 0")
        require(
            grad_out.shape[0] == batch_size,
            f"grad_out has {grad_out.shape[0]} rows, batch_size={batch_size}",
        )
        inverse = as_index("inverse", inverse, device)
        offsets = as_index("offsets", offsets, device)
        col_offsets = as_index("col_offsets", col_offsets, device)
        check_bags(inverse, offsets, per_sample_weights, batch_size, col_offsets)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.contiguous()
        if mode == PoolingMode.MAX:
            num_bags = offsets.numel() - 1
            if argmax is None or tuple(argmax.shape) != (num_bags, dim):
                raise ValueError(
                    f"MAX backward needs the forward's argmax of shape ({num_bags}, {dim})"
                )
            argmax = argmax.contiguous()
        else:
            argmax = None
        args = (grad_out, dim, inverse, num_unique, offsets, per_sample_weights, mode, batch_size)
        if grouping is not None:
            order, segments = grouping
            require(
                order.numel() == inverse.numel() and segments.numel() == num_unique + 1,
                f"grouping covers {order.numel()} values and {segments.numel() - 1} ids, expected "
                f"{inverse.numel()} and {num_unique}",
            )
        if out is not None:
            require(
                out.dtype == torch.float32
                and tuple(out.shape) == (num_unique, dim)
                and out.is_contiguous()
                and out.device == device,
                f"out must be a contiguous float32 [{num_unique}, {dim}] tensor on {device}",
            )
        return self._pool_backward(*args, col_offsets, argmax, grouping, col_start, out)

    def _pool_backward(
        self,
        grad_out: torch.Tensor,
        dim: int,
        inverse: torch.Tensor,
        num_unique: int,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mode: PoolingMode,
        batch_size: int,
        col_offsets: torch.Tensor,
        argmax: torch.Tensor | None,
        grouping: tuple[torch.Tensor, torch.Tensor] | None,
        col_start: int | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        grads = pool_backward_ref(
            grad_out, dim, inverse, num_unique, offsets, per_sample_weights, mode, batch_size,
            col_offsets, argmax, grouping, col_start,
        )  # fmt: skip
        return grads if out is None else out.copy_(grads)


IMPLEMENTATION: PoolingOps = SpecPooling()  # checked against the protocol
