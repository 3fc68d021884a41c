"""A small sequence recommender: the target item attends over the user's history, beside bags.

    bags (user features, F of them) ──CachedEmbeddingBagCollection──► u [B, F·D]
    target item (one id per sample) ──┐
    history (≤ L ids per sample) ─────┴─CachedEmbeddingCollection──► t [B, D], h [B, L, D]
                                        (one item table, unpooled, looked up by both)
    attention: w = softmax_j(<t, h_j> / √D) over the sample's history (padding masked;
               no history: w = 0), a = Σ_j w_j h_j                                  [B, D]
    MLP on concat(u, t, a, t ⊙ a) ──► logit [B]    loss: BCE with logits

The target item and the history index one table, so the attention compares the target with
the past items in one space, and a row the history trains is the row the target reads. The
bag collection and the sequence collection share the tier and train with one sparse optimizer
(``SparseAdaGrad([model.sparse_arch.bags, model.sparse_arch.sequences], lr=...)``) through one
`TrainPipeline`, the input of each being the batch's whole `JaggedBatch` (each collection
reads its own features). Example::

    data = MovieLens("ml-1m", batch_size=512).with_history(20)
    model = SequenceRecommender(data.tables(dim=16), target="item", history="history",
                                history_length=20, cache=CacheConfig(load_factor=0.2))
    sparse_opt = SparseAdaGrad(model.sparse_arch.collections(), lr=0.05)
    dense_opt = torch.optim.Adagrad(model.dense_parameters(), lr=0.01)
    batch = next(data.train_batches())
    loss = model.loss(model(batch.dense_features, batch.sparse_features), batch.labels)

``forward(dense, sparse)`` takes the DLRM's arguments (``dense`` is ignored: the model has no
dense features), so `embcache.train.loop` trains and evaluates either.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from embcache.cache.config import CacheConfig
from embcache.cache.hot_cache import HotCache
from embcache.devices import resolve_device
from embcache.engine.interface import CachedCollectionInterface
from embcache.engine.options import model_collection_kwargs
from embcache.engine.tables import TableConfig, normalize_tables
from embcache.kv.base import Store
from embcache.models.collection import CachedEmbeddingBagCollection
from embcache.models.dlrm import MLP
from embcache.models.sequence import CachedEmbeddingCollection


def target_attention(
    target: torch.Tensor, history: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Scaled dot-product attention of one query per sample over its history.

    Args:
        target: ``[B, D]`` the query of each sample.
        history: ``[B, L, D]`` the keys (and values), padded.
        mask: ``[B, L]`` True where ``history`` holds a row, False on padding.

    Returns:
        ``[B, D]``: ``Σ_j w_j h_j`` with ``w = softmax_j(<t, h_j> / √D)`` over the unmasked
        ``j``; zeros for a sample without history.
    """
    scores = torch.bmm(history, target.unsqueeze(2)).squeeze(2) / math.sqrt(target.shape[1])
    # A finite fill, not -inf: a sample without history would get NaN weights (and gradients).
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=1) * mask  # [B, L]; all zero without history
    return torch.bmm(weights.unsqueeze(1), history).squeeze(1)


