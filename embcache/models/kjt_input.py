"""A collection's input: checking a KeyedJaggedTensor before anything changes, and taking out the
values, lengths and weights of one cache's features."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec import KeyedJaggedTensor


def check_kjt(features: KeyedJaggedTensor, output_keys: Sequence[str], is_weighted: bool) -> None:
    """Raise unless ``features`` is a KJT with exactly the features ``output_keys``, one batch
    size for all of them, integer ids, consistent lengths, and weights iff ``is_weighted``."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"expected a torchrec KeyedJaggedTensor, got {type(features).__name__}")
    keys = features.keys()
    known = set(output_keys)
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown feature keys {unknown}; this collection looks up {output_keys}")
    missing = [k for k in output_keys if k not in keys]
    if missing:
        raise ValueError(f"KeyedJaggedTensor lacks features {missing}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate feature keys in {keys}")
    if features.variable_stride_per_key():
        raise ValueError("KJTs with a variable batch size per feature are not supported")
    values, lengths = features.values(), features.lengths()
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise TypeError(f"KJT values must be integer ids, got dtype {values.dtype}")
    if lengths.numel() != len(keys) * features.stride():
        raise ValueError(
            f"KJT lengths has {lengths.numel()} entries, expected "
            f"{len(keys)} features x batch {features.stride()}"
        )
    if bool((lengths < 0).any()):
        raise ValueError("KJT lengths must be >= 0")
    if int(lengths.sum()) != values.numel():
        raise ValueError(
            f"KJT lengths sum to {int(lengths.sum())} but there are {values.numel()} values"
        )
    weights = features.weights_or_none()
    if is_weighted and weights is None:
        raise ValueError("this collection is_weighted=True but the KJT carries no weights")
    if not is_weighted and weights is not None:
        raise ValueError("the KJT carries weights but the collection is_weighted=False")
    if weights is not None:
        if not weights.is_floating_point():
            raise TypeError(f"KJT weights must be floating point, got {weights.dtype}")
        if weights.numel() != values.numel():
            raise ValueError(f"KJT has {weights.numel()} weights for {values.numel()} values")


def group_inputs(
    features: KeyedJaggedTensor, group_features: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Values, lengths and weights of ``group_features`` (a checked KJT's keys, in the order
    given); the KJT's own tensors when that is already its key order."""
    keys = features.keys()
    B = features.stride()
    values, lengths = features.values(), features.lengths()
    weights = features.weights_or_none()
    if keys == group_features:
        return values, lengths, weights
    offsets = features.offset_per_key()
    pos = {k: i for i, k in enumerate(keys)}
    order = [pos[f] for f in group_features]
    v = torch.cat([values[offsets[i] : offsets[i + 1]] for i in order])
    ln = torch.cat([lengths[i * B : (i + 1) * B] for i in order])
    w = None
    if weights is not None:
        w = torch.cat([weights[offsets[i] : offsets[i + 1]] for i in order])
    return v, ln, w
