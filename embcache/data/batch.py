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
