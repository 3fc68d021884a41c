"""What every implementation of the ids family shares: the results' types, the input checks,
the error a bad id raises, and the host's plan of a joint dedup.

* `Deduped`, `Marked`: a dedup's results (`IdsOps.dedup_together`-style, `IdsOps.sort_and_mark`);
* `IdVerdict`: the checks of a fuse made on the device, read later (`IdsOps.fuse_ids_deferred`);
* the joint dedup's plan (`JointPlan`, `joint_plan`) and its outputs (`JointShares`,
  `GroupShare`): several caches' ids deduplicated in one sort, each share written apart
  (`IdsOps.scatter_joint`; `engine.joint` says more);
* the checks of the TBE step's indices (`check_bags_sample_major`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from embcache.ops.checks import INDEX_DTYPES, check_int, check_tensor, require

# Per-value verdict of a fuse (`spec.fuse_ids_ref`), in the order the checks are made.
ID_OK = 0
ID_NEGATIVE = 1
ID_OUT_OF_RANGE = 2  # >= num_embeddings of a bounded table
ID_OVERFLOWS_K = 3  # >= 2**fusion_k

ALIGN = 4  # elements a joint dedup's shares start at multiples of: 32 bytes of int64

# Per-sample weights `IdsOps.bags_sample_major` moves with their values.
WEIGHT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass
class Deduped:
    """A cache's ids deduplicated by `dedup_together`: unique ids ascending, the inverse,
    (with several tables, when asked for) `CacheLayout.table_bounds` of the unique ids, and on
    the device path, the ids' positions grouped by unique id (``order``, a stable sort: in
    value order within an id) and where each id's run starts in it (``segment_starts``,
    ``[U + 1]``); and the bags' offsets where the dedup made them (`engine.joint`)."""

    unique: torch.Tensor  # int64 [U]
    inverse: torch.Tensor  # int64 [n]
    bounds: list[int] | None
    order: torch.Tensor | None = None  # int64 [n]
    segment_starts: torch.Tensor | None = None  # int64 [U + 1]
    offsets: torch.Tensor | None = None  # int64 [F * B + 1], the bags', when made here


@dataclass
class Marked:
    """Ids sorted and their runs marked (`sort_and_mark`), their sizes not yet read: the sorted
    ids and where each came from (``order``, a stable sort), run starts (int32 ``[n]``), the
    running count of runs (``seen``, int64 ``[n]``, inclusive), and ``read``, the device buffer
    that one host read brings back (``[0]`` the number of runs, ``[1 + t]`` the runs below
    ``starts[t]``, then ``extra``)."""

    ordered: torch.Tensor
    order: torch.Tensor
    is_start: torch.Tensor
    seen: torch.Tensor
    read: torch.Tensor


def check_ids(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, INDEX_DTYPES, 1)


def check_fusion_k(fusion_k: int) -> None:
    check_int("fusion_k", fusion_k, 0, 63)


def check_bags_sample_major(
    slots: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    batch_size: int,
) -> None:
    """The arguments of `IdsOps.bags_sample_major`, on the host (nothing read of a device):
    int64 ``slots``, ``inverse`` and ``offsets``, floating ``weights`` one per value, and
    ``offsets`` of B bags per feature."""
    check_tensor("slots", slots, torch.int64, 1)
    check_tensor("inverse", inverse, torch.int64, 1)
    check_tensor("offsets", offsets, torch.int64, 1)
    check_int("batch_size", batch_size, 0)
    if weights is not None:
        check_tensor("weights", weights, WEIGHT_DTYPES, 1)
        require(
            weights.numel() == inverse.numel(),
            f"bags_sample_major: {weights.numel()} weights for {inverse.numel()} values",
        )
    num_bags = offsets.numel() - 1
    require(num_bags >= 0, "bags_sample_major: offsets must hold at least one entry")
    require(
        num_bags % batch_size == 0 if batch_size else num_bags == 0,
        f"bags_sample_major: {num_bags} bags are not F bags of batch_size={batch_size} each",
    )


def bad_id_error(
    ids: torch.Tensor,
    value_features: torch.Tensor,
    verdict: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
    feature_names: Sequence[str],
    table_names: Sequence[str],
) -> ValueError:
    """The error naming the first value whose verdict is not OK (error path only)."""
    j = int(torch.nonzero(verdict).min())
    kind = int(verdict[j])
    i = int(value_features[j])
    where = f"feature {feature_names[i]!r} (table {table_names[i]!r}): id {int(ids[j])}"
    if kind == ID_NEGATIVE:
        return ValueError(f"{where} is negative; ids must be >= 0")
    if kind == ID_OUT_OF_RANGE:
        return ValueError(f"{where} out of range [0, {int(num_embeddings[i])})")
    return ValueError(
        f"{where} needs more than fusion_k={fusion_k} bits (ids must be < 2**{fusion_k})"
    )


