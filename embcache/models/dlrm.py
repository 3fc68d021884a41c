"""DLRM (Naumov et al., 2019) with its embedding tables in a `CachedEmbeddingBagCollection`.

    dense [B, 13] ──bottom MLP──► x [B, D] ─────────────────────────┐
    sparse KJT (26 features) ──cached collection──► e [B, 26, D]    │
    interaction: z = upper triangle (no diagonal) of [x; e] [x; e]ᵀ │  [B, 27·26/2]
    top MLP on concat(x, z) ──► logit [B]    loss: BCE with logits  ◄┘

The dense part (both MLPs) is made of ordinary ``nn.Parameter``s, trained with any
``torch.optim`` optimizer; the embedding rows live in the cache and its tier and are trained
by an embcache sparse optimizer (`make_sparse_optimizer`). Example::

    data = SyntheticCriteo(SyntheticConfig(scale=0.01, batch_size=256))
    model = DLRM(data.tables(dim=16), cache=CacheConfig(load_factor=0.1))
    dense_opt = torch.optim.Adagrad(model.dense_parameters(), lr=0.01)
    sparse_opt = make_sparse_optimizer("adagrad", model.sparse_arch, lr=0.05)
    batch = data.batch(0)
    loss = model.loss(model(batch.dense_features, batch.sparse_features), batch.labels)
    loss.backward(); sparse_opt.step(); dense_opt.step(); dense_opt.zero_grad()

`train` runs that loop over a `SyntheticCriteo` stream (with optional prefetch of the next
batch) and `evaluate` measures AUC and logloss on its held-out split; `embcache train` is a
command line around the two.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from embcache.cache.config import CacheConfig
from embcache.data.synthetic import SyntheticCriteo
from embcache.kv.base import Store
from embcache.models.collection import CachedEmbeddingBagCollection
from embcache.optim.sparse import (
    SparseAdaGrad,
    SparseAdam,
    SparseOptimizer,
    SparseRowWiseAdaGrad,
    SparseSGD,
)

SPARSE_OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    "sgd": SparseSGD,
    "adagrad": SparseAdaGrad,
    "rowwise_adagrad": SparseRowWiseAdaGrad,
    "adam": SparseAdam,
}


def make_sparse_optimizer(
    name: str, modules: nn.Module | Sequence[nn.Module], lr: float
) -> SparseOptimizer:
    """The embcache sparse optimizer called ``name`` (a key of `SPARSE_OPTIMIZERS`)."""
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(
            f"unknown sparse optimizer {name!r}; choose from {list(SPARSE_OPTIMIZERS)}"
        )
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    return SPARSE_OPTIMIZERS[name](mods, lr=lr)


def make_dense_optimizer(
    name: str, params: Iterator[nn.Parameter] | list[nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer matching a sparse rule for the dense parameters
    (SGD for "sgd", Adagrad for both AdaGrad rules, Adam for "adam")."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name in ("adagrad", "rowwise_adagrad"):
        return torch.optim.Adagrad(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose from {list(SPARSE_OPTIMIZERS)}")


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


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for 0/1 ``labels`` (Mann-Whitney U over ranks;
    tied scores share their mean rank). NaN when one class is absent."""
    scores = scores.detach().double().reshape(-1).cpu()
    positive = labels.detach().reshape(-1).cpu() > 0.5
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_scores, order = torch.sort(scores)
    _, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # 1-based rank of each tie group's last member
    mean_rank = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(scores)
    ranks[order] = torch.repeat_interleave(mean_rank, counts)
    u = float(ranks[positive].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


# ----------------------------------------------------------------------------------------------
# training and evaluation on the synthetic data


@dataclass
class TrainResult:
    """What a training run measured (training phase only, evaluation excluded)."""

    losses: list[float]
    hit_rates: list[float]  # per step: hits / lookups of that step's unique ids
    seconds: float
    samples: int
    cache_stats: dict[str, float]
    io_stats: dict[str, int] | None
    eval: dict[str, float] = field(default_factory=dict)

    def loss_window(self, last: bool) -> float:
        """Mean loss over the first (or last) 10% of steps (at least one step)."""
        k = max(1, len(self.losses) // 10)
        window = self.losses[-k:] if last else self.losses[:k]
        return sum(window) / len(window)


def train(
    model: DLRM,
    data: SyntheticCriteo,
    sparse_opt: Any,
    dense_opt: torch.optim.Optimizer,
    steps: int,
    prefetch: bool,
    progress: bool = True,
    first_step: int = 0,
    wrapper: nn.Module | None = None,
) -> TrainResult:
    """Train ``model`` on batches ``first_step .. first_step + steps - 1`` of ``data``'s
    training split; forwards go through ``wrapper`` when given (DistributedDataParallel)."""
    from tqdm import tqdm

    from embcache.pipeline import TrainPipeline

    ebc = model.sparse_arch
    ebc.reset_stats()
    store = ebc.store
    if hasattr(store, "reset_io_stats"):
        store.reset_io_stats()
    device = model.device
    hit_rates: list[float] = []
    bar = tqdm(total=steps, unit="step", disable=not progress, dynamic_ncols=True, leave=True)
    model.train()
    pipe = TrainPipeline(
        wrapper if wrapper is not None else model,
        sparse_opt,
        dense_opt,
        features=lambda batch: batch.sparse_features,
        loss=lambda m, batch: model.loss(
            m(batch.dense_features, batch.sparse_features), batch.labels
        ),
        prefetch=prefetch,
    )
    # Per-step hit rate: the lookups between two steps (with prefetch, the next batch's).
    before = [ebc.cache_stats()]
    recent_losses: list[float] = []

    def on_step(i: int, loss: torch.Tensor) -> None:
        after = ebc.cache_stats()
        if after["hits"] + after["misses"] > before[0]["hits"] + before[0]["misses"]:
            hit_rates.append(_hit_rate(before[0], after))  # the last step has no prefetch
        before[0] = after
        recent_losses.append(float(loss))
        bar.update(1)
        if progress and (i % 10 == 0 or i == steps):
            elapsed = time.perf_counter() - start
            recent = hit_rates[-50:] or [0.0]
            bar.set_postfix(
                loss=f"{sum(recent_losses[-10:]) / len(recent_losses[-10:]):.4f}",
                samples_s=f"{i * data.config.batch_size / elapsed:,.0f}",
                hit_rate=f"{sum(recent) / len(recent):.3f}",
                refresh=False,
            )

    start = time.perf_counter()
    batches = (data.batch(first_step + i).to(device) for i in range(steps))
    losses = pipe.run(batches, on_step=on_step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    bar.close()
    io = store.io_stats() if hasattr(store, "io_stats") else None
    return TrainResult(
        losses=losses,
        hit_rates=hit_rates,
        seconds=seconds,
        samples=steps * data.config.batch_size,
        cache_stats=ebc.cache_stats(),
        io_stats=io,
    )


def _hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    hits = after["hits"] - before["hits"]
    looked_up = hits + after["misses"] - before["misses"]
    return hits / looked_up if looked_up else 0.0


@torch.no_grad()
def evaluate(model: DLRM, data: SyntheticCriteo, num_batches: int) -> dict[str, float]:
    """AUC and logloss of ``model`` on the held-out split, and the hidden model's AUC."""
    model.eval()
    logits, labels, hidden = [], [], []
    for i in range(num_batches):
        batch = data.batch(i, split="eval").to(model.device)
        logits.append(model(batch.dense_features, batch.sparse_features).float().cpu())
        labels.append(batch.labels.cpu())
        hidden.append(data.hidden_logits(i, split="eval"))
    model.train()
    y = torch.cat(labels)
    p = torch.cat(logits)
    return {
        "auc": roc_auc(p, y),
        "logloss": float(DLRM.loss(p, y)),
        "hidden_auc": roc_auc(torch.cat(hidden), y),
        "samples": float(y.numel()),
    }
