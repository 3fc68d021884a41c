"""A synthetic Criteo-like click dataset: no download, seeded, streamed batch by batch.

Shape of the data follows the Criteo Kaggle Display Advertising Challenge (DAC) set: 13 dense
(count-like) features and 26 categorical ones whose table sizes are the DAC cardinalities,
scaled down by one factor. Ids are Zipf-distributed per table (rank ``k`` has mass
``∝ k**-zipf``), with a per-table seeded bijection from rank to id so the hot ids are scattered
over the table rather than packed at its start.

Labels come from a hidden model, so a model trained on the data can really lower its loss:

    logit = bias + dense_std @ w + Σ_{t in label_tables} effect_t[id_t]    (mean over a bag)
    label ~ Bernoulli(sigmoid(logit))

where ``dense_std`` is the dense features standardised by their known mean and std, ``w`` is
fixed and random, and ``effect_t`` a seeded N(0, effect_std²) per id (hashed into at most
``2**20`` buckets for very large tables). `SyntheticCriteo.hidden_logits` returns that logit, so
the AUC of the hidden model itself is a ceiling for what training can reach.

Batch ``i`` of a split is drawn from its own generator seeded by ``(seed, split, i)``: batches
are reproducible, can be drawn in any order, and the held-out split ("eval") never repeats a
training batch. Example::

    data = SyntheticCriteo(SyntheticConfig(scale=0.01, batch_size=512, seed=0))
    for batch in data.batches(100):                 # embcache.data.Batch
        batch.dense_features                        # float32 [512, 13]
        batch.sparse_features                       # JaggedBatch keys cat_0..cat_25
        batch.labels                                # float32 [512], 0.0 or 1.0
    data.tables(dim=16)                             # TableConfig per feature
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from embcache.data.base import ClickDataset
from embcache.data.batch import Batch
from embcache.engine.inputs import JaggedBatch
from embcache.engine.tables import TableConfig
from embcache.kernels.pooling import PoolingMode

# Distinct values of the 26 categorical columns (C1..C26) of the Criteo Kaggle DAC train.txt,
# as counted by the DLRM reference implementation (facebookresearch/dlrm,
# bench/dlrm_s_criteo_kaggle.sh) and used by torchrec's and many papers' Kaggle configs; they
# sum to 33,762,577 rows.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
NUM_DENSE = 13
NUM_SPARSE = len(CRITEO_KAGGLE_CARDINALITIES)
FEATURE_NAMES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(NUM_SPARSE))
SPLITS = ("train", "eval")

_MAX_EFFECT_BUCKETS = 1 << 20  # per-id label effects of larger tables are hashed into these
_HASH_MULTIPLIER = 0x9E3779B1  # Knuth's multiplicative hash constant (odd, ~2**32 / phi)


@dataclass
class SyntheticConfig:
    """What the synthetic data looks like.

    Attributes:
        scale: every table has ``max(1, ceil(cardinality * scale))`` rows, in (0, 1].
        batch_size: samples per batch.
        zipf: exponent of the per-table Zipf law over ranks (0: uniform; ~1: Criteo-like skew).
        seed: seeds the hidden model, the id permutations and every batch.
        multi_hot: ids per bag (1: one id per feature and sample, as in Criteo).
        label_tables: indices of the tables whose ids carry a label effect.
        effect_std: std of the per-id label effects.
        dense_weight_std: std of the hidden weights of the standardised dense features.
        positive_rate: target fraction of positive labels (Criteo's is about 0.26); sets the
            hidden model's bias.
        cardinalities: unscaled table sizes (default: the Criteo Kaggle ones).
    """

    scale: float = 0.01
    batch_size: int = 1024
    zipf: float = 1.05
    seed: int = 0
    multi_hot: int = 1
    label_tables: tuple[int, ...] = (0, 3, 6, 9, 10, 14, 19, 23)
    effect_std: float = 1.0
    dense_weight_std: float = 0.4
    positive_rate: float = 0.26
    cardinalities: tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not (0.0 < float(self.scale) <= 1.0):
            raise ValueError(f"SyntheticConfig.scale must be in (0, 1], got {self.scale!r}")
        for name in ("batch_size", "multi_hot"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SyntheticConfig.{name} must be an int >= 1, got {value!r}")
        if not (math.isfinite(self.zipf) and self.zipf >= 0.0):
            raise ValueError(f"SyntheticConfig.zipf must be a finite float >= 0, got {self.zipf}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"SyntheticConfig.seed must be an int >= 0, got {self.seed!r}")
        self.cardinalities = tuple(int(c) for c in self.cardinalities)
        if not self.cardinalities or min(self.cardinalities) < 1:
            raise ValueError("SyntheticConfig.cardinalities must be a non-empty list of ints >= 1")
        self.label_tables = tuple(int(t) for t in self.label_tables)
        bad = [t for t in self.label_tables if not 0 <= t < len(self.cardinalities)]
        if bad:
            raise ValueError(
                f"SyntheticConfig.label_tables {bad} are not table indices "
                f"(0..{len(self.cardinalities) - 1})"
            )
        if self.effect_std < 0 or self.dense_weight_std < 0:
            raise ValueError("SyntheticConfig.effect_std and dense_weight_std must be >= 0")
        if not 0.0 < self.positive_rate < 1.0:
            raise ValueError(
                f"SyntheticConfig.positive_rate must be in (0, 1), got {self.positive_rate}"
            )

    @property
    def rows(self) -> list[int]:
        """Rows of each table after scaling."""
        return [max(1, math.ceil(c * self.scale)) for c in self.cardinalities]


class SyntheticCriteo(ClickDataset):
    """Batches of the synthetic data described in the module docstring.

    Args:
        config: the data's shape and seed.
    """

    num_dense = NUM_DENSE

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = config or SyntheticConfig()
        cfg = self.config
        self.rows = cfg.rows
        self.batch_size = cfg.batch_size
        self.feature_names = [f"cat_{i}" for i in range(len(self.rows))]
        self.poolings = {}
        gen = torch.Generator().manual_seed(_mix(cfg.seed, 0x5EED, 0))
        # Rank r of table t has id (a_t * r + b_t) mod n_t: a bijection since gcd(a_t, n_t) = 1.
        self._perm_a: list[int] = []
        self._perm_b: list[int] = []
        self._cdfs: list[torch.Tensor | None] = []
        for n in self.rows:
            self._perm_a.append(_coprime_multiplier(n, gen))
            self._perm_b.append(int(torch.randint(n, (1,), generator=gen)))
            self._cdfs.append(_zipf_cdf(n, cfg.zipf) if cfg.zipf > 0 else None)
        # Dense features: log1p of exponential counts with per-feature scales (Criteo's dense
        # columns are heavy-tailed counts, usually fed to models as log1p).
        self.dense_scale = torch.exp(torch.empty(NUM_DENSE).uniform_(0.0, 4.0, generator=gen))
        self._dense_mean, self._dense_std = _log1p_exponential_moments(self.dense_scale)
        self.dense_weight = torch.randn(NUM_DENSE, generator=gen) * cfg.dense_weight_std
        self.effects = {
            t: torch.randn(min(self.rows[t], _MAX_EFFECT_BUCKETS), generator=gen) * cfg.effect_std
            for t in cfg.label_tables
        }
        self.bias = self._calibrate_bias()

    # ------------------------------------------------------------------------------------------

    def tables(
        self, dim: int, pooling: PoolingMode | str | None = PoolingMode.SUM
    ) -> list[TableConfig]:
        """One `TableConfig` per feature (table ``t_cat_i`` looks up ``cat_i``)."""
        return [
            TableConfig(
                name=f"t_{f}",
                embedding_dim=dim,
                num_embeddings=n,
                feature_names=[f],
                pooling=pooling or PoolingMode.SUM,
            )
            for f, n in zip(self.feature_names, self.rows, strict=True)
        ]

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """Training batches ``start, start + 1, ...`` (drawn on demand, without end)."""
        return (self.batch(i) for i in itertools.count(start))

    def eval_batches(self, limit: int | None = None) -> Iterator[Batch]:
        """The first ``limit`` batches of the held-out split (a stream of its own)."""
        if limit is None:
            raise ValueError("synthetic data has no end: give the number of held-out batches")
        return self.batches(limit, split="eval")

    def describe(self) -> str:
        cfg = self.config
        return (
            f"synthetic Criteo, scale {cfg.scale:g}: {sum(self.rows):,} rows in "
            f"{len(self.rows)} tables, zipf {cfg.zipf:g}, batch {cfg.batch_size}"
        )

    def batch(self, index: int, split: str = "train") -> Batch:
        """Batch ``index`` of ``split`` ("train" or "eval"), on the CPU."""
        dense, ids, labels, _ = self._draw(index, split)
        cfg = self.config
        B, F, H = cfg.batch_size, len(self.rows), cfg.multi_hot
        # ids: [F, B, H] -> values grouped by feature, then sample, then position in bag.
        sparse = JaggedBatch.from_lengths(
            keys=list(self.feature_names),
            values=ids.reshape(-1),
            lengths=torch.full((F * B,), H, dtype=torch.int64),
        )
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)

    def batches(self, num_batches: int, split: str = "train", start: int = 0) -> Iterator[Batch]:
        """Batches ``start .. start + num_batches - 1`` of ``split``."""
        for i in range(start, start + num_batches):
            yield self.batch(i, split)

    def hidden_logits(self, index: int, split: str = "train") -> torch.Tensor:
        """The hidden model's logits ``[B]`` for batch ``index`` (the labels' true odds)."""
        return self._draw(index, split)[3]

    # ------------------------------------------------------------------------------------------

    def _draw(self, index: int, split: str):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"batch index must be an int >= 0, got {index!r}")
        cfg = self.config
        gen = torch.Generator().manual_seed(_mix(cfg.seed, SPLITS.index(split) + 1, index))
        B, H = cfg.batch_size, cfg.multi_hot
        dense = torch.log1p(
            torch.empty(B, NUM_DENSE).exponential_(generator=gen) * self.dense_scale
        )
        ids = torch.stack(
            [self._sample_ids(t, B * H, gen).view(B, H) for t in range(len(self.rows))]
        )  # [F, B, H]
        logits = self._logits(dense, ids, self.bias)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=gen)
        return dense, ids, labels, logits

    def _sample_ids(self, table: int, n: int, gen: torch.Generator) -> torch.Tensor:
        rows = self.rows[table]
        cdf = self._cdfs[table]
        if cdf is None:
            return torch.randint(rows, (n,), generator=gen)
        u = torch.rand(n, dtype=torch.float64, generator=gen)
        ranks = torch.searchsorted(cdf, u, right=True).clamp_(max=rows - 1)
        return (ranks * self._perm_a[table] + self._perm_b[table]) % rows

    def _logits(self, dense: torch.Tensor, ids: torch.Tensor, bias: float) -> torch.Tensor:
        logits = ((dense - self._dense_mean) / self._dense_std) @ self.dense_weight + bias
        for t, effect in self.effects.items():
            buckets = ids[t]
            if effect.numel() < self.rows[t]:
                buckets = (buckets * _HASH_MULTIPLIER) % effect.numel()
            logits = logits + effect[buckets].mean(dim=1)
        return logits

    def _calibrate_bias(self) -> float:
        """The bias whose mean click probability on a calibration sample is ``positive_rate``
        (bisection: the mean of sigmoid is monotone in the bias)."""
        gen = torch.Generator().manual_seed(_mix(self.config.seed, 0xB1A5, 0))
        n = 8192
        dense = torch.log1p(
            torch.empty(n, NUM_DENSE).exponential_(generator=gen) * self.dense_scale
        )
        ids = torch.stack([self._sample_ids(t, n, gen).view(n, 1) for t in range(len(self.rows))])
        base = self._logits(dense, ids, 0.0)
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if float(torch.sigmoid(base + mid).mean()) < self.config.positive_rate:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)


def _mix(*parts: int) -> int:
    """A 63-bit generator seed from a few ints (splitmix64 finaliser over their combination)."""
    mask = (1 << 64) - 1
    h = 0
    for p in parts:
        h = (h ^ (int(p) & mask)) * 0x9E3779B97F4A7C15 & mask
        h ^= h >> 31
        h = h * 0xBF58476D1CE4E5B9 & mask
        h ^= h >> 27
    return h >> 1


def _zipf_cdf(n: int, exponent: float) -> torch.Tensor:
    """float64 ``[n]``: cumulative mass of ranks 0..n-1 under ``(rank + 1) ** -exponent``."""
    mass = torch.arange(1, n + 1, dtype=torch.float64).pow_(-exponent)
    cdf = torch.cumsum(mass, 0)
    return cdf.div_(cdf[-1].item())


def _coprime_multiplier(n: int, gen: torch.Generator) -> int:
    """A random multiplier in [1, n) coprime with ``n`` (1 for n <= 2)."""
    if n <= 2:
        return 1
    while True:
        a = int(torch.randint(1, n, (1,), generator=gen))
        if math.gcd(a, n) == 1:
            return a


def _log1p_exponential_moments(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of ``log1p(s * E)``, E ~ Exp(1), per scale s (numerically, on a grid)."""
    # Quantiles of Exp(1) at midpoints of 4096 equal-probability cells.
    p = (torch.arange(4096, dtype=torch.float64) + 0.5) / 4096
    e = -torch.log1p(-p)
    x = torch.log1p(scale.double()[:, None] * e[None, :])
    return x.mean(dim=1).float(), x.std(dim=1).float()
