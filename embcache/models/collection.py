"""CachedEmbeddingBagCollection: torchrec's EmbeddingBagCollection over a device cache.

Example::

    ebc = CachedEmbeddingBagCollection(
        tables=[TableConfig(name="t0", embedding_dim=16, num_embeddings=10_000,
                            feature_names=["f0", "f1"])],   # or torchrec EmbeddingBagConfig
        cache=CacheConfig(load_factor=0.1),
    )
    opt = SparseAdaGrad([ebc], lr=0.05)
    # kjt: torchrec KeyedJaggedTensor (or embcache.JaggedBatch), keys ["f0", "f1"], B bags each
    kt = ebc(kjt)                       # KeyedTensor, keys ["f0", "f1"], values [B, 32]
    kt.values().sum().backward()        # one gradient row per unique id, into ebc._trace
    opt.step()                          # fused update in the cache slots; trace cleared

One training step, top to bottom (`embcache.engine` holds each piece):

1. ``forward`` checks the input (`engine.inputs`), then `EngineGroup.prepare` has each
   `CacheEngine` (one per embedding dim) fuse its features' ids
   (``fused = id | (table_idx << fusion_k)``; a bad id raises before anything changes), dedup
   them and resolve them to cache slots, locked until the step (nothing is locked under
   ``torch.no_grad()``);
2. `PooledLookup` pools each bag straight from the slots (SUM/MEAN/MAX, per-sample weights);
3. its backward turns the pooled gradient into one row per unique id, and
   `EngineGroup.record_backward` appends ``(table_name, ids, grads)`` to ``_trace`` (or, with
   ``update_in_backward=True``, applies the attached optimizer at once);
4. the optimizer's ``step()`` calls `apply_sparse_gradients`: each engine applies the
   optimizer's rule to its rows and state in place, marks them dirty and unlocks them.

A forward whose output is never backpropagated holds its locks only until the next forward; a
forward while an un-stepped trace exists is an error unless ``accumulate_grads=True``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from embcache.cache.config import CacheConfig
from embcache.engine.batch_state import FusedPrefetchHandle, Prefetched
from embcache.engine.inputs import JaggedBatch, pooled_output
from embcache.engine.interface import CachedCollectionInterface
from embcache.engine.pooled_lookup import PooledLookup
from embcache.engine.tables import TableConfig
from embcache.kv.base import Store


class CachedEmbeddingBagCollection(CachedCollectionInterface):
    """Pooled embedding lookups over a device cache with a write-back tier behind it.

    Same input, output, keys and values as `torchrec.EmbeddingBagCollection` given the same
    weights, plus MAX pooling; tables may be far larger than the device, only the cached rows
    live there.

    Args:
        tables: `TableConfig` objects, torchrec `EmbeddingBagConfig` objects or dicts (``name``,
            ``embedding_dim``, ``num_embeddings``, ``feature_names``, optional ``pooling``:
            SUM, MEAN or MAX).
        is_weighted: the inputs carry per-sample weights.
        cache: capacity and policy of each cache (one per distinct dim); None caches everything.
        store: the tier: a `Store`, a URL (``"redis://127.0.0.1:6379/0"``) or None for an
            in-process `HostKV`.
        device: where the caches live.
        enable_fusion: fuse ids of all tables into one key space with ``fusion_k`` bits for the
            raw id (RecStore's layout). With False, the collection still fuses internally but
            with 48 id bits, so only ``num_embeddings`` limits ids.
        fusion_k: bits of the raw id inside a fused id; every table needs
            ``num_embeddings <= 2**fusion_k``.
        update_in_backward: apply the attached optimizer inside backward (FBGEMM-style) instead
            of recording a trace for ``step()``; same numbers.
        accumulate_grads: allow several forward/backward passes before one ``step()``, whose
            gradients are summed per id.
        lr: learning rate a sparse optimizer uses when given none (RecStore compatibility).
        seed: seed of the default row initialiser.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig | Mapping[str, Any] | Any],
        is_weighted: bool = False,
        cache: CacheConfig | None = None,
        store: Store | str | None = None,
        device: torch.device | str | None = None,
        enable_fusion: bool = True,
        fusion_k: int = 30,
        update_in_backward: bool = False,
        accumulate_grads: bool = False,
        lr: float | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self._setup(
            tables,
            is_weighted,
            cache,
            store,
            device,
            enable_fusion,
            fusion_k,
            update_in_backward,
            accumulate_grads,
            lr,
            seed,
        )

    def forward(self, features: JaggedBatch | Any) -> Any:
        """Pooled embeddings of every feature ``[B, sum of dims]``, keyed by the tables' feature
        names in table order (as torchrec orders them): a torchrec `KeyedTensor` for a KJT
        input, a `PooledEmbeddings` for a `JaggedBatch`."""
        batch = self.checked_input(features)
        engines = self.engines
        training = torch.is_grad_enabled()
        if training:
            try:
                engines.begin_batch()
            except RuntimeError:
                engines.prefetches.release_all()  # its locks would belong to no batch
                raise
        prefetched = engines.take_prefetch(batch)
        prepared = prefetched.prepared if prefetched else engines.prepare(batch, lock=training)
        inflight = engines.start(prepared) if training else None
        try:
            outs = PooledLookup.apply(self.grad_anchor, engines, prepared, inflight, batch.stride())
        finally:
            if not training:
                engines.finish_untracked(prepared)
        if len(outs) == 1 and engines.engines[0].layout.features == self.output_keys:
            values = outs[0]
        else:
            blocks: dict[str, torch.Tensor] = {}
            for engine, out in zip(engines.engines, outs, strict=True):
                for i, f in enumerate(engine.layout.features):
                    blocks[f] = out[:, i * engine.dim : (i + 1) * engine.dim]
            values = torch.cat([blocks[f] for f in self.output_keys], dim=1)
        return pooled_output(features, self.output_keys, self.output_dims, values)

    def issue_fused_prefetch(self, features: JaggedBatch | Any) -> FusedPrefetchHandle:
        """Start the dedup and cache resolve (tier I/O included) of a batch ahead of its
        forward and return at once; the work runs on the collection's prefetch worker, and the
        forward on the same features waits only for what is left. Ids are validated here (a bad
        id raises before anything changes).

        The handle is recorded as the one the next forward uses (RecStore's
        ``_fused_prefetch_handle``); its slots stay locked until that forward's step, and a
        handle that will not be used is released (`embcache.engine.prefetch`).
        """
        batch = self.checked_input(features)
        fused = [engine.fuse(batch) for engine in self.engines.engines]
        return self.engines.issue(id(self), batch, functools.partial(self._prefetch, fused))

    def _prefetch(self, fused: list, seq: int) -> Prefetched:
        """Worker-thread body of `issue_fused_prefetch`."""
        try:
            return Prefetched(self.engines.prepare_fused(fused, lock=True))
        except Exception as e:  # the forward reads synchronously (and meets it again)
            return Prefetched([], error=e)

    # -- whole tables ------------------------------------------------------------------------

    def table_rows(self, table: str, chunk_rows: int = 1 << 16) -> torch.Tensor:
        """Every row ``[num_embeddings, dim + state_dim]`` of a table (weights and optimizer
        state), after writing back the cache's dirty rows. CPU float32."""
        self.engines.engine_of(table).cache.flush()
        spec = self.store.table_spec(table)
        out = torch.empty(spec.num_embeddings, spec.row_width)
        for lo in range(0, spec.num_embeddings, chunk_rows):
            ids = torch.arange(lo, min(lo + chunk_rows, spec.num_embeddings))
            out[lo : lo + ids.numel()] = self.store.get(table, ids)
        return out

    def write_table_rows(self, table: str, rows: torch.Tensor, columns: slice) -> None:
        """Overwrite ``columns`` of every row of a table (others kept); empties the caches."""
        if self.engines.inflight or self.engines.trace:
            raise RuntimeError("cannot overwrite tables while a batch is in flight")
        current = self.table_rows(table)
        current[:, columns] = rows.to(torch.float32).cpu()
        self.engines.engine_of(table).cache.invalidate()
        self.engines.generation += 1
        chunk = 1 << 16
        for lo in range(0, current.shape[0], chunk):
            ids = torch.arange(lo, min(lo + chunk, current.shape[0]))
            self.store.put(table, ids, current[lo : lo + ids.numel()])
