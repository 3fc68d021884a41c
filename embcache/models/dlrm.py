"""DLRM (Naumov et al., 2019) over an embedding collection (by default a cached one).

    dense [B, N] ──bottom MLP──► x [B, D] ──────────────────────────┐
    sparse (F features) ──embedding collection──► e [B, F, D]        │
    interaction: z = upper triangle (no diagonal) of [x; e] [x; e]ᵀ │  [B, (F+1)·F/2]
    top MLP on concat(x, z) ──► logit [B]    loss: BCE with logits  ◄┘

With no dense features (N = 0) there is no bottom MLP: the interaction is over the F
embeddings alone and the top MLP sees their F·(F-1)/2 dot products.

The dense part (both MLPs) is made of ordinary ``nn.Parameter``s, trained with any
``torch.optim`` optimizer; the embedding rows of a `CachedEmbeddingBagCollection` live in the
cache and its tier and are trained by an embcache sparse optimizer. Example::

    data = SyntheticCriteo(SyntheticConfig(scale=0.01, batch_size=256))
    model = embcache.DLRM(data.tables(dim=16), cache=CacheConfig(load_factor=0.1))
    dense_opt = torch.optim.Adagrad(model.dense_parameters(), lr=0.01)
    sparse_opt = SparseAdaGrad(model.sparse_arch, lr=0.05)
    batch = data.batch(0)
    loss = model.loss(model(batch.dense_features, batch.sparse_features), batch.labels)
    loss.backward(); sparse_opt.step(); dense_opt.step(); dense_opt.zero_grad()

A collection built beforehand works too, ours or any module with the same call (a KJT in, an
object with ``values() [B, F * D]`` out), e.g. torchrec's ``EmbeddingBagCollection``::

    model = embcache.DLRM(torchrec.EmbeddingBagCollection(tables=configs), dense_in_features=0,
                          bottom_mlp=())

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
from embcache.devices import resolve_device
from embcache.engine.options import model_collection_kwargs
from embcache.engine.tables import normalize_tables
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


def dot_interaction(dense: torch.Tensor | None, sparse: torch.Tensor) -> torch.Tensor:
    """Pairwise dot products of the vectors of each sample, upper triangle.

    Args:
        dense: ``[B, D]`` bottom-MLP output, or None (no dense features).
        sparse: ``[B, F, D]`` pooled embeddings.

    Returns:
        ``[B, D + (F + 1) F / 2]``: ``dense`` followed by the dot products ``<v_i, v_j>`` for
        ``i < j`` over ``v = [dense, sparse_0, ..., sparse_{F-1}]``; without ``dense``,
        ``[B, F (F - 1) / 2]``, the dot products of the F embeddings.
    """
    vectors = sparse if dense is None else torch.cat([dense.unsqueeze(1), sparse], dim=1)
    gram = torch.bmm(vectors, vectors.transpose(1, 2))  # [B, V, V]
    n = vectors.shape[1]
    rows, cols = torch.triu_indices(n, n, offset=1, device=sparse.device)
    pairs = gram[:, rows, cols]
    return pairs if dense is None else torch.cat([dense, pairs], dim=1)


def _output_dims(collection: nn.Module) -> list[int]:
    """The embedding dim of each pooled feature a built collection outputs, in order."""
    dims = getattr(collection, "output_dims", None)
    if isinstance(dims, list):  # embcache's collections
        return list(dims)
    configs = getattr(collection, "embedding_bag_configs", None)  # torchrec's
    if callable(configs):
        return [c.embedding_dim for c in configs() for _ in c.feature_names]
    raise TypeError(
        f"DLRM cannot tell the output features of a {type(collection).__name__}: give table "
        "configs, an embcache collection or a module with torchrec's embedding_bag_configs()"
    )


def _check_dense(dense_in_features: int, bottom_mlp: Sequence[int]) -> None:
    if isinstance(dense_in_features, bool) or not isinstance(dense_in_features, int):
        raise TypeError(f"dense_in_features must be an int, got {dense_in_features!r}")
    if dense_in_features < 0:
        raise ValueError(f"dense_in_features must be >= 0, got {dense_in_features}")
    if dense_in_features and not bottom_mlp:
        raise ValueError(f"{dense_in_features} dense features need a bottom MLP (bottom_mlp)")
    if not dense_in_features and bottom_mlp:
        raise ValueError(
            f"no dense features: there is no bottom MLP, got sizes {list(bottom_mlp)} "
            "(give bottom_mlp=())"
        )


class DLRM(nn.Module):
    """DLRM over an embedding collection: a cached one built from ``tables``, or one given.

    Args:
        tables: one `TableConfig` (or torchrec `EmbeddingBagConfig`, or dict) per sparse
            feature, all of the same ``embedding_dim`` D; or an already-built collection
            (a `CachedEmbeddingBagCollection`, a sharded one, torchrec's
            ``EmbeddingBagCollection`` or any module with the same call and
            ``embedding_bag_configs()``), used as it is.
        cache: size and policy of the device cache (None: `CacheConfig`'s default). Only with
            table configs.
        store: the tier behind the cache: a `Store`, a URL (``"redis://..."``) or None / "host".
            Only with table configs.
        device: where the MLPs (and a cache built here) live.
        dense_in_features: dense features per sample (13 for Criteo; 0 for none: no bottom
            MLP, ``bottom_mlp`` must then be empty).
        bottom_mlp: layer sizes of the bottom MLP; the last must be D.
        top_mlp: hidden layer sizes of the top MLP (a final layer of size 1 is added).
        seed: seeds the MLP weights and, for a collection built here, the rows' initialiser.
        collection_cls: the collection class built from ``tables`` (e.g.
            ``ShardedEmbeddingBagCollection`` to shard the tables by row over the ranks).
        **collection_kwargs: any other `CachedEmbeddingBagCollection` argument, ``options``
            (a `CollectionOptions`) included: then ``cache``, ``store`` and ``device``
            here must not repeat it (``device`` defaults to the options'), and ``seed`` seeds
            the MLPs only (the rows' seed is the options').

    ``forward(dense [B, N], sparse KJT) -> logits [B]``.
    """

    def __init__(
        self,
        tables: Sequence[Any] | nn.Module,
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
        options = collection_kwargs.get("options")
        given_device = device  # under options=, a device here is one given twice
        if device is None and options is not None and options.device is not None:
            device = options.device  # the MLPs live with the collection
        self.device = resolve_device(device) if device is not None else torch.device("cpu")
        _check_dense(dense_in_features, bottom_mlp)
        if isinstance(tables, nn.Module):
            given = [n for n, v in (("cache", cache), ("store", store)) if v is not None]
            if given or collection_kwargs:
                raise ValueError(
                    f"DLRM got a built collection and {given + sorted(collection_kwargs)}: "
                    "those configure a collection DLRM builds from table configs"
                )
            dims = _output_dims(tables)
        else:
            dims = [t.dim for t in normalize_tables(tables) for _ in t.feature_names]
        # Checked before a collection is built: building one declares (and leases) its tables.
        if len(set(dims)) != 1:
            raise ValueError(f"DLRM needs one embedding dim across tables, got {sorted(set(dims))}")
        self.embedding_dim, self.num_sparse = dims[0], len(dims)
        self.dense_in_features = dense_in_features
        if dense_in_features and bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"the bottom MLP must end in the embedding dim {self.embedding_dim}, "
                f"got sizes {list(bottom_mlp)}"
            )
        n = self.num_sparse + (1 if dense_in_features else 0)
        if n < 2:
            raise ValueError(
                "DLRM's interaction needs two vectors per sample: give dense features or at "
                f"least two sparse features (got {self.num_sparse} and {dense_in_features})"
            )
        self.sparse_arch: nn.Module
        if isinstance(tables, nn.Module):
            self.sparse_arch = tables
        else:
            # Under options=, the collection's seed is the options' (``seed`` seeds the MLPs).
            built_with = model_collection_kwargs(
                collection_kwargs, cache=cache, store=store,
                device=self.device if options is None else given_device,
                seed=seed if options is None else None,
            )  # fmt: skip
            self.sparse_arch = collection_cls(tables, **built_with)
        gen = torch.Generator().manual_seed(seed)
        # nn.Linear(0, ...) would warn and learn nothing: no dense features, no bottom MLP.
        self.bottom_mlp = (
            MLP(dense_in_features, bottom_mlp, final_relu=True, generator=gen)
            if dense_in_features
            else None
        )
        interaction_out = n * (n - 1) // 2 + (self.embedding_dim if dense_in_features else 0)
        self.top_mlp = MLP(interaction_out, [*top_mlp, 1], final_relu=False, generator=gen)
        if self.bottom_mlp is not None:
            self.bottom_mlp.to(self.device)
        self.top_mlp.to(self.device)

    def dense_parameters(self) -> list[nn.Parameter]:
        """The MLPs' parameters (a cached collection's rows are not ``nn.Parameter``s; a
        torchrec collection's are in ``parameters()``, beside these)."""
        bottom = [] if self.bottom_mlp is None else list(self.bottom_mlp.parameters())
        return [*bottom, *self.top_mlp.parameters()]

    def forward(self, dense: torch.Tensor | None, sparse: Any) -> torch.Tensor:
        """Logits ``[B]`` for dense features ``[B, N]`` (None or ``[B, 0]`` when N = 0) and
        the sparse features (a `JaggedBatch` or a torchrec KJT)."""
        pooled = self.sparse_arch(sparse).values()  # [B, F * D]
        e = pooled.view(pooled.shape[0], self.num_sparse, self.embedding_dim)
        x = None
        if self.bottom_mlp is not None:
            if dense is None:
                raise ValueError(f"DLRM needs dense features [B, {self.dense_in_features}]")
            x = self.bottom_mlp(dense.to(self.device, torch.float32))  # [B, D]
        return self.top_mlp(dot_interaction(x, e.to(self.device))).squeeze(1)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean binary cross-entropy of ``logits`` against 0/1 ``labels``."""
        return functional.binary_cross_entropy_with_logits(logits, labels.to(logits))
