"""An unpooled collection's output: one jagged block of rows per key, a torchrec `JaggedTensor`
for a KJT input and a `JaggedRows` (the same read methods, no torchrec) for a `JaggedBatch`."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from embcache.engine.inputs import is_kjt


class JaggedRows:
    """One feature's rows for a batch: ``values()`` ``[n, dim]``, one row per id, sample after
    sample; ``lengths()`` ``[B]`` the ids of each sample. torchrec `JaggedTensor`'s read
    methods; ``weights()`` holds the ids themselves when the collection was built with
    ``need_indices=True`` (as torchrec's ``EmbeddingCollection`` puts them there)."""

    def __init__(
        self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> None:
        self._values = values
        self._lengths = lengths
        self._weights = weights
        self._offsets: torch.Tensor | None = None

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            n = self._lengths.numel()
            self._offsets = self._lengths.new_zeros(n + 1, dtype=torch.int64)
            torch.cumsum(self._lengths, 0, out=self._offsets[1:])
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor:
        return self.offsets()

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("these rows carry no weights (build the collection with need_indices)")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def to_dense(self) -> list[torch.Tensor]:
        """Each sample's rows ``[L_b, dim]`` (views of `values`)."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def to_padded_dense(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor:
        """``[B, L, dim]``: each sample's rows, then ``padding_value``; ``L`` is the longest
        sample unless ``desired_length`` says (longer samples are cut)."""
        lengths = self._lengths.tolist()
        length = max(lengths, default=0) if desired_length is None else desired_length
        out = self._values.new_full((len(lengths), length, *self._values.shape[1:]), padding_value)
        for b, rows in enumerate(torch.split(self._values, lengths)):
            n = min(rows.shape[0], length)
            out[b, :n] = rows[:n]
        return out

    def __repr__(self) -> str:
        return f"JaggedRows(values={tuple(self._values.shape)}, batch={self._lengths.numel()})"


def sequence_output(
    features: object, rows: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
) -> dict[str, Any]:
    """``{key: (values, lengths, weights)}`` as torchrec `JaggedTensor` objects when
    ``features`` was a KJT, else as `JaggedRows`."""
    if is_kjt(features):  # then torchrec is imported
        make: Any = sys.modules["torchrec.sparse.jagged_tensor"].JaggedTensor
    else:
        make = JaggedRows
    return {k: make(values=v, lengths=n, weights=w) for k, (v, n, w) in rows.items()}


class SequenceCollection:
    """What a collection of unpooled tables adds to its engines, one process or sharded:
    torchrec's ``EmbeddingCollection`` accessors and the output split per key. Expects the
    collection's ``tables``, ``engines`` and ``output_keys``; ``_need_indices`` is set by the
    constructor."""

    tables: list[Any]
    engines: Any
    output_keys: list[str]
    _need_indices: bool

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        """The tables' dim (torchrec's collection has one; -1 for none, and for tables of
        several dims, which torchrec refuses and these collections take)."""
        dims = {t.dim for t in self.tables}
        return dims.pop() if len(dims) == 1 else -1

    def embedding_names_by_table(self) -> list[list[str]]:
        return [list(t.key_names) for t in self.tables]

    def key_features(self) -> list[str]:
        """The input feature of each output key (``feature@table`` reads ``feature``)."""
        return [f for t in self.tables for f in t.feature_names]

    def split_per_key(
        self, outs: tuple[torch.Tensor, ...], counts: dict[str, int]
    ) -> dict[str, torch.Tensor]:
        """`split_per_key` over the collection's engines."""
        return split_per_key(self.engines.engines, outs, counts)

    def jagged_output(
        self, features: object, batch: Any, values: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """`jagged_output` of the collection's keys, with its ids under ``need_indices``."""
        keys = zip(self.output_keys, self.key_features(), strict=True)
        return jagged_output(features, batch, values, keys, self._need_indices)


def split_per_key(
    engines: Sequence[Any], outs: tuple[torch.Tensor, ...], counts: dict[str, int]
) -> dict[str, torch.Tensor]:
    """Each output key's rows ``[n, dim]``: views of the engines' ``[nnz_e, dim_e]`` outputs,
    cut by the values of each feature (``counts``)."""
    values = {}
    for engine, out in zip(engines, outs, strict=True):
        sizes = [counts[f] for f in engine.layout.features]
        for key, part in zip(engine.layout.keys, torch.split(out, sizes), strict=True):
            values[key] = part
    return values


def jagged_output(
    features: object,
    batch: Any,
    values: dict[str, torch.Tensor],
    keys: Iterable[tuple[str, str]],
    need_indices: bool,
) -> dict[str, Any]:
    """``{key: JaggedTensor}`` (or `JaggedRows`) of the rows per output key, ``keys`` giving
    each key's input feature, with the input's lengths and, under ``need_indices``, its
    ids."""
    rows = {}
    for key, feature in keys:
        part = batch[feature]
        indices = part.values() if need_indices else None
        rows[key] = (values[key], part.lengths(), indices)
    return sequence_output(features, rows)
