"""Frequencies in bounded memory: a count-min sketch, and the LFU counts of a cache.

A count-min sketch keeps ``depth`` rows of ``width`` counters; key ``k`` counts in column
``h_d(k)`` of row ``d`` (independent salts of ``mix64``) and reads as the smallest of its
``depth`` counters, so it never underestimates and overestimates only by the collisions that
all its rows share (at most ``total / width`` with probability ``1 - e**-depth``). Adds use the
conservative update (only counters below the new estimate rise), which keeps that excess small
on skewed traffic. Memory is ``4 * depth * width`` bytes, whatever the number of keys: the LFU
of an unbounded or 2**32-row table, and the admission counts, cost what the configuration says.

`LfuCounts` is what a cache's LFU policy reads and bumps: an exact count per row of its bounded
tables when they are small enough (FBGEMM keeps one per row of the whole table), the sketch
otherwise (`CacheConfig.lfu_counters`).
"""

from __future__ import annotations

import torch

from embcache.hashing import LOW63, mix64

# One salt per sketch row: independent columns for the same key.
_SALTS = (
    0x1B873593A5F3C5D1,
    0x2545F4914F6CDD1D,
    0x6A09E667F3BCC909,
    0x3C6EF372FE94F82B,
    0x510E527FADE682D1,
    0x1F83D9ABFB41BD6B,
    0x5BE0CD19137E2179,
    0x0CBBB9D5DC1059ED,
)


