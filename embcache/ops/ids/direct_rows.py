"""A direct share's ids checked and its distinct rows listed (`IdsOps.direct_rows`).

A cache that maps every row directly holds its tables one after another: row ``id`` of the
table feature ``f`` reads sits in slot ``feature_bases[f] + id``. A share served straight from
such a cache on the TBE step (`CacheEngine.direct_share`) needs, besides FBGEMM's pooling, two
facts of its batch: every id is a row of its feature's table, and which slots the batch touches
(each counted once as a hit, marked dirty after the step). `DirectRows` gives both at once: the
batch's distinct slots in the order they are first seen, or None for a bad id or offsets that
do not span the values (its caller's torch path then raises naming what is wrong).

`DirectRows` is the torch specification; `ops.ids.native` finds the same rows in one compiled
pass over the values (a bit per cache row remembers the rows seen).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from embcache.ops.checks import check_int, check_tensor, require


class DirectRows:
    """The distinct rows of a direct share, for a cache of ``num_rows`` slots, in torch ops.

    Example: features f0, f1 of one table of 300 rows at slot 0 and f2 of a table of 200 rows at
    slot 300 (``feature_rows = [300, 300, 200]``, ``feature_bases = [0, 0, 300]``); with B = 1,
    values ``[7, 3, 7, 5]`` and offsets ``[0, 2, 3, 4]`` give slots ``[7, 3, 305]``.

    Args:
        feature_rows: the rows of each feature's table (F ints, >= 0).
        feature_bases: the slot of row 0 of each feature's table (F ints, >= 0).
        num_rows: the cache's slots: every feature's rows lie below it.

    Raises:
        TypeError: a row count, base or ``num_rows`` that is not an int.
        ValueError: F row counts and a different number of bases, a negative one, or a table
            whose rows run past ``num_rows``.
    """

    def __init__(
        self, feature_rows: Sequence[int], feature_bases: Sequence[int], num_rows: int
    ) -> None:
        check_int("num_rows", num_rows, 0)
        require(
            len(feature_rows) == len(feature_bases),
            f"direct_rows: {len(feature_rows)} feature_rows, {len(feature_bases)} bases",
        )
        for f, (rows, base) in enumerate(zip(feature_rows, feature_bases, strict=True)):
            check_int(f"feature_rows[{f}]", rows, 0)
            check_int(f"feature_bases[{f}]", base, 0)
            require(
                base + rows <= num_rows,
                f"direct_rows: feature {f}'s rows [{base}, {base + rows}) run past the cache's "
                f"{num_rows} slots",
            )
        self.feature_rows = list(feature_rows)
        self.feature_bases = list(feature_bases)
        self.num_rows = num_rows

    def __call__(
        self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int
    ) -> torch.Tensor | None:
        """The batch's distinct slots, int64 ``[U]`` in order of first sight; None when an id
        is out of its table's range or the offsets do not span the values.

        Args:
            values: int64 ``[nnz]`` raw ids, the F features one after another.
            offsets: int64 ``[F * B + 1]`` bag offsets into ``values``, feature-major.
            batch_size: B, bags per feature.

        Raises:
            TypeError: ``values`` or ``offsets`` not an int64 tensor, ``batch_size`` not an
                int.
            ValueError: ``values`` or ``offsets`` not 1-D, or ``batch_size`` negative.
        """
        check_tensor("values", values, torch.int64, 1)
        check_tensor("offsets", offsets, torch.int64, 1)
        check_int("batch_size", batch_size, 0)
        num_features = len(self.feature_rows)
        if offsets.numel() != num_features * batch_size + 1:
            return None
        n = values.numel()
        device = values.device
        # Where each feature's values start and end (its first bag's offset, its last's end).
        bounds = offsets.index_select(
            0, torch.arange(num_features + 1, device=offsets.device) * batch_size
        ).to(device)
        counts = bounds[1:] - bounds[:-1]
        if int(bounds[0]) != 0 or int(bounds[-1]) != n or bool((counts < 0).any()):
            return None
        feature = torch.repeat_interleave(
            torch.arange(num_features, device=device), counts, output_size=n
        )
        rows = torch.tensor(self.feature_rows, dtype=torch.int64, device=device)
        if bool(((values < 0) | (values >= rows.index_select(0, feature))).any()):
            return None
        bases = torch.tensor(self.feature_bases, dtype=torch.int64, device=device)
        slots = values + bases.index_select(0, feature)
        unique, inverse = torch.unique(slots, return_inverse=True)
        # Each distinct slot's first position, then the slots in the order of those positions.
        first = torch.full((unique.numel(),), n, dtype=torch.int64, device=device)
        first.scatter_reduce_(0, inverse, torch.arange(n, device=device), "amin")
        return slots.index_select(0, first.sort().values)