class IdVerdict:
    """The checks of `fuse_ids_deferred`, made on the device and not yet read: ``flags``
    (int64 ``[4]``: a negative length, lengths that do not sum to the values, a table index
    out of range, a bad id). A caller reads them with a read of its own and hands their
    values to `judge`; `verify` reads them itself (`fuse_ids`)."""

    def __init__(
        self,
        flags: torch.Tensor,
        args: tuple,
    ) -> None:
        self.flags = flags
        self._args = args
        # Checks of the caller's that folded into these flags (a batch's pending length
        # checks, `JaggedBatch.check_lengths`): run first when a flag is up, so that the
        # error names what the caller was given.
        self.first: Callable[[], None] | None = None

    def judge(self, flags: Sequence[int]) -> None:
        """Raise the error `fuse_ids` raises when ``flags`` (the values of `flags`) says so
        (`first`'s, when it raises).

        Raises:
            ValueError: as `fuse_ids` says; nothing was changed.
        """
        if any(flags):
            if self.first is not None:
                self.first()
            raise_bad(flags, *self._args)

    def verify(self) -> None:
        """`judge` the flags, read here: the one host sync of `fuse_ids`' good path."""
        self.judge(self.flags.tolist())


def features_of_values(ends: torch.Tensor, nnz: int) -> torch.Tensor:
    """The feature of each of ``nnz`` values, from the lengths' running sums ``ends``; safe
    when the lengths are wrong (values past every end are the last feature's)."""
    o_n = torch.arange(nnz, dtype=torch.int64, device=ends.device)
    return torch.searchsorted(ends, o_n, right=True).clamp_(max=ends.numel() - 1)


def bad_tables(table_idx: torch.Tensor, fusion_k: int) -> torch.Tensor:
    """Which table indices do not fit the ``63 - fusion_k`` bits above the ids."""
    bad = table_idx < 0
    if fusion_k > 0:  # for fusion_k = 0 every non-negative int64 fits
        bad |= table_idx >= (1 << (63 - fusion_k))
    return bad


def raise_bad(
    flags: Sequence[int],
    values: torch.Tensor,
    lengths: torch.Tensor,
    ends: torch.Tensor,
    table_idx: torch.Tensor,
    value_features: torch.Tensor | None,
    verdict: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
    feature_names: Sequence[str],
    table_names: Sequence[str],
) -> None:
    """The error of `fuse_ids` for ``flags`` (error path only; ``value_features`` None: found
    from ``ends`` here)."""
    negative_length, wrong_total, table_out_of_range, _ = flags
    if negative_length:
        i = int(torch.nonzero(lengths < 0).min())
        raise ValueError(
            f"feature {feature_names[i]!r}: negative length {int(lengths[i])} in feature_lengths"
        )
    if wrong_total:
        raise ValueError(
            f"feature_lengths sum to {int(ends[-1])} but values has {values.numel()} entries"
        )
    if table_out_of_range:
        i = int(torch.nonzero(bad_tables(table_idx, fusion_k)).min())
        raise ValueError(
            f"feature {feature_names[i]!r} (table {table_names[i]!r}): table index "
            f"{int(table_idx[i])} out of range [0, 2**{63 - fusion_k}) for fusion_k={fusion_k}"
        )
    if value_features is None:
        value_features = features_of_values(ends, values.numel())
    raise bad_id_error(
        values, value_features, verdict, num_embeddings, fusion_k, feature_names, table_names
    )


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
        return self.ubase[-1] + aligned(self.num_unique[-1] + 1) if self.ubase else 0

    @property
    def value_size(self) -> int:
        return self.vbase[-1] + aligned(self.num_values[-1]) if self.vbase else 0

    @property
    def offsets_size(self) -> int:
        return self.obase[-1] + aligned(self.num_bags[-1] + 1) if self.obase else 0

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


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def joint_plan(
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
        u += aligned(num_unique[g] + 1)
        w += aligned(num_values[g])
    key_group, key_place = [0] * len(per_key), [0] * len(per_key)
    obase, num_bags = [], []
    o = 0
    for g, keys in enumerate(group_keys):
        for place, k in enumerate(keys):
            key_group[k], key_place[k] = g, place
        obase.append(o)
        num_bags.append(len(keys) * batch_size)
        o += aligned(num_bags[-1] + 1)
    return JointPlan(key_starts[1:], shift, u_lo, v_lo, num_unique, num_values, ubase, vbase,
                     key_group, key_place, batch_size, obase, num_bags)  # fmt: skip


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


def joint_outputs(plan: JointPlan, device: torch.device, weighted: bool) -> JointShares:
    def empty(size: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    us, vs = plan.unique_size, plan.value_size
    w = empty(vs, torch.float32) if weighted else None
    return JointShares(empty(us), empty(us), empty(vs), empty(vs), w, empty(plan.offsets_size))
