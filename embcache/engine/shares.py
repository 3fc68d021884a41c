"""How a batch becomes every cache's share: checked, fused, deduplicated and resolved.

`ShareMaker` holds a collection's engines and makes their shares of a batch, as a forward
(`prepare`) or a prefetch (`check` on the training thread, `prepare_fused` on the worker)
asks: every id validated before any cache changes, the caches' host reads made once for all
of them (`_fuse_together`, `IdsOps.dedup_together`, or on the device path with several caches
`engine.joint.dedup_joint`), and a failing resolve leaving nothing locked. `EngineGroup` holds
one and hands these calls to it.
"""

from __future__ import annotations

import torch

from embcache.cache.hot_cache import resolve_together
from embcache.engine.batch_state import Prepared
from embcache.engine.engine import CacheEngine, Deduped
from embcache.engine.inputs import JaggedBatch
from embcache.engine.joint import JointLayout, dedup_joint
from embcache.ops.ids.shared import IdVerdict
from embcache.ops.registry import ops_for
from embcache.profiling import profiled

# An engine's share of a batch checked and fused, not yet deduplicated (`ShareMaker.check`):
# its fused ids, bag lengths and weights (`CacheEngine.fuse`), and its `Prepared.cuts`.
CheckedShare = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int] | None]


class ShareMaker:
    """Makes the engines' shares of a batch (module docstring).

    Args:
        engines: a collection's engines, one per cache.
        fusion_k: bits of the raw id inside a fused id.
        device: where the caches live.
    """

    def __init__(self, engines: list[CacheEngine], fusion_k: int, device: torch.device) -> None:
        self.engines = engines
        self.fusion_k = fusion_k
        self.device = device
        # The ids family for the caches' device, bound once (`embcache.ops`).
        self.ops = ops_for(device).ids
        # `_fuse_tables`, by engines and device
        self._joined: dict[
            tuple[tuple[int, ...], torch.device], tuple[torch.Tensor, torch.Tensor, list[str]]
        ] = {}
        # `_joint_layout`, by key order and device (None: the joint dedup does not apply)
        self._joint: dict[tuple[tuple[str, ...], torch.device], JointLayout | None] = {}

    def prepare(self, batch: JaggedBatch, lock: bool) -> list[Prepared]:
        """Every engine's share of a checked batch; every id is validated (fused) before any
        cache changes, and a failing resolve leaves nothing locked."""
        joint = self._joint_layout(batch)
        if joint is not None:  # every cache on the device path: one dedup for all
            joint_shares, found = dedup_joint(joint, batch, self.fusion_k, self.device, self.ops)
            return self.prepare_fused(list(joint_shares), lock, found=found)
        shares, verdict = self._check(batch, lock, defer=True)
        return self.prepare_fused(shares, lock, verdict=verdict)

    def _joint_layout(self, batch: JaggedBatch) -> JointLayout | None:
        """The `JointLayout` of ``batch``'s keys when `dedup_joint` applies: every cache's
        share is a plain dedup on the device path, the batch is on the caches' device, and
        cutting it would cost a read (several caches, or keys in another order)."""
        keys = batch.keys()
        if not all(e.cache.device_path and e.tbe_step is None for e in self.engines):
            return None
        if len(self.engines) == 1 and keys == self.engines[0].layout.features:
            return None  # nothing to cut: `_fuse_together` reads nothing more
        values = batch.values()
        if values.device != self.device or not self.ops.joint:
            return None
        key = (tuple(keys), self.device)
        if key not in self._joint:
            layouts = [e.layout for e in self.engines]
            self._joint[key] = JointLayout.of(layouts, keys, self.device, self.fusion_k)
        return self._joint[key]

    def check(self, batch: JaggedBatch, lock: bool) -> list[Prepared | CheckedShare]:
        """Every engine's share of a checked batch, validated and not yet resolved: the fused
        ids, lengths and weights (`CacheEngine.fuse`); for a training batch of a direct-mapped
        cache on the TBE step, a share that skips dedup and resolve
        (`CacheEngine.direct_share`); for a cache on that step that indexes its rows, the
        share checked and deduplicated in one pass (`CacheEngine.unique_share`). A bad id
        raises here, before any cache changes."""
        return self._check(batch, lock, defer=False)[0]

    def _check(
        self, batch: JaggedBatch, lock: bool, defer: bool
    ) -> tuple[list[Prepared | CheckedShare], IdVerdict | None]:
        """`check`; with ``defer``, the id checks of the shares that `fuse_ids` makes are
        returned unread (`IdVerdict`), for `prepare_fused` to read with its dedup's read and
        judge before any cache changes."""
        shares: list[Prepared | None] = []
        for engine in self.engines:
            share = engine.direct_share(batch) if lock else None
            if share is None:  # checked and deduplicated at once where that applies
                share = engine.unique_share(batch)
            shares.append(share)
        todo = [i for i, share in enumerate(shares) if share is None]
        # One engine or several: the same host reads (and the bags' cut points).
        checked: dict[int, CheckedShare] = {}
        verdict = None
        if todo:
            fused, verdict = self._fuse_together(todo, batch)
            checked = dict(zip(todo, fused, strict=True))
            if verdict is not None and not defer:
                verdict.verify()
                verdict = None
        return [checked[i] if share is None else share for i, share in enumerate(shares)], verdict

    @profiled("engine.fuse")
    def _fuse_together(
        self, todo: list[int], batch: JaggedBatch
    ) -> tuple[list[CheckedShare], IdVerdict | None]:
        """What `CacheEngine.fuse` gives each engine of ``todo``, and its `Prepared.cuts`,
        made in one pass over their features together: one `IdsOps.fuse_ids_deferred` (its checks
        returned unread, to read once for all caches) and the batch's values per key (read
        by its check), which group the features in the engines' order and say where each
        engine's values end and where its lookups start."""
        engines = [self.engines[i] for i in todo]
        features = [f for e in engines for f in e.layout.features]
        keys, b = batch.keys(), batch.stride()
        values, lengths = batch.values(), batch.lengths()
        weights = batch.weights_or_none()
        # The counts per key cut the values between engines, into an engine's lookups and
        # into the engines' feature order; a batch with its lengths still unchecked that
        # needs no cut keeps its checks on the device, read with the ids' (`IdVerdict.first`).
        late = batch.lengths_pending and not (
            keys != features or len(engines) > 1 or len(engines[0].layout.lookups) > 1
        )
        per_key = [] if late else batch.length_per_key()
        starts = [0]
        for n in per_key:
            starts.append(starts[-1] + n)
        pos = {k: i for i, k in enumerate(keys)}
        order = [pos[f] for f in features]
        if keys != features:  # as `group_inputs` does, from the counts read above
            values = torch.cat([values[starts[i] : starts[i + 1]] for i in order])
            lengths = torch.cat([lengths[i * b : (i + 1) * b] for i in order])
            if weights is not None:
                weights = torch.cat([weights[starts[i] : starts[i + 1]] for i in order])
        table_index, table_rows, names = self._fuse_tables(todo, values.device)
        per_feature = lengths.view(len(features), -1).sum(dim=1)
        if late:  # a negative bag makes its feature's count negative: the ids' check sees it
            negative = lengths.view(len(features), -1).amin(dim=1) < 0
            per_feature = per_feature.masked_fill_(negative, -1)
        fused, verdict = self.ops.fuse_ids_deferred(
            values, per_feature, table_index, table_rows, self.fusion_k, features, names
        )
        if late:
            if verdict is None:
                batch.check_lengths()
            else:
                verdict.first = batch.check_lengths
        cut = [0]
        f = 0
        for e in engines:
            nf = len(e.layout.features)
            cut.append(
                values.numel() if late else cut[-1] + sum(per_key[i] for i in order[f : f + nf])
            )
            f += nf
        fused = fused.to(self.device)
        lengths = lengths.to(self.device)
        if weights is not None:
            weights = weights.to(self.device, torch.float32)
        out = []
        f = 0
        for e, lo, hi in zip(engines, cut, cut[1:], strict=False):
            nf = len(e.layout.features)
            out.append(
                (
                    fused[lo:hi],
                    lengths[f * b : (f + nf) * b],
                    None if weights is None else weights[lo:hi],
                    None if late else e.layout.value_cuts([per_key[i] for i in order[f : f + nf]]),
                )
            )
            f += nf
        return out, verdict

    def _fuse_tables(
        self, todo: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """The engines' `CacheLayout.indexes` joined and their table names: made once per set
        of engines and device."""
        key = (tuple(todo), device)
        found = self._joined.get(key)
        if found is None:
            layouts = [self.engines[i].layout for i in todo]
            pairs = [layout.indexes(device) for layout in layouts]
            found = (
                torch.cat([p[0] for p in pairs]),
                torch.cat([p[1] for p in pairs]),
                [n for layout in layouts for n in layout.table_names],
            )
            self._joined[key] = found
        return found

    def prepare_fused(
        self,
        shares: list[Prepared | CheckedShare],
        lock: bool,
        defer_writeback: bool = False,
        verdict: IdVerdict | None = None,
        found: list[Deduped] | None = None,
    ) -> list[Prepared]:
        """`prepare` after `check` (every id validated, or with ``verdict``, the id checks of
        the shares made and not yet read: they are read with the dedup's read and judged
        before any cache changes): dedup and resolve each engine's share, or serve a direct
        one; a failing resolve leaves nothing locked. ``defer_writeback``: each cache's
        victims are written by `write_deferred` (or the cache's next tier access), not before
        this returns (`HotCache.resolve`). ``found``: every share already deduplicated
        (`dedup_joint`), one per engine."""
        # Plain dedups at once: one host read for all (`IdsOps.dedup_together`), with the tables'
        # bounds of their unique ids (for the backward) and the id checks; a single one too
        # where that saves a read (the device path, or a cache of several tables).
        plain = {
            i: share[0]
            for i, (engine, share) in enumerate(zip(self.engines, shares, strict=True))
            if not isinstance(share, Prepared) and engine.plain_dedup(share[0], share[2])
        }
        together = len(plain) > 1 or any(
            self.engines[i].cache.device_path or len(self.engines[i].layout.tables) > 1
            for i in plain
        )
        checked = sum(not isinstance(share, Prepared) for share in shares)
        if verdict is not None and not (together and len(plain) == checked):
            verdict.verify()  # before any other dedup or direct share sees the ids
            verdict = None
        if len(shares) == 1:  # one direct share (a whole table on a CPU): nothing to join
            (share,) = shares
            if isinstance(share, Prepared) and share.direct is not None:
                return [self.engines[0].serve_direct(share)]
        deduped: dict[int, Deduped] = {}
        if found is not None:
            deduped = dict(enumerate(found))
        elif together:
            starts = [self.engines[i].layout.fused_starts(v.device, self.fusion_k)
                      for i, v in plain.items()]  # fmt: skip
            deduped_list, flags = self.ops.dedup_together(
                list(plain.values()), starts, None if verdict is None else verdict.flags
            )
            if verdict is not None:
                verdict.judge(flags)
            deduped = dict(zip(plain, deduped_list, strict=True))
        # The caches resolve together (`resolve_together`: each phase's host reads made once
        # for all of them); direct shares are served first.
        out: list[Prepared | None] = [None] * len(self.engines)
        todo: list[tuple[int, Prepared, bool]] = []
        try:
            for i, (engine, share) in enumerate(zip(self.engines, shares, strict=True)):
                if isinstance(share, Prepared) and share.direct is not None:
                    out[i] = engine.serve_direct(share)
                elif isinstance(share, Prepared):
                    todo.append((i, share, defer_writeback))
                else:
                    fused, lengths, weights, cuts = share
                    p = engine.dedup(fused, lengths, weights, cuts, found=deduped.get(i))
                    todo.append((i, p, False))  # as `CacheEngine.prepare`
            if todo:
                unique = []
                for _, p, _ in todo:
                    assert p.unique is not None  # deduplicated (`dedup`, `unique_share`)
                    unique.append(p.unique)
                slots = resolve_together(
                    [self.engines[i].cache for i, _, _ in todo],
                    unique,
                    lock,
                    defer_writeback=[d for _, _, d in todo],
                    checked=True,
                )
                for (i, p, _), s in zip(todo, slots, strict=True):
                    p.slots, p.locked = s, lock
                    out[i] = p
        except BaseException:
            self.release_shares(out)
            raise
        done = [p for p in out if p is not None]
        assert len(done) == len(out)  # every engine's share was filled
        return done

    def release_shares(self, prepared: list[Prepared | None]) -> None:
        """Unlock the shares of a batch that will not run (a prefetch released unused)."""
        for engine, p in zip(self.engines, prepared, strict=False):
            if p is not None:
                engine.release(p)
