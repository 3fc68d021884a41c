"""One dedup for several caches: their ids sorted together, each cache's share written apart.

A collection keeps one cache per embedding dim. Deduplicating each cache's ids on its own
costs a sort and its kernels per cache, and first the host must know where each cache's values
end (a read of the batch's per-key counts). Here every value of the batch is deduplicated in
one sort, in the batch's own key order, its fused id tagged with its cache (its group) in the
bits above the fused ids: ``key = fused | (group << tag_shift)``. The sort then lays the groups
out one after another, each in fused-id order, and one `ids.sort_and_mark` counts what the
host needs (the runs below each group's first key and each table's) in the read that sizes the
outputs. After that read, `scatter_joint` writes each group's share where its cache expects it:

* its unique ids, ascending, the tag cleared: ``unique[ubase[g] : ubase[g] + U[g]]``;
* its runs' starts, local to its sorted values: ``starts[ubase[g] : ubase[g] + U[g] + 1]``;
* each value's unique id (local), at the value's position in the cache's own feature order:
  ``inverse[vbase[g] : vbase[g] + N[g]]``; and ``order`` (its sorted values' positions) and
  the per-sample ``weights`` the same way;
* its bags' offsets in its feature order: ``offsets[obase[g] : obase[g] + F[g] * B + 1]``.

Each share starts at a multiple of `ALIGN` elements (``ubase``, ``vbase``, ``obase``), so
that a kernel given a share sees the same pointer alignment every batch (Triton compiles a
variant per alignment). A value's position in its cache's feature order is its position in
the batch plus its key's ``shift`` (the host computes it from the per-key counts of the same
read).

`scatter_joint_ref` is the plain-torch specification the Triton kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ALIGN = 4  # elements: 32 bytes of int64, 16 of float32

_BLOCK_N = 1024


@dataclass
class JointPlan:
    """Where each group's share goes, from the host's one read (`plan`): per key (in the
    batch's order) the running end of its values and the shift from a value's position in the
    batch to its position in its group's feature order; per group ``G`` its first run
    (``u_lo``), first sorted value (``v_lo``), its number of unique ids and of values, and
    where its share of the unique-sized and value-sized outputs starts (``ubase``,
    ``vbase``, multiples of `ALIGN`)."""

    key_ends: list[int]
    shift: list[int]
    u_lo: list[int]
    v_lo: list[int]
    num_unique: list[int]
    num_values: list[int]
    ubase: list[int]
    vbase: list[int]
    # Bag offsets: each key's group and place in it, and where each group's offsets start
    # (``[F_g * B + 1]`` each, at multiples of `ALIGN`), for ``batch_size`` bags a key.
    key_group: list[int]
    key_place: list[int]
    batch_size: int
    obase: list[int]
    num_bags: list[int]

    @property
    def unique_size(self) -> int:
        return self.ubase[-1] + _aligned(self.num_unique[-1] + 1) if self.ubase else 0

    @property
    def value_size(self) -> int:
        return self.vbase[-1] + _aligned(self.num_values[-1]) if self.vbase else 0

    @property
    def offsets_size(self) -> int:
        return self.obase[-1] + _aligned(self.num_bags[-1] + 1) if self.obase else 0

    def meta(self) -> list[int]:
        """The plan as the kernel reads it: ``[key_ends, shift, key_group, key_place, u_lo,
        v_lo, U, N, ubase, vbase, obase]`` (int64)."""
        return [
            *self.key_ends,
            *self.shift,
            *self.key_group,
            *self.key_place,
            *self.u_lo,
            *self.v_lo,
            *self.num_unique,
            *self.num_values,
            *self.ubase,
            *self.vbase,
            *self.obase,
        ]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan(
    per_key: list[int],
    group_keys: list[list[int]],
    runs_below: list[int],
    num_runs: int,
    batch_size: int = 0,
) -> JointPlan:
    """The plan of a batch from its per-key counts (in the batch's key order), each group's
    keys in its feature order (the groups in tag order; every key in one group), the runs
    below each group's first key but the first's (``runs_below[g - 1]``), all runs, and the
    bags of each key (``batch_size``).

    Example: keys ``a b c`` with 2, 3, 1 values, groups ``[[2, 0], [1]]`` (group 0 takes
    ``c`` then ``a``): group 0's values are ``c``'s then ``a``'s, so ``a``'s first value
    (batch position 0) lands at 1 (shift 1) and ``c``'s (position 5) at 0 (shift -5)."""
    key_starts = [0]
    for n in per_key:
        key_starts.append(key_starts[-1] + n)
    shift = [0] * len(per_key)
    num_values = []
    for keys in group_keys:
        at = 0
        for k in keys:
            shift[k] = at - key_starts[k]
            at += per_key[k]
        num_values.append(at)
    u_lo = [0, *runs_below]
    num_unique = [hi - lo for lo, hi in zip(u_lo, [*runs_below, num_runs], strict=True)]
    v_lo, ubase, vbase = [], [], []
    v = u = w = 0
    for g in range(len(group_keys)):
        v_lo.append(v)
        ubase.append(u)
        vbase.append(w)
        v += num_values[g]
        u += _aligned(num_unique[g] + 1)
        w += _aligned(num_values[g])
    key_group, key_place = [0] * len(per_key), [0] * len(per_key)
    obase, num_bags = [], []
    o = 0
    for g, keys in enumerate(group_keys):
        for place, k in enumerate(keys):
            key_group[k], key_place[k] = g, place
        obase.append(o)
        num_bags.append(len(keys) * batch_size)
        o += _aligned(num_bags[-1] + 1)
    return JointPlan(key_starts[1:], shift, u_lo, v_lo, num_unique, num_values, ubase, vbase,
                     key_group, key_place, batch_size, obase, num_bags)  # fmt: skip


@triton.jit(do_not_specialize=["n", "num_bags", "batch_size", "search_steps"])  # per batch
def _joint_scatter_kernel(
    sorted_ptr,
    order_ptr,
    is_start_ptr,
    seen_ptr,
    meta_ptr,
    weights_ptr,
    ends_ptr,
    unique_ptr,
    inverse_ptr,
    starts_ptr,
    order_out_ptr,
    weights_out_ptr,
    offsets_ptr,
    n,
    num_bags,
    batch_size,
    num_keys,
    num_groups,
    search_steps,
    tag_shift,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Sorted position i (key ``k = sorted[i]``, batch position ``p = order[i]``, run
    ``s = seen[i] - 1``) of group ``g = k >> tag_shift``, whose batch key ``c`` is found by a
    binary search of ``key_ends`` (``search_steps`` halvings): its value's place in the
    group, ``d = p + shift[c]``, and its local run ``r = s - u_lo[g]``;
    ``inverse[vbase[g] + d] = r``, ``order[vbase[g] + i - v_lo[g]] = d``, and at a run's start
    ``unique[ubase[g] + r] = k`` (tag cleared), ``starts[ubase[g] + r] = i - v_lo[g]``.

    Bag t of the batch (key ``c = t // B``, bag ``j``; ``ends`` the lengths' inclusive running
    sums in the batch's order): ``offsets[obase[g] + place[c] * B + j + 1] = ends[t] +
    shift[c]``, its group's running count at the bag's end. Program 0 writes each group's first
    offset (0) and ends its starts: ``starts[ubase[g] + U[g]] = N[g]``."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    p_groups = meta_ptr + 4 * num_keys  # u_lo, v_lo, U, N, ubase, vbase, obase: [G] each
    b_key = tl.load(sorted_ptr + o_n, mask=m_n, other=0)
    b_pos = tl.load(order_ptr + o_n, mask=m_n, other=0)
    b_seg = tl.load(seen_ptr + o_n, mask=m_n, other=1) - 1
    m_start = m_n & (tl.load(is_start_ptr + o_n, mask=m_n, other=0) != 0)
    b_group = tl.minimum(b_key >> tag_shift, num_groups - 1)
    # The batch key of each value: the number of key ends <= its position.
    b_lo = tl.zeros((BLOCK_N,), dtype=tl.int64)
    b_hi = tl.zeros((BLOCK_N,), dtype=tl.int64) + num_keys
    for _ in range(search_steps):
        m_open = m_n & (b_lo < b_hi)
        b_mid = (b_lo + b_hi) >> 1
        b_end = tl.load(meta_ptr + b_mid, mask=m_open, other=0)
        b_lo = tl.where(m_open & (b_end <= b_pos), b_mid + 1, b_lo)
        b_hi = tl.where(m_open & (b_end > b_pos), b_mid, b_hi)
    b_keyi = tl.minimum(b_lo, num_keys - 1)
    b_dst = b_pos + tl.load(meta_ptr + num_keys + b_keyi, mask=m_n, other=0)
    b_u_lo = tl.load(p_groups + b_group, mask=m_n, other=0)
    b_v_lo = tl.load(p_groups + num_groups + b_group, mask=m_n, other=0)
    b_ubase = tl.load(p_groups + 4 * num_groups + b_group, mask=m_n, other=0)
    b_vbase = tl.load(p_groups + 5 * num_groups + b_group, mask=m_n, other=0)
    b_run = b_seg - b_u_lo
    tl.store(inverse_ptr + b_vbase + b_dst, b_run, mask=m_n)
    tl.store(order_out_ptr + b_vbase + o_n - b_v_lo, b_dst, mask=m_n)
    b_mask = (tl.full((), 1, tl.int64) << tag_shift) - 1
    tl.store(unique_ptr + b_ubase + b_run, b_key & b_mask, mask=m_start)
    tl.store(starts_ptr + b_ubase + b_run, o_n - b_v_lo, mask=m_start)
    if HAS_WEIGHTS:
        b_w = tl.load(weights_ptr + b_pos, mask=m_n, other=0.0)
        tl.store(weights_out_ptr + b_vbase + b_dst, b_w, mask=m_n)
    # The bags' offsets, each group's in its feature order.
    m_t = o_n < num_bags
    b_c = o_n // tl.maximum(batch_size, 1)
    b_j = o_n - b_c * batch_size
    b_g = tl.load(meta_ptr + 2 * num_keys + b_c, mask=m_t, other=0)
    b_place = tl.load(meta_ptr + 3 * num_keys + b_c, mask=m_t, other=0)
    b_obase = tl.load(p_groups + 6 * num_groups + b_g, mask=m_t, other=0)
    b_at = b_obase + b_place * batch_size + b_j + 1
    b_end = tl.load(ends_ptr + o_n, mask=m_t, other=0)
    b_shift = tl.load(meta_ptr + num_keys + b_c, mask=m_t, other=0)
    tl.store(offsets_ptr + b_at, b_end + b_shift, mask=m_t)
    o_g = tl.arange(0, BLOCK_N)
    for g0 in range(0, num_groups, BLOCK_N):
        m_g = (i_n == 0) & (g0 + o_g < num_groups)
        p_g = p_groups + g0 + o_g
        b_u = tl.load(p_g + 2 * num_groups, mask=m_g, other=0)
        b_nv = tl.load(p_g + 3 * num_groups, mask=m_g, other=0)
        b_ub = tl.load(p_g + 4 * num_groups, mask=m_g, other=0)
        b_ob = tl.load(p_g + 6 * num_groups, mask=m_g, other=0)
        tl.store(starts_ptr + b_ub + b_u, b_nv, mask=m_g)
        tl.store(offsets_ptr + b_ob, tl.zeros((BLOCK_N,), dtype=tl.int64), mask=m_g)


@dataclass
class JointShares:
    """`scatter_joint`'s outputs: each group's share at `JointPlan`'s bases."""

    unique: torch.Tensor  # int64 [plan.unique_size]
    starts: torch.Tensor  # int64 [plan.unique_size]
    inverse: torch.Tensor  # int64 [plan.value_size]
    order: torch.Tensor  # int64 [plan.value_size]
    weights: torch.Tensor | None  # float32 [plan.value_size]
    offsets: torch.Tensor  # int64 [plan.offsets_size]

    def group(self, plan: JointPlan, g: int) -> GroupShare:
        """Group g's share: views."""
        u, nv, ub, vb = plan.num_unique[g], plan.num_values[g], plan.ubase[g], plan.vbase[g]
        ob = plan.obase[g]
        return GroupShare(
            self.unique[ub : ub + u],
            self.inverse[vb : vb + nv],
            self.order[vb : vb + nv],
            self.starts[ub : ub + u + 1],
            None if self.weights is None else self.weights[vb : vb + nv],
            self.offsets[ob : ob + plan.num_bags[g] + 1],
        )


@dataclass
class GroupShare:
    """One group's share of `JointShares`: its unique ids ascending, each value's unique id
    (the inverse), the values grouped by id (``order``, in batch order within an id) and each
    id's run start in it (``starts``, ``[U + 1]``), its values' weights, and its bags' offsets
    (``[F_g * B + 1]``, from 0), all in the group's feature order."""

    unique: torch.Tensor
    inverse: torch.Tensor
    order: torch.Tensor
    starts: torch.Tensor
    weights: torch.Tensor | None
    offsets: torch.Tensor


def _outputs(plan: JointPlan, device: torch.device, weighted: bool) -> JointShares:
    def empty(size: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    us, vs = plan.unique_size, plan.value_size
    w = empty(vs, torch.float32) if weighted else None
    return JointShares(empty(us), empty(us), empty(vs), empty(vs), w, empty(plan.offsets_size))


def scatter_joint(
    ordered: torch.Tensor,
    order: torch.Tensor,
    is_start: torch.Tensor,
    seen: torch.Tensor,
    plan: JointPlan,
    tag_shift: int,
    weights: torch.Tensor | None,
    length_ends: torch.Tensor,
) -> JointShares:
    """Write each group's share (module docstring) from a `ids.sort_and_mark` of the tagged
    keys, after the read that made ``plan``: one launch, plus the plan's upload (pinned, not
    waited for, on a GPU). ``weights``: float32 ``[n]`` in the batch's order, or None;
    ``length_ends``: int64 ``[K * B]``, the bag lengths' inclusive running sums in the batch's
    order."""
    device = ordered.device
    out = _outputs(plan, device, weights is not None)
    meta = torch.tensor(plan.meta(), dtype=torch.int64)
    if device.type == "cuda":
        meta = meta.pin_memory().to(device, non_blocking=True)
    else:
        meta = meta.to(device)
    n = ordered.numel()
    num_keys, num_groups = len(plan.key_ends), len(plan.u_lo)
    num_bags = num_keys * plan.batch_size
    _joint_scatter_kernel[(max(1, triton.cdiv(max(n, num_bags), _BLOCK_N)),)](
        ordered,
        order,
        is_start,
        seen,
        meta,
        weights if weights is not None else meta,
        length_ends if num_bags else meta,
        out.unique,
        out.inverse,
        out.starts,
        out.order,
        out.weights if out.weights is not None else meta,
        out.offsets,
        n,
        num_bags,
        plan.batch_size,
        num_keys,
        num_groups,
        num_keys.bit_length(),
        tag_shift,
        HAS_WEIGHTS=weights is not None,
        BLOCK_N=_BLOCK_N,
    )
    return out


def scatter_joint_ref(
    keys: torch.Tensor,
    plan: JointPlan,
    tag_shift: int,
    weights: torch.Tensor | None,
    lengths: torch.Tensor,
) -> JointShares:
    """`scatter_joint`'s specification in plain torch, from the tagged keys themselves
    (unsorted, in the batch's order) and the bag lengths (``[K * B]``, the batch's order);
    the padding between shares is left as allocated."""
    device = keys.device
    out = _outputs(plan, device, weights is not None)
    bags = lengths.to(torch.int64).view(len(plan.key_ends), plan.batch_size)
    for g, ob in enumerate(plan.obase):
        mine = [k for k in range(len(plan.key_ends)) if plan.key_group[k] == g]
        mine.sort(key=lambda k: plan.key_place[k])
        grouped = bags[mine].reshape(-1) if mine else bags.new_zeros(0)
        out.offsets[ob] = 0
        out.offsets[ob + 1 : ob + 1 + grouped.numel()] = torch.cumsum(grouped, 0)
    key_ends = torch.tensor(plan.key_ends, dtype=torch.int64, device=device)
    shifts = torch.tensor(plan.shift, dtype=torch.int64, device=device)
    for g in range(len(plan.u_lo)):
        positions = torch.nonzero((keys >> tag_shift) == g).flatten()  # batch order
        # A value's place in its group's feature order: its key's shift added.
        dst = positions + shifts[torch.searchsorted(key_ends, positions, right=True)]
        ids = keys[positions] & ((1 << tag_shift) - 1)
        local = torch.empty_like(ids)
        local[dst] = ids
        unique, inverse = torch.unique(local, sorted=True, return_inverse=True)
        counts = torch.bincount(inverse, minlength=unique.numel())
        starts = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, 0, out=starts[1:])
        ub, vb, nv = plan.ubase[g], plan.vbase[g], local.numel()
        out.unique[ub : ub + unique.numel()] = unique
        out.starts[ub : ub + unique.numel() + 1] = starts
        out.inverse[vb : vb + nv] = inverse
        # Grouped by id, each id's values in batch order (the sort is stable).
        out.order[vb : vb + nv] = dst[torch.sort(ids, stable=True)[1]]
        if out.weights is not None and weights is not None:
            w = torch.empty(nv, dtype=torch.float32, device=device)
            w[dst] = weights[positions]
            out.weights[vb : vb + nv] = w
    return out
