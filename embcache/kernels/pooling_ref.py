"""Torch twins of the pooling kernels (`kernels/pooling.py`): bags of cache rows pooled
(SUM, MEAN, MAX, per-sample weights) and their backward, one gradient row per unique id.

Each function computes exactly what its Triton kernel computes, with vectorised torch ops: the
specification, and the CPU path.
"""

from __future__ import annotations

import torch

# Pooling modes, the values of `embcache.kernels.pooling.PoolingMode`.
POOL_SUM = 0
POOL_MEAN = 1
POOL_MAX = 2


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
    """Pool bags of cache rows into columns of ``out``; the twin of `pooling.pool_forward`.

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
