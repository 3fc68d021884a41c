"""CachedEmbeddingCollection: torchrec's EmbeddingCollection (unpooled lookups: one row per id,
for sequence models) over a device cache.

Example::

    ec = CachedEmbeddingCollection(
        tables=[TableConfig(name="items", embedding_dim=16, num_embeddings=1_000_000,
                            feature_names=["history"], pooling="none")],  # or EmbeddingConfig
        cache=CacheConfig(load_factor=0.1),
    )
    opt = SparseAdaGrad([ec], lr=0.05)
    out = ec(kjt)                          # {"history": JaggedTensor}, values [n, 16]
    out["history"].values().sum().backward()
    opt.step()

Everything but the output is the bag collection's (`models.local.LocalCollection`): the same
caches, tiers and policies, optimizers (sparse, torch or fused), prefetch through
`TrainPipeline`, checkpoints, the one-thread claim. The lookup's second half gathers each
value's row instead of pooling bags (`engine.reduction.RowGather`), and its backward sums each
id's gradient rows over its duplicates before the optimizer sees them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from embcache.cache.config import CacheConfig
from embcache.engine.inputs import JaggedBatch
from embcache.engine.jagged import SequenceCollection
from embcache.engine.options import FUSION_K, CollectionOptions
from embcache.engine.tables import TableConfig
from embcache.kv.base import Store
from embcache.models.local import LocalCollection, fx_leaf, opaque_to_compile


class CachedEmbeddingCollection(SequenceCollection, LocalCollection):
    """Unpooled embedding lookups over a device cache with a write-back tier behind it.

    Same input, output keys, lengths and values as `torchrec.EmbeddingCollection` given the
    same weights (and, built without a ``seed`` with every row cached, the same initial
    weights after the same ``torch.manual_seed``); tables may be far larger than the device
    and of different dims (torchrec's needs one dim).

    Args:
        tables: torchrec `EmbeddingConfig` objects, `TableConfig` objects with
            ``pooling="none"``, or dicts (``name``, ``embedding_dim``, ``num_embeddings``,
            ``feature_names``, optional ``init_fn``, ``data_type``). May be empty.
        device: where the caches live (torchrec's second positional argument).
        need_indices: each output `JaggedTensor`'s ``weights()`` holds the ids looked up, as
            torchrec's ``need_indices`` does.
        cache, store, enable_fusion, fusion_k, update_in_backward, accumulate_grads, lr, seed,
        optimizer_type, optimizer_kwargs, allow_unsharded_replicas, options: as
            `CachedEmbeddingBagCollection` takes them (``device`` too may be in ``options``).

    Raises:
        ValueError: a pooled table (``pooling`` SUM, MEAN or MAX: those belong in a
            `CachedEmbeddingBagCollection`), and what a bag collection refuses.
    """

    pooled = False
    weights_prefix = "embeddings"

    def __init__(
        self,
        tables: Sequence[TableConfig | Mapping[str, Any] | Any],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        cache: CacheConfig | None = None,
        store: Store | str | None = None,
        enable_fusion: bool = True,
        fusion_k: int = FUSION_K,
        update_in_backward: bool = False,
        accumulate_grads: bool = False,
        lr: float | None = None,
        seed: int | None = None,
        optimizer_type: type | None = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        allow_unsharded_replicas: bool = False,
        *,
        options: CollectionOptions | None = None,
        **torchrec_options: Any,
    ) -> None:
        options = CollectionOptions.given(options, locals())  # the keywords as called
        check_torchrec_options(torchrec_options)
        super().__init__(tables, False, options)
        self._need_indices = bool(need_indices)
        register_with_torchrec()

    # -- the data path -----------------------------------------------------------------------

    @opaque_to_compile
    def forward(self, features: JaggedBatch | Any) -> dict[str, Any] | torch.fx.Proxy:
        """One row per id of every feature: ``{key: JaggedTensor}`` (``values()`` ``[n, dim]``,
        the input's lengths), keyed by the tables' feature names in table order (``feature@table``
        for a feature several tables look up), torchrec `JaggedTensor` objects for a KJT input and
        `JaggedRows` for a `JaggedBatch`. Under ``torch.fx`` tracing the call is one leaf node.

        Raises:
            ValueError: a missing feature or an id out of its table's range (nothing changed).
            RuntimeError: in a process group of several ranks without
                ``allow_unsharded_replicas=True``.
        """
        if isinstance(features, torch.fx.Proxy):
            return fx_leaf(self, features, "CachedEmbeddingCollection")
        if torch.compiler.is_exporting():
            raise NotImplementedError(
                "torch.export of a CachedEmbeddingCollection is not supported yet (the bag "
                "collection exports as one custom op)"
            )
        self.check_not_replicated()
        batch = self.engines.checked_prefetch(features)
        if batch is None:
            batch = self.checked_input(features)
        counts = dict(zip(batch.keys(), batch.length_per_key(), strict=True))
        if self.device.type == "meta" or not self.tables:
            values = {
                k: torch.empty(counts[f], d, device=self.device)
                for k, f, d in zip(
                    self.output_keys, self.key_features(), self.output_dims, strict=True
                )
            }
        else:  # each output key's rows: views of the engines' outputs
            outs = self._lookup(batch, training=torch.is_grad_enabled())
            values = self.split_per_key(outs, counts)
        return self.jagged_output(features, batch, values)


def check_torchrec_options(torchrec_options: Mapping[str, Any]) -> None:
    """Accept torchrec's ``EmbeddingCollection`` options that change nothing here (its gather
    choices); refuse any other keyword, as a signature would."""
    unknown = set(torchrec_options) - {"use_gather_select", "use_gather_select_per_sharding"}
    if unknown:
        raise TypeError(f"unexpected arguments {sorted(unknown)}")


def register_with_torchrec() -> None:
    """Register the collection as a torchrec ``EmbeddingCollectionInterface`` (an ABC's
    virtual subclass) once torchrec is imported; never imports torchrec itself."""
    module = sys.modules.get("torchrec.modules.embedding_modules")
    if module is not None:
        module.EmbeddingCollectionInterface.register(CachedEmbeddingCollection)


register_with_torchrec()
