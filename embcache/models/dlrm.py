"""DLRM (Naumov et al., 2019) with its embedding tables in a `CachedEmbeddingBagCollection`.

    dense [B, 13] ──bottom MLP──► x [B, D] ─────────────────────────┐
    sparse (26 features) ──cached collection──► e [B, 26, D]         │
    interaction: z = upper triangle (no diagonal) of [x; e] [x; e]ᵀ │  [B, 27·26/2]
    top MLP on concat(x, z) ──► logit [B]    loss: BCE with logits  ◄┘

The dense part (both MLPs) is made of ordinary ``nn.Parameter``s, trained with any
``torch.optim`` optimizer; the embedding rows live in the cache and its tier and are trained
by an embcache sparse optimizer. Example::

    data = SyntheticCriteo(SyntheticConfig(scale=0.01, batch_size=256))
    model = DLRM(data.tables(dim=16), cache=CacheConfig(load_factor=0.1))
    dense_opt = torch.optim.Adagrad(model.dense_parameters(), lr=0.01)
    sparse_opt = SparseAdaGrad(model.sparse_arch, lr=0.05)
    batch = data.batch(0)
    loss = model.loss(model(batch.dense_features, batch.sparse_features), batch.labels)
    loss.backward(); sparse_opt.step(); dense_opt.step(); dense_opt.zero_grad()

The training loop, evaluation and metrics live in `embcache.train.loop`; `embcache train` is a
command line around them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from embcache.cache.config import CacheConfig
from embcache.kv.base import Store
from embcache.models.collection import CachedEmbeddingBagCollection


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (and after the last one when ``final_relu``).

    Weights are drawn as in the DLRM reference, ``N(0, 2 / (fan_in + fan_out))`` and biases
    ``N(0, 1 / fan_out)``, from ``generator``, so a model is the same for the same seed
    whatever the global RNG state.
    """

    def __init__(
        self,
        in_features: int,
        sizes: Sequence[int],
        final_relu: bool,
        generator: torch.Generator,
    ) -> None:
        layers: list[nn.Module] = []
        for i, out_features in enumerate(sizes):
            linear = nn.Linear(in_features, out_features)
            with torch.no_grad():
                std = math.sqrt(2.0 / (in_features + out_features))
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * std)
                linear.bias.copy_(
                    torch.randn(out_features, generator=generator) * math.sqrt(1.0 / out_features)
                )
            layers.append(linear)
            if i < len(sizes) - 1 or final_relu:
                layers.append(nn.ReLU())
            in_features = out_features
        super().__init__(*layers)


def dot_interaction(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """Pairwise dot products of the ``1 + F`` vectors of each sample, upper triangle.

    Args:
        dense: ``[B, D]`` bottom-MLP output.
        sparse: ``[B, F, D]`` pooled embeddings.

    Returns:
        ``[B, D + (F + 1) F / 2]``: ``dense`` followed by the dot products ``<v_i, v_j>`` for
        ``i < j`` over ``v = [dense, sparse_0, ..., sparse_{F-1}]``.
    """
    vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # [B, F + 1, D]
    gram = torch.bmm(vectors, vectors.transpose(1, 2))  # [B, F + 1, F + 1]
    n = vectors.shape[1]
    rows, cols = torch.triu_indices(n, n, offset=1, device=dense.device)
    return torch.cat([dense, gram[:, rows, cols]], dim=1)


class DLRM(nn.Module):
    """DLRM over a cached embedding collection.

    Args:
        tables: one `TableConfig` (or torchrec `EmbeddingBagConfig`, or dict) per sparse
            feature, all of the same ``embedding_dim`` D.
        cache: size and policy of the device cache (None: every row cached).
        store: the tier behind the cache: a `Store`, a URL (``"redis://..."``) or None / "host".
        device: where the MLPs and the cache live.
        dense_in_features: dense features per sample (13 for Criteo).
        bottom_mlp: layer sizes of the bottom MLP; the last must be D.
        top_mlp: hidden layer sizes of the top MLP (a final layer of size 1 is added).
        seed: seeds the MLP weights and the embedding rows' initialiser.
        collection_cls: the collection class (e.g. ``ShardedEmbeddingBagCollection`` to shard
            the tables by row over the ranks of torch.distributed).
        **collection_kwargs: any other `CachedEmbeddingBagCollection` argument.

    ``forward(dense [B, 13], sparse KJT) -> logits [B]``.
    """

    def __init__(
        self,
        tables: Sequence[Any],
        cache: CacheConfig | None = None,
        store: Store | str | None = None,
        device: torch.device | str | None = None,
        dense_in_features: int = 13,
        bottom_mlp: Sequence[int] = (64, 16),
        top_mlp: Sequence[int] = (64, 32),
        seed: int = 0,
        collection_cls: type[nn.Module] = CachedEmbeddingBagCollection,
        **collection_kwargs: Any,
    ) -> None:
        super().__init__()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        dims = {(t["embedding_dim"] if isinstance(t, dict) else t.embedding_dim) for t in tables}
        if len(dims) != 1:
            raise ValueError(f"DLRM needs one embedding dim across tables, got {sorted(dims)}")
        self.embedding_dim = dims.pop()
        if not bottom_mlp or bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"the bottom MLP must end in the embedding dim {self.embedding_dim}, "
                f"got sizes {list(bottom_mlp)}"
            )
        self.sparse_arch = collection_cls(
            tables, cache=cache, store=store, device=self.device, seed=seed, **collection_kwargs
        )
        self.num_sparse = len(self.sparse_arch.output_keys)
        gen = torch.Generator().manual_seed(seed)
        self.bottom_mlp = MLP(dense_in_features, bottom_mlp, final_relu=True, generator=gen)
        n = self.num_sparse + 1
        interaction_out = self.embedding_dim + n * (n - 1) // 2
        self.top_mlp = MLP(interaction_out, [*top_mlp, 1], final_relu=False, generator=gen)
        self.bottom_mlp.to(self.device)
        self.top_mlp.to(self.device)

    def dense_parameters(self) -> list[nn.Parameter]:
        """The MLPs' parameters (the embedding rows are not ``nn.Parameter``s)."""
        return [*self.bottom_mlp.parameters(), *self.top_mlp.parameters()]

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        """Logits ``[B]`` for dense features ``[B, 13]`` and the sparse features (a
        `JaggedBatch` or a torchrec KJT)."""
        x = self.bottom_mlp(dense.to(self.device, torch.float32))  # [B, D]
        pooled = self.sparse_arch(sparse).values()  # [B, F * D]
        e = pooled.view(pooled.shape[0], self.num_sparse, self.embedding_dim)
        return self.top_mlp(dot_interaction(x, e)).squeeze(1)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean binary cross-entropy of ``logits`` against 0/1 ``labels``."""
        return functional.binary_cross_entropy_with_logits(logits, labels.to(logits))
