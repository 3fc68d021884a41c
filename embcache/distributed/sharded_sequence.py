"""ShardedEmbeddingCollection: `CachedEmbeddingCollection` (unpooled lookups, one row per id)
with its rows sharded by row over the ranks.

Example (every rank, its own batch)::

    ec = ShardedEmbeddingCollection(
        tables=[EmbeddingConfig(name="items", embedding_dim=16, num_embeddings=1_000_000,
                                feature_names=["history"])],
        cache=CacheConfig(load_factor=0.1),
    )
    opt = SparseAdaGrad([ec], lr=0.05)
    out = ec(kjt)                          # {"history": JaggedTensor}, values [n, 16]
    out["history"].values().sum().backward()
    opt.step()                             # each rank updates the rows it owns

The exchanges are `ShardedEmbeddingBagCollection`'s (`embcache.distributed.sharded`: the ids to
their owners, the rows back, one gradient row per unique id to the owners); only the requester's
second half differs: each cache gathers one row per value (`engine.reduction.RowGather`) into
an output of its own, ``[nnz_e, dim_e]``, its features' values in its layout's order, which
`forward` cuts into one block per output key as `CachedEmbeddingCollection` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from embcache.cache.config import CacheConfig
from embcache.distributed.sharded import ShardedCollection
from embcache.engine.inputs import JaggedBatch
from embcache.engine.jagged import SequenceCollection
from embcache.engine.options import FUSION_K, CollectionOptions
from embcache.engine.reduction import Share
from embcache.engine.tables import TableConfig
from embcache.kv.base import Store


class ShardedEmbeddingCollection(SequenceCollection, ShardedCollection):
    """`CachedEmbeddingCollection` over several ranks, each owning a shard of the rows.

    Same input, output keys, lengths and values as one `CachedEmbeddingCollection` given the
    same tables, rows and batch; every rank passes its own batch (any size, empty included)
    and gets its own rows. Train it with the ordinary sparse optimizers
    (``SparseAdaGrad([ec], lr=...)``); ``step()`` updates, on each rank, the rows it owns.
    Forward, backward, ``state_dict`` and ``table_rows`` are collectives, as for
    `ShardedEmbeddingBagCollection` (whose module docstring describes the exchanges).

    Args:
        tables: torchrec `EmbeddingConfig` objects, `TableConfig` objects with
            ``pooling="none"``, or dicts (every rank must give the same).
        device: where this rank's caches and outputs live (``cuda`` with NCCL or gloo);
            positional after ``tables``, as torchrec's and `CachedEmbeddingCollection`'s.
        need_indices: each output `JaggedTensor`'s ``weights()`` holds the ids looked up.
        cache, store, enable_fusion, fusion_k, update_in_backward, accumulate_grads, lr, seed,
            process_group, optimizer_type, optimizer_kwargs, allow_unsharded_replicas: as
            `ShardedEmbeddingBagCollection` takes them (the last three after
            ``process_group``, where older code's positions stay as they were).
        options: the options as one `CollectionOptions`, as `ShardedEmbeddingBagCollection`
            takes it.

    Raises:
        ValueError: a pooled table (SUM, MEAN or MAX: those belong in a
            `ShardedEmbeddingBagCollection`).
    """

    pooled = False
    weights_prefix = "embeddings"

    def __init__(
        self,
        tables: Sequence[TableConfig | Mapping[str, Any] | Any],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        cache: CacheConfig | None = None,
        store: Store | str | Callable[[int], Store | str] | None = None,
        enable_fusion: bool = True,
        fusion_k: int = FUSION_K,
        update_in_backward: bool = False,
        accumulate_grads: bool = False,
        lr: float | None = None,
        seed: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        optimizer_type: type | None = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        allow_unsharded_replicas: bool = False,
        *,
        options: CollectionOptions | None = None,
    ) -> None:
        options = CollectionOptions.given(options, locals())  # the keywords as called
        super().__init__(tables, False, options, process_group)
        self._need_indices = bool(need_indices)

    # -- torchrec's EmbeddingCollectionInterface --------------------------------------------

    def embedding_configs(self) -> list[Any]:
        """The table configs as given."""
        return self.embedding_bag_configs()

    # -- the data path -----------------------------------------------------------------------

    def forward(self, features: JaggedBatch | Any) -> dict[str, Any]:
        """This rank's rows of every feature (collective): ``{key: JaggedTensor}``
        (``values()`` ``[n, dim]``, the input's lengths), keyed by the tables' feature names in
        table order (``feature@table`` for a feature several tables look up); torchrec
        `JaggedTensor` objects for a KJT input, `JaggedRows` for a `JaggedBatch`.

        Raises:
            ValueError: a missing feature or an id out of its table's range on this rank
                (nothing changed on any rank; the others raise a `CollectiveError`).
        """
        outs, batch = self._run(features)
        counts = dict(zip(batch.keys(), batch.length_per_key(), strict=True))
        return self.jagged_output(features, batch, self.split_per_key(outs, counts))

    def _outputs(self, batch_size: int, requests: Sequence[Share]) -> tuple[torch.Tensor, ...]:
        """One ``[nnz_e, dim_e]`` output per cache: a row per value of its features."""
        return tuple(
            engine.reduction.output(batch_size, req.inverse.numel(), self.device)
            for engine, req in zip(self.engines.engines, requests, strict=True)
        )

    def _target(
        self, gi: int, outputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        return outputs[gi], self.engines.engines[gi].columns, 0