class CountMinSketch:
    """A count-min sketch of int32 counters, vectorised over keys, on one device.

    Args:
        width: counters per row.
        depth: rows, at most 8.
        device: where the counters live.
    """

    def __init__(self, width: int, depth: int, device: torch.device | str) -> None:
        if not 1 <= depth <= len(_SALTS):
            raise ValueError(f"sketch depth must be in [1, {len(_SALTS)}], got {depth}")
        self.width, self.depth = width, depth
        self.counters = torch.zeros(depth * width, dtype=torch.int32, device=device)
        self._salts = torch.tensor(_SALTS[:depth], dtype=torch.int64, device=device)
        self._bases = torch.arange(depth, dtype=torch.int64, device=device) * width

    @property
    def nbytes(self) -> int:
        return self.counters.nbytes

    def _cells(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 ``[depth, n]``: each key's counter in each row (flat indices)."""
        hashed = mix64(keys.unsqueeze(0) ^ self._salts.unsqueeze(1)) & LOW63
        return hashed % self.width + self._bases.unsqueeze(1)

    def estimate(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]``: each key's count (never below the true count)."""
        if not keys.numel():
            return keys.new_zeros(0)
        return self.counters[self._cells(keys)].amin(dim=0).to(torch.int64)

    def add(self, keys: torch.Tensor) -> torch.Tensor:
        """Count one more of each of ``keys`` (distinct), conservatively; returns their new
        counts (int64 ``[n]``)."""
        if not keys.numel():
            return keys.new_zeros(0)
        cells = self._cells(keys)
        counts = self.counters[cells].amin(dim=0) + 1  # [n]
        self.counters.scatter_reduce_(
            0, cells.flatten(), counts.repeat(self.depth), "amax", include_self=True
        )
        return counts.to(torch.int64)

    def decay(self, factor: float) -> None:
        """Multiply every counter by ``factor`` (rounded down)."""
        self.counters.copy_((self.counters.double() * factor).to(torch.int32))

    def halve(self) -> None:
        """Halve every counter (rounded down): TinyLFU's reset."""
        self.counters.bitwise_right_shift_(1)

    def state(self) -> torch.Tensor:
        return self.counters.cpu()

    def load(self, counters: torch.Tensor) -> None:
        self.counters.copy_(counters)


class LfuCounts:
    """LFU frequencies of a cache's rows, keyed by fused ids.

    Args:
        row_offset: int64 ``[tables]``, on the device: the first count of each table whose rows
            are counted exactly (by ``offset + id``), -1 for a table counted in the sketch.
        exact_rows: exact counts to allocate (the rows of those tables).
        sketch: the sketch for the other tables (None when every table is counted exactly).
        fusion_k: bits of the raw id in a fused id.
    """

    def __init__(
        self,
        row_offset: torch.Tensor,
        exact_rows: int,
        sketch: CountMinSketch | None,
        fusion_k: int,
    ) -> None:
        self.row_offset = row_offset
        self.exact = torch.zeros(exact_rows, dtype=torch.int64, device=row_offset.device)
        self.sketch = sketch
        self.fusion_k = fusion_k

    @property
    def nbytes(self) -> int:
        return self.exact.nbytes + (0 if self.sketch is None else self.sketch.nbytes)

    def _split(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each id's exact index (where counted exactly) and whether it is."""
        offset = self.row_offset[ids >> self.fusion_k]
        exact = offset >= 0
        return torch.where(exact, offset + (ids & ((1 << self.fusion_k) - 1)), 0), exact

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]``: each id's count."""
        index, exact = self._split(ids)
        counts = self.exact[index] if self.exact.numel() else torch.zeros_like(ids)
        if self.sketch is None:
            return counts
        return torch.where(exact, counts, self.sketch.estimate(ids))

    def add(self, ids: torch.Tensor) -> None:
        """One more request of each of ``ids`` (distinct)."""
        index, exact = self._split(ids)
        if self.exact.numel():
            self.exact.index_add_(0, index, exact.to(torch.int64))
        if self.sketch is not None:
            self.sketch.add(ids[~exact] if self.exact.numel() else ids)

    def decay(self, factor: float) -> None:
        self.exact.copy_((self.exact.double() * factor).long())
        if self.sketch is not None:
            self.sketch.decay(factor)

    def state(self) -> dict[str, torch.Tensor]:
        out = {"exact": self.exact.cpu()}
        if self.sketch is not None:
            out["sketch"] = self.sketch.state()
        return out

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.exact.copy_(state["exact"])
        if self.sketch is not None:
            self.sketch.load(state["sketch"])


class Admission:
    """Which ids of a cache's tables have their own row: those seen in at least ``admit_after``
    batches of their table (sightings counted in a count-min sketch, so one-off ids cost no
    memory beyond it). Every unique id of a resolved batch counts once, hit or miss, so the
    sightings, and hence which ids are admitted, depend on the stream of batches alone, not on
    what the cache holds.

    The sketch ages as TinyLFU's does: each time ``window`` sightings have been counted, every
    counter is halved (right after the ``window``-th, in the middle of a batch if it falls
    there). Without it, a sketch that has counted many more distinct ids than its width has
    every counter raised by collisions and admits almost every new id at its first sighting;
    halved, the counters of one-off ids fall back to 0 while those of ids that keep coming back
    stay up. An id must then reach its threshold within about a window (a count halves).

    Args:
        thresholds: int64 ``[tables]`` on the device: ``admit_after`` of each table index (1:
            every id admitted, not counted).
        sketch: the sightings.
        fusion_k: bits of the raw id in a fused id.
        window: sightings between two halvings.
    """

    def __init__(
        self, thresholds: torch.Tensor, sketch: CountMinSketch, fusion_k: int, window: int
    ) -> None:
        self.thresholds = thresholds
        self.sketch = sketch
        self.fusion_k = fusion_k
        self.window = window
        self.sightings = 0  # counted since the last halving (part of the policy state)

    def admit(self, ids: torch.Tensor, count: bool = True) -> torch.Tensor:
        """bool ``[n]``: whether each of the batch's distinct fused ``ids`` is admitted, after
        counting this sighting (``count``; False only reads, for ids counted already)."""
        threshold = self.thresholds[ids >> self.fusion_k]
        watched = threshold > 1
        seen = self._count(ids[watched]) if count else self.sketch.estimate(ids[watched])
        admitted = torch.ones_like(watched)
        admitted[watched] = seen >= threshold[watched]
        return admitted

    def _count(self, keys: torch.Tensor) -> torch.Tensor:
        """Add one sighting of each of ``keys`` (distinct), halving the sketch each time the
        window fills; int64 ``[n]``: each key's count right after its sighting."""
        counts = []
        start = 0
        while start < keys.numel():
            part = keys[start : start + self.window - self.sightings]
            counts.append(self.sketch.add(part))
            start += part.numel()
            self.sightings += part.numel()
            if self.sightings == self.window:
                self.sketch.halve()
                self.sightings = 0
        return torch.cat(counts) if counts else keys.new_zeros(0)


class Counters:
    """The frequency structures of one cache, sized before anything is allocated: LFU counts
    (`LfuCounts`, for an LFU cache that is not direct-mapped) and admission (`Admission`, when a
    table asks for it).

    Args:
        row_offset: int64 ``[tables]`` on the CPU: the first exact count of each table of
            ``num_embeddings`` rows (-1: unbounded).
        exact_rows: the rows of those tables, all together.
        thresholds: int64 ``[tables]`` on the CPU: each table's ``admit_after``.
        lfu: whether the cache counts LFU frequencies.
        mode: ``"exact"``, ``"sketch"`` or ``"auto"`` (`CacheConfig.lfu_counters`).
        auto_limit: ``"auto"`` counts exactly up to this many rows.
        width: counters per sketch row.
        depth: sketch rows.
        window: admission's sightings between two halvings of its sketch.
    """

    def __init__(
        self,
        row_offset: torch.Tensor,
        exact_rows: int,
        thresholds: torch.Tensor,
        lfu: bool,
        mode: str,
        auto_limit: int,
        width: int,
        depth: int,
        window: int,
    ) -> None:
        if mode == "auto":
            bounded = bool((row_offset >= 0).all())
            mode = "exact" if bounded and exact_rows <= auto_limit else "sketch"
        if mode == "sketch":
            row_offset, exact_rows = torch.full_like(row_offset, -1), 0
        self.lfu = lfu
        self.row_offset = row_offset
        self.exact_rows = exact_rows if lfu else 0
        self.thresholds = thresholds
        self.lfu_sketch = lfu and not bool((row_offset >= 0).all())
        self.admission = bool((thresholds > 1).any())
        self.width, self.depth, self.window = width, depth, window

    @property
    def nbytes(self) -> int:
        """Bytes the counters will take: 8 per exact count, 4 per sketch counter."""
        sketches = int(self.lfu_sketch) + int(self.admission)
        return 8 * self.exact_rows + sketches * 4 * self.width * self.depth

    def build(
        self, device: torch.device, fusion_k: int
    ) -> tuple[LfuCounts | None, Admission | None]:
        """Allocate them on ``device``."""
        counts = None
        if self.lfu:
            sketch = CountMinSketch(self.width, self.depth, device) if self.lfu_sketch else None
            counts = LfuCounts(self.row_offset.to(device), self.exact_rows, sketch, fusion_k)
        admission = None
        if self.admission:
            sketch = CountMinSketch(self.width, self.depth, device)
            admission = Admission(self.thresholds.to(device), sketch, fusion_k, self.window)
        return counts, admission