def pad_last(
    values: torch.Tensor, lengths: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's last ``length`` rows, padded at the end with zeros.

    Args:
        values: ``[n, D]`` the rows of every sample, one sample after another.
        lengths: ``[B]`` rows per sample.
        length: L, the rows kept per sample (its latest ones).

    Returns:
        ``([B, L, D], [B, L] mask)``: sample b's last ``min(lengths[b], L)`` rows in order,
        then zeros; the mask is True where a row is.
    """
    batch, dim = lengths.numel(), values.shape[1]
    lengths = lengths.to(values.device, torch.int64)
    ends = torch.cumsum(lengths, 0)  # [B]
    kept = lengths.clamp(max=length)
    sample = torch.repeat_interleave(torch.arange(batch, device=values.device), lengths)  # [n]
    position = torch.arange(values.shape[0], device=values.device) - (ends - kept)[sample]
    keep = position >= 0  # rows older than the last L are dropped
    sample, position = sample[keep], position[keep]
    padded = values.new_zeros(batch, length, dim).index_put((sample, position), values[keep])
    mask = torch.arange(length, device=values.device) < kept.unsqueeze(1)
    return padded, mask


class SparseArch(nn.Module):
    """The model's two cached collections, with the cache surface the training driver reads
    (`caches`, `cache_stats`, `reset_stats`, `flush`, `store`, `fusion_k`) over both.

    Attributes:
        bags: the pooled features (``[B, F·D]`` out), a `CachedEmbeddingBagCollection` or a
            sharded one.
        sequences: the item table, unpooled, looked up by the target and the history, a
            `CachedEmbeddingCollection` or a sharded one.
    """

    def __init__(
        self, bags: CachedCollectionInterface, sequences: CachedCollectionInterface
    ) -> None:
        super().__init__()
        self.bags = bags
        self.sequences = sequences

    def collections(self) -> list[nn.Module]:
        """Both collections, for a sparse optimizer (bags first)."""
        return [self.bags, self.sequences]

    @property
    def store(self) -> Store:
        return self.bags.store

    @property
    def fusion_k(self) -> int:
        return self.bags.fusion_k

    def caches(self) -> list[HotCache]:
        return [*self.bags.caches(), *self.sequences.caches()]

    def cache_stats(self) -> dict[str, float]:
        """Both collections' counters summed, and the hit rate over both."""
        total: dict[str, float] = {}
        for stats in (self.bags.cache_stats(), self.sequences.cache_stats()):
            for k, v in stats.items():
                total[k] = total.get(k, 0) + v
        looked_up = total.get("hits", 0) + total.get("misses", 0)
        total["hit_rate"] = total.get("hits", 0) / looked_up if looked_up else 0.0
        return total

    def reset_stats(self) -> None:
        self.bags.reset_stats()
        self.sequences.reset_stats()

    def flush(self) -> None:
        self.bags.flush()
        self.sequences.flush()


class SequenceRecommender(nn.Module):
    """Target attention over a user's history, beside pooled user features (module docstring).

    Args:
        tables: one pooled `TableConfig` (or torchrec `EmbeddingBagConfig`) per per-sample
            feature, all of one dim D, as `ClickDataset.tables` gives them; the ``target``'s
            table is made unpooled and looked up by ``history`` too.
        target: the feature of the item to score (one id per sample).
        history: the sequence feature of the user's past items (ids of the target's table).
        history_length: L, the history rows attended to (each sample's latest).
        cache: the device cache of each collection (None: `CacheConfig`'s default).
        store: the tier both collections keep their rows in (a `Store`, a URL or None).
        device: where the caches and the MLP live.
        mlp: hidden layer sizes of the MLP (a final layer of size 1 is added).
        seed: seeds the MLP's weights and the rows' initialiser.
        bag_collection_cls, sequence_collection_cls: the two collections' classes (e.g.
            ``ShardedEmbeddingBagCollection`` and ``ShardedEmbeddingCollection`` to shard the
            rows over the ranks).
        **collection_kwargs: any other argument both collections take (``fusion_k``, ...),
            ``options`` (a `CollectionOptions`) included: then ``cache``, ``store`` and ``device``
            here must not repeat it (``device`` defaults to the options'), and ``seed`` seeds
            the MLP only (the rows' seed is the options').

    ``forward(dense, sparse) -> logits [B]``: ``sparse`` a `JaggedBatch` or KJT with every
    bag feature, ``target`` and ``history``; ``dense`` is ignored.
    """

    def __init__(
        self,
        tables: Sequence[Any],
        target: str = "item",
        history: str = "history",
        history_length: int = 20,
        cache: CacheConfig | None = None,
        store: Store | str | None = None,
        device: torch.device | str | None = None,
        mlp: Sequence[int] = (64, 32),
        seed: int = 0,
        bag_collection_cls: type[CachedCollectionInterface] = CachedEmbeddingBagCollection,
        sequence_collection_cls: type[CachedCollectionInterface] = CachedEmbeddingCollection,
        **collection_kwargs: Any,
    ) -> None:
        super().__init__()
        options = collection_kwargs.get("options")
        given_device = device  # under options=, a device here is one given twice
        if device is None and options is not None and options.device is not None:
            device = options.device  # the MLP lives with the collections
        self.device = resolve_device(device) if device is not None else torch.device("cpu")
        if isinstance(history_length, bool) or not isinstance(history_length, int):
            raise TypeError(f"history_length must be an int, got {history_length!r}")
        if history_length < 1:
            raise ValueError(f"history_length must be >= 1, got {history_length}")
        normalized = normalize_tables(tables)
        dims = {t.dim for t in normalized}
        if len(dims) != 1:
            raise ValueError(f"SequenceRecommender needs one embedding dim, got {sorted(dims)}")
        owners = [k for k, t in enumerate(normalized) if target in t.feature_names]
        if len(owners) != 1 or normalized[owners[0]].feature_names != (target,):
            raise ValueError(
                f"the target {target!r} must have a table of its own among the tables "
                f"(features {[list(t.feature_names) for t in normalized]})"
            )
        item = normalized[owners[0]]
        item_table = TableConfig(
            name=item.name,
            embedding_dim=item.dim,
            num_embeddings=item.num_embeddings,
            feature_names=[target, history],
            pooling="none",
            init_fn=item.init_fn,
            data_type=item.dtype,
        )
        bag_tables = [t for k, t in enumerate(tables) if k != owners[0]]
        self.embedding_dim = item.dim
        self.num_bags = sum(len(t.feature_names) for t in normalized) - 1
        self.target, self.history, self.history_length = target, history, history_length
        # Under options=, the collections' seed is the options' (``seed`` seeds the MLP).
        seed_given = seed if options is None else None
        common = model_collection_kwargs(
            collection_kwargs,
            cache=cache,
            seed=seed_given,
            device=self.device if options is None else given_device,
        )
        bags = bag_collection_cls(bag_tables, **model_collection_kwargs(common, store=store))
        # The second collection keeps its rows in the first one's tier (opened there from a
        # URL or None, and closed by it, after this one's exit write-back: atexit runs the
        # last registered first).
        if options is not None:
            common["options"] = dataclasses.replace(options, store=bags.store)
        else:
            common["store"] = bags.store
        self.sparse_arch = SparseArch(bags, sequence_collection_cls([item_table], **common))
        gen = torch.Generator().manual_seed(seed)
        width = (self.num_bags + 3) * self.embedding_dim
        self.mlp = MLP(width, [*mlp, 1], final_relu=False, generator=gen).to(self.device)

    def dense_parameters(self) -> list[nn.Parameter]:
        """The MLP's parameters (the rows live in the caches and the tier)."""
        return list(self.mlp.parameters())

    def forward(self, dense: torch.Tensor | None, sparse: Any) -> torch.Tensor:
        """Logits ``[B]`` of the samples of ``sparse`` (``dense`` is ignored).

        Raises:
            ValueError: a sample's target is not one id.
        """
        del dense  # no dense features: the DLRM's call, so one loop trains both
        u = self.sparse_arch.bags(sparse).values()  # [B, F·D]
        rows = self.sparse_arch.sequences(sparse)
        t = rows[self.target].values()  # [B, D]
        if t.shape[0] != u.shape[0]:
            raise ValueError(
                f"the target {self.target!r} must hold one id per sample: {t.shape[0]} ids "
                f"for {u.shape[0]} samples"
            )
        seen = rows[self.history]
        h, mask = pad_last(seen.values(), seen.lengths(), self.history_length)  # [B, L, D]
        a = target_attention(t, h, mask)  # [B, D]
        x = torch.cat([u.to(self.device), t, a, t * a], dim=1)  # [B, (F + 3)·D]
        return self.mlp(x).squeeze(1)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean binary cross-entropy of ``logits`` against 0/1 ``labels``."""
        return functional.binary_cross_entropy_with_logits(logits, labels.to(logits))
