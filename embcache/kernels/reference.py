"""Torch twins of every Triton kernel: the specification, and the CPU path.

Each function here computes exactly what its Triton kernel computes, with vectorised torch ops
(no Python loop over ids, no per-element ``.item()``), so the library is fast and testable on a
machine without a GPU. The op modules (`ids.py`, `pooling.py`, `optim.py`, `cache_index.py`)
dispatch to these for CPU tensors; their tests compare both against float64 references.

Sections, one per op family, each owned by its op module.
"""

from __future__ import annotations

import torch

from embcache.hashing import LOW63, mix64

# ----------------------------------------------------------------------------------------------
# ids: validate, fuse, unfuse, dedup (used by kernels/ids.py)
# ----------------------------------------------------------------------------------------------

# Per-value verdict of `fuse_ids_ref`, in the order the checks are made.
ID_OK = 0
ID_NEGATIVE = 1
ID_OUT_OF_RANGE = 2  # >= num_embeddings of a bounded table
ID_OVERFLOWS_K = 3  # >= 2**fusion_k


def fuse_ids_ref(
    values: torch.Tensor,
    value_features: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fuse each id with its table index and judge it, without raising.

    Args:
        values: int32 or int64 ``[nnz]`` ids.
        value_features: int64 ``[nnz]`` feature of each value, in ``[0, F)``.
        table_idx: int64 ``[F]`` table index of each feature, ``0 <= t < 2**(63 - fusion_k)``.
        num_embeddings: int64 ``[F]`` rows of each feature's table, -1 when unbounded.
        fusion_k: bits kept for the id, in ``[0, 63]``.

    Returns:
        ``(fused, verdict)``: int64 ``[nnz]`` ``values | (table_idx << fusion_k)``, and int8
        ``[nnz]`` ``ID_OK`` or the first failed check (``ID_NEGATIVE``, ``ID_OUT_OF_RANGE``,
        ``ID_OVERFLOWS_K``). ``fused`` is meaningless where the verdict is not ``ID_OK``.
    """
    ids = values.to(torch.int64)
    table = table_idx.index_select(0, value_features)
    fused = ids | (table << fusion_k)
    # Good path: one bound per feature, min(num_embeddings, 2**fusion_k), and one mask.
    fits = (1 << fusion_k) if fusion_k < 63 else torch.iinfo(torch.int64).max
    bound = torch.where(num_embeddings >= 0, num_embeddings.clamp(max=fits), fits)
    bad = (ids < 0) | (ids >= bound.index_select(0, value_features))
    if not bool(bad.any()):
        return fused, torch.zeros_like(ids, dtype=torch.int8)
    limit = num_embeddings.index_select(0, value_features)
    verdict = torch.where(
        ids < 0,
        ID_NEGATIVE,
        torch.where(
            (limit >= 0) & (ids >= limit),
            ID_OUT_OF_RANGE,
            torch.where((ids >> fusion_k) != 0, ID_OVERFLOWS_K, ID_OK),
        ),
    ).to(torch.int8)
    return fused, verdict


def unfuse_ids_ref(fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fused ids into ``(table_idx, ids)``, both int64 ``[n]``; inverse of `fuse_ids_ref`."""
    fused = fused.to(torch.int64)
    return fused >> fusion_k, fused & ((1 << fusion_k) - 1)


def dedup_ref(
    ids: torch.Tensor, with_counts: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Unique ids, sorted ascending, with the inverse index and counts.

    Args:
        ids: int64 ``[n]``.
        with_counts: also count occurrences; else counts is None.

    Returns:
        ``(unique_ids, inverse, counts)``: int64 ``[U]``, int64 ``[n]`` with
        ``unique_ids[inverse] == ids``, and int64 ``[U]`` occurrences of each unique id.
    """
    if not with_counts:
        unique_ids, inverse = torch.unique(ids.to(torch.int64), sorted=True, return_inverse=True)
        return unique_ids, inverse.reshape(-1), None
    unique_ids, inverse, counts = torch.unique(
        ids.to(torch.int64), sorted=True, return_inverse=True, return_counts=True
    )
    return unique_ids, inverse.reshape(-1), counts


def dedup_grouped_ref(
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dedup_ref` that also returns the positions grouped by unique id.

    Args:
        ids: int64 ``[n]``.

    Returns:
        ``(unique_ids, inverse, order, segments)``: unique ids ascending ``[U]``, the inverse
        ``[n]``, ``order`` ``[n]``: positions sorted by id (stable: ascending within an id), and
        ``segments`` ``[U + 1]``: unique id u owns ``order[segments[u] : segments[u + 1]]``.
    """
    ids = ids.to(torch.int64)
    n = ids.numel()
    sorted_ids, order = torch.sort(ids, stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=ids.device)
    if n > 1:
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=starts[1:])
    unique_ids = sorted_ids[starts]
    inverse = torch.empty_like(order)
    inverse[order] = torch.cumsum(starts, 0) - 1
    segments = torch.nonzero(starts).squeeze(1)
    segments = torch.cat([segments, segments.new_full((1,), n)])
    return unique_ids, inverse, order, segments


# ----------------------------------------------------------------------------------------------
# pooling: forward and backward over cache slots (used by kernels/pooling.py)
# ----------------------------------------------------------------------------------------------

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


def _pool_column_block(t: torch.Tensor, col_offsets: torch.Tensor, dim: int) -> torch.Tensor | None:
    """``t[:, c0 : c0 + F*dim]`` viewed as ``[B, F, dim]`` when feature i's columns start at
    ``c0 + i*dim`` (the usual layout), else None. A view: writing it writes ``t``."""
    num_features = col_offsets.numel()
    if num_features == 0 or t.stride(1) != 1:
        return None
    c0 = int(col_offsets[0])
    expected = c0 + dim * torch.arange(num_features, device=col_offsets.device)
    if c0 + num_features * dim > t.shape[1] or not torch.equal(col_offsets, expected):
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
) -> torch.Tensor | None:
    """Pool bags of cache rows into columns of ``out``; the twin of `pooling.pool_forward`.

    Bag ``q = i * batch_size + b`` holds values ``offsets[q] <= j < offsets[q + 1]``; value j
    reads ``x_j = rows[slots[inverse[j]], :dim]`` with weight ``w_j`` (1 without weights). The
    bag's result goes to ``out[b, col_offsets[i] : col_offsets[i] + dim]``: SUM ``Σ w_j x_j``,
    MEAN ``Σ w_j x_j / len``, MAX the elementwise ``max w_j x_j``; an empty bag gives zeros.

    Args:
        rows: float32 ``[R, W]``, ``W >= dim``, may be a strided view.
        dim: columns pooled.
        slots: int64 ``[U]`` row of each unique id.
        inverse: int64 ``[nnz]`` unique index of each value.
        offsets: int64 ``[F * B + 1]`` CSR bag offsets, bags feature-major.
        per_sample_weights: float32 ``[nnz]`` or None.
        mode: ``POOL_SUM``, ``POOL_MEAN`` or ``POOL_MAX``.
        out: float32 ``[B, C]``, written in place.
        batch_size: B.
        col_offsets: int64 ``[F]`` first output column of each feature.

    Returns:
        MAX: int64 ``[F * B, dim]``, per bag and column the first value index j of the bag that
        holds the winning row (-1 for empty bags); when distinct rows tie exactly, which one
        wins is ``embedding_bag``'s choice (unweighted) or the first j (weighted). Otherwise None.
    """
    num_bags = offsets.numel() - 1
    nnz = inverse.numel()
    num_features = col_offsets.numel()
    lengths = offsets[1:] - offsets[:-1]  # [F*B]
    unique_rows = rows[:, :dim].index_select(0, slots)  # [U, dim]
    argmax = None
    if nnz == 0:
        pooled = rows.new_zeros(num_bags, dim)
        if mode == POOL_MAX:
            argmax = torch.full((num_bags, dim), -1, dtype=torch.int64, device=rows.device)
    elif mode == POOL_MAX and per_sample_weights is not None:
        bag_of_value = _pool_bag_of_values(offsets, nnz)
        vals = unique_rows.index_select(0, inverse) * per_sample_weights.unsqueeze(1)  # [nnz, D]
        index = bag_of_value.unsqueeze(1).expand(nnz, dim)
        pooled = rows.new_zeros(num_bags, dim).scatter_reduce_(
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
    block = _pool_column_block(out, col_offsets, dim)
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
        g_block = _pool_column_block(grad_out, col_offsets, dim)  # [B, F, D] view
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
# optimizer row updates (used by kernels/optim.py)
# ----------------------------------------------------------------------------------------------
#
# A row of the cache is ``[weights (dim) | optimizer state (S)]``. Each twin gathers the first
# ``dim + S`` columns of the touched rows, updates them with the same float32 operations, in the
# same order, as the torch (or FBGEMM) optimizer it mirrors, and scatters them back: rows not in
# ``slots`` are never read or written. ``slots`` must be distinct (checked by kernels/optim.py).


def _optim_gather(rows: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """Copy of the first ``width`` columns of ``rows[slots]``: ``[n, width]``."""
    return rows.narrow(1, 0, width).index_select(0, slots)


def _optim_scatter(rows: torch.Tensor, slots: torch.Tensor, block: torch.Tensor) -> None:
    """Write ``block`` (``[n, width]``) back into the first ``width`` columns of ``rows[slots]``."""
    rows.narrow(1, 0, block.shape[1]).index_copy_(0, slots, block)


def sgd_update_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    weight_decay: float = 0.0,
) -> None:
    """SGD on the touched rows, in place: ``w += -lr * (g + weight_decay * w)``.

    Args:
        rows: float32 ``[R, >= dim]``; columns ``[0, dim)`` are the weights (no state).
        dim: embedding dim.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        lr: learning rate.
        weight_decay: L2 coefficient added to the gradient (0 disables it).
    """
    if weight_decay == 0.0:
        # The same arithmetic torch.optim.SGD applies for a sparse gradient: w + (-lr) * g;
        # gather + scatter of distinct slots is faster on the CPU than index_add_.
        _optim_scatter(rows, slots, _optim_gather(rows, slots, dim).add_(grads, alpha=-lr))
        return
    block = _optim_gather(rows, slots, dim)  # [n, dim]
    block.add_(grads.add(block, alpha=weight_decay), alpha=-lr)
    _optim_scatter(rows, slots, block)


def adagrad_update_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    grads: torch.Tensor,
    clr: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """Adagrad on the touched rows, in place, as ``torch.optim.Adagrad``'s sparse branch.

    ``g' = g + weight_decay * w``; ``acc += g' * g'``; ``w += -clr * (g' / (sqrt(acc) + eps))``.

    Args:
        rows: float32 ``[R, >= 2 * dim]``: weights ``[0, dim)``, sum of squares ``[dim, 2 * dim)``.
        dim: embedding dim.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        clr: the step's learning rate, ``lr / (1 + (step - 1) * lr_decay)``.
        eps: added to ``sqrt(acc)``.
        weight_decay: L2 coefficient added to the gradient (0 disables it).
    """
    block = _optim_gather(rows, slots, 2 * dim)  # [n, 2 * dim]
    w, acc = block[:, :dim], block[:, dim:]
    g = grads if weight_decay == 0.0 else grads.add(w, alpha=weight_decay)
    acc.add_(g * g)
    w.add_(g / acc.sqrt().add_(eps), alpha=-clr)
    _optim_scatter(rows, slots, block)


def rowwise_adagrad_update_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """Row-wise Adagrad on the touched rows, in place, as FBGEMM's EXACT_ROWWISE_ADAGRAD.

    With L2 weight decay (FBGEMM's ``weight_decay_mode=L2``), ``g' = g + weight_decay * w``:
    ``acc += mean(g' * g')``; ``mult = lr / (sqrt(acc) + eps)``;
    ``w = (1 - mult * weight_decay) * w - mult * g``, which is ``w - mult * g'``.

    Args:
        rows: float32 ``[R, >= dim + 1]``: weights ``[0, dim)``, sum of mean squares at ``dim``.
        dim: embedding dim.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        lr: learning rate.
        eps: added to ``sqrt(acc)``.
        weight_decay: L2 coefficient (0 disables it).
    """
    block = _optim_gather(rows, slots, dim + 1)  # [n, dim + 1]
    w, acc = block[:, :dim], block[:, dim]
    g = grads if weight_decay == 0.0 else grads.add(w, alpha=weight_decay)
    acc.add_((g * g).sum(dim=1) / dim)
    mult = lr / (acc.sqrt() + eps)  # [n]
    if weight_decay != 0.0:
        w.mul_(1.0 - mult.unsqueeze(1) * weight_decay)
    w.sub_(grads * mult.unsqueeze(1))
    _optim_scatter(rows, slots, block)


def adam_update_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    grads: torch.Tensor,
    step_size: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """Adam on the touched rows, in place, as ``torch.optim.SparseAdam``.

    ``g' = g + weight_decay * w``; ``m += (g' - m) * (1 - beta1)``;
    ``v += (g' * g' - v) * (1 - beta2)``; ``w += -step_size * (m / (sqrt(v) + eps))``.

    Args:
        rows: float32 ``[R, >= 3 * dim]``: weights ``[0, dim)``, ``exp_avg`` ``[dim, 2 * dim)``,
            ``exp_avg_sq`` ``[2 * dim, 3 * dim)``.
        dim: embedding dim.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        step_size: ``lr * sqrt(1 - beta2**step) / (1 - beta1**step)``.
        beta1: decay of the first moment.
        beta2: decay of the second moment.
        eps: added to ``sqrt(v)``.
        weight_decay: L2 coefficient added to the gradient (0 disables it).
    """
    block = _optim_gather(rows, slots, 3 * dim)  # [n, 3 * dim]
    w, m, v = block[:, :dim], block[:, dim : 2 * dim], block[:, 2 * dim :]
    g = grads if weight_decay == 0.0 else grads.add(w, alpha=weight_decay)
    m.add_((g - m).mul_(1.0 - beta1))
    v.add_((g * g).sub_(v).mul_(1.0 - beta2))
    w.add_(m.div(v.sqrt().add_(eps)).mul_(-step_size))
    _optim_scatter(rows, slots, block)


def aggregate_grads_ref(
    ids: torch.Tensor, grads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradient rows of equal ids, each id's rows added in their order in ``ids``.

    On CPU ``index_add_`` adds in index order, so the sums are deterministic. (On CUDA tensors
    ``index_add_`` uses atomics; the Triton kernel, which sums tiles of each id's rows in a
    fixed order, is the deterministic CUDA path.)

    Args:
        ids: int64 ``[n]``, any values, duplicates allowed.
        grads: float32 ``[n, dim]``.

    Returns:
        ``unique_ids`` int64 ``[u]`` ascending, and ``summed`` float32 ``[u, dim]``.
    """
    unique_ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    summed = grads.new_zeros(unique_ids.numel(), grads.shape[1])
    summed.index_add_(0, inverse, grads)
    return unique_ids, summed


# ----------------------------------------------------------------------------------------------
# cache index: set hashing, lookup, victim choice (used by kernels/cache_index.py)
# ----------------------------------------------------------------------------------------------


def set_index_ref(ids: torch.Tensor, num_sets: int) -> torch.Tensor:
    """Set of each key: ``(mix64(id) & (2**63 - 1)) % num_sets``.

    Args:
        ids: int64 ``[n]`` fused ids (any value, negative ones included).
        num_sets: number of sets, >= 1.

    Returns:
        int64 ``[n]`` in ``[0, num_sets)``.
    """
    return (mix64(ids) & LOW63) % num_sets


def cache_lookup_ref(keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
    """Way holding each id in its set, or -1.

    Args:
        keys: int64 ``[S, W]``, the id held by each way, -1 for an empty way. An id appears in at
            most one way of its set.
        ids: int64 ``[n]``, ids to look up (never -1).
        sets: int64 ``[n]``, ``set_index(ids, S)``.

    Returns:
        int64 ``[n]``: the way in ``[0, W)`` holding ``ids[i]`` in set ``sets[i]``, else -1.
    """
    match = keys.index_select(0, sets) == ids.unsqueeze(1)  # [n, W]
    way = match.to(torch.int8).argmax(dim=1)
    return torch.where(match.any(dim=1), way, torch.full_like(way, -1))


def assign_ways_ref(
    scores: torch.Tensor, blocked: torch.Tensor, miss_sets: torch.Tensor
) -> torch.Tensor:
    """Give each miss a distinct way of its set: the k-th miss of a set gets its k-th best victim.

    Ways of a set are ordered by ``(blocked, score, way)`` ascending: unblocked ways with the
    lowest score first (callers give empty ways the lowest score), ties broken by way index. The
    k-th miss of a set (k counted in the order of ``miss_sets``) takes the k-th way of that order
    when k is below the set's number of unblocked ways, else it overflows (-1).

    Args:
        scores: int64 ``[S, W]`` eviction scores (LRU: last-use tick; LFU: frequency; empty: -1),
            below ``2**57`` (the twin orders ways by ``score * W + way``).
        blocked: bool ``[S, W]``, ways that must not be taken (locked, or hit by this batch).
        miss_sets: int64 ``[m]``, the set of each miss, sorted ascending.

    Returns:
        int64 ``[m]``: the way in ``[0, W)`` assigned to each miss, or -1 for an overflow.
    """
    m = miss_sets.numel()
    if m == 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    W = scores.shape[1]
    touched, counts = torch.unique_consecutive(miss_sets, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    owner = torch.repeat_interleave(torch.arange(touched.numel(), device=scores.device), counts)
    rank = torch.arange(m, device=scores.device) - starts[owner]
    s_blocked = blocked.index_select(0, touched)  # [T, W]
    # Distinct keys (score, then way) make the order total, so a partial sort of the first k
    # ways per set (k = most misses in one set, usually 1 or 2) equals a stable full sort.
    o_w = torch.arange(W, dtype=torch.int64, device=scores.device)
    key = torch.where(
        s_blocked,
        torch.iinfo(torch.int64).max,
        scores.index_select(0, touched) * W + o_w,
    )  # [T, W]
    k = min(int(counts.max()), W)
    order = torch.topk(key, k, dim=1, largest=False, sorted=True).indices  # [T, k]
    n_free = (~s_blocked).sum(dim=1)  # [T]
    way = order[owner, rank.clamp(max=k - 1)]
    return torch.where(rank < n_free[owner], way, torch.full_like(way, -1))
