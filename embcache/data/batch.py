"""One training batch of a click-prediction dataset: dense features, sparse ids, labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embcache.engine.inputs import JaggedBatch


@dataclass
class Batch:
    """A batch of B samples, with the field names of torchrec's ``datasets.utils.Batch``.

    Attributes:
        dense_features: float32 ``[B, N_dense]``.
        sparse_features: the categorical ids, one bag per feature and sample (a `JaggedBatch`,
            or a torchrec KJT).
        labels: float32 ``[B]``, 0.0 or 1.0.
    """

    dense_features: torch.Tensor
    sparse_features: JaggedBatch
    labels: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The same batch with its tensors on ``device``."""
        return Batch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    @property
    def batch_size(self) -> int:
        return self.labels.numel()

    def samples(self, lo: int, hi: int) -> Batch:
        """Samples ``[lo, hi)`` of the batch (every feature's bags of those samples)."""
        kjt = self.sparse_features
        keys, batch = kjt.keys(), kjt.stride()
        offsets = kjt.offsets().view(-1)
        starts = offsets[:-1].view(len(keys), batch)[:, lo].tolist()
        ends = offsets[1:].view(len(keys), batch)[:, hi - 1].tolist()
        pieces = list(zip(starts, ends, strict=True))
        weights = kjt.weights_or_none()
        sparse = JaggedBatch.from_lengths(
            keys=keys,
            values=torch.cat([kjt.values()[a:b] for a, b in pieces]),
            lengths=kjt.lengths().view(len(keys), batch)[:, lo:hi].reshape(-1),
            weights=None if weights is None else torch.cat([weights[a:b] for a, b in pieces]),
        )
        return Batch(self.dense_features[lo:hi], sparse, self.labels[lo:hi])
