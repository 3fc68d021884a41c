"""A collection's input and output, with or without torchrec installed.

Input: a torchrec `KeyedJaggedTensor`, or embcache's own `JaggedBatch` (the same fields: keys,
values, lengths or offsets, optional per-sample weights). Output: a torchrec `KeyedTensor` for a
KJT input, a `PooledEmbeddings` (KeyedTensor's read methods) for a `JaggedBatch` input.

    batch = JaggedBatch.from_lengths(
        keys=["f0", "f1"],                   # F features
        values=torch.tensor([1, 2, 3, 7, 7]),  # ids, grouped by feature, then sample
        lengths=torch.tensor([2, 1, 0, 2]),  # F x B bag lengths: f0 = [1, 2], [3]; f1 = [], [7, 7]
    )
    out = ebc(batch)                         # PooledEmbeddings, keys ["f0", "f1"]
    out.values()                             # [B, sum of dims]

Nothing here imports torchrec: a KJT can only exist once torchrec is imported, so it is
recognised through ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol, TypeGuard

import torch


class KeyedJagged(Protocol):
    """What embcache reads of a torchrec `KeyedJaggedTensor` (torchrec ships no types)."""

    def keys(self) -> list[str]: ...

    def values(self) -> torch.Tensor: ...

    def lengths(self) -> torch.Tensor: ...

    def weights_or_none(self) -> torch.Tensor | None: ...

    def offsets_or_none(self) -> torch.Tensor | None: ...

    def variable_stride_per_key(self) -> bool: ...


def _torchrec() -> ModuleType | None:
    """The torchrec module if this process already imported it, else None."""
    return sys.modules.get("torchrec")


def is_kjt(obj: object) -> TypeGuard[KeyedJagged]:
    """Whether ``obj`` is a torchrec `KeyedJaggedTensor` (without importing torchrec)."""
    torchrec = _torchrec()
    return torchrec is not None and isinstance(obj, torchrec.KeyedJaggedTensor)


def _offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
    return offsets


@dataclass(eq=False)
class JaggedBatch:
    """Bags of ids for F features and B samples: torchrec's `KeyedJaggedTensor` layout.

    ``values`` holds the ids of feature 0's bags (sample 0, 1, ... B-1), then feature 1's, ...;
    ``lengths[f * B + b]`` is the size of bag ``(f, b)``. ``weights`` (float, one per value)
    are the per-sample weights of a weighted collection.

    Build one with `from_lengths` or `from_offsets`; the read methods have torchrec's names
    (`keys`, `values`, `lengths`, `offsets`, `weights_or_none`, `stride`, ``batch[key]``), so
    code written for a KJT reads a `JaggedBatch` unchanged. Shapes are checked by the collection
    that receives it, which names what is wrong.
    """

    _keys: list[str]
    _values: torch.Tensor
    _lengths: torch.Tensor
    _weights: torch.Tensor | None = None
    _offsets: torch.Tensor | None = None
    # Values per feature, once a check has read them (`checked_batch`): then
    # `length_per_key` needs no host read of its own.
    _per_key: list[int] | None = field(default=None, repr=False)
    # Set by `checked_batch(read_lengths=False)`: the lengths' own checks (none negative, the
    # sum the number of values) wait for the first read of the counts (`length_per_key`,
    # `check_lengths`), or for the device checks a collection reads with its dedup.
    _lengths_pending: bool = field(default=False, repr=False)

    @classmethod
    def from_lengths(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> JaggedBatch:
        """A batch from bag lengths (``[F * B]``)."""
        return cls(list(keys), torch.as_tensor(values), torch.as_tensor(lengths), weights)

    @classmethod
    def from_offsets(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> JaggedBatch:
        """A batch from bag offsets (``[F * B + 1]``, starting at 0)."""
        offsets = torch.as_tensor(offsets)
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError(f"offsets must be 1-D with at least one entry, got {offsets.shape}")
        if offsets.numel() and int(offsets[0]) != 0:
            raise ValueError(f"offsets must start at 0, got {int(offsets[0])}")
        lengths = offsets[1:] - offsets[:-1]
        return cls(list(keys), torch.as_tensor(values), lengths, weights, offsets)

    # -- torchrec's read methods ------------------------------------------------------------

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = _offsets_of(self._lengths)
        return self._offsets

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("this JaggedBatch carries no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride(self) -> int:
        """Batch size B (bags per feature)."""
        return self._lengths.numel() // max(len(self._keys), 1)

    def variable_stride_per_key(self) -> bool:
        return False

    def length_per_key(self) -> list[int]:
        """Values per feature (one host synchronisation, none once a collection has checked
        the batch)."""
        if self._lengths_pending:
            self.check_lengths()
        if self._per_key is not None:
            return list(self._per_key)
        B = self.stride()
        return (
            self._lengths.reshape(len(self._keys), B).sum(dim=1).tolist()
            if B
            else ([0] * len(self._keys))
        )

    @property
    def lengths_pending(self) -> bool:
        """Whether the lengths' checks wait for a read (`checked_batch` with
        ``read_lengths=False``)."""
        return self._lengths_pending

    def check_lengths(self) -> None:
        """The checks `checked_batch` left pending (none when it read the lengths): one host
        read, which also gives `length_per_key`.

        Raises:
            ValueError: a negative length, or lengths that do not sum to the values.
        """
        if self._lengths_pending:
            self._per_key = _read_lengths(self._values, self._lengths, len(self._keys))
            self._lengths_pending = False

    def lengths_checked(self, per_key: list[int]) -> None:
        """The pending checks were made on the device and passed, and ``per_key`` (values per
        key) came with their read (a collection's joint dedup, `engine.joint`): nothing is
        left to read."""
        self._per_key = list(per_key)
        self._lengths_pending = False

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> JaggedBatch:
        """Feature ``key`` alone, as a one-key batch."""
        if key not in self._keys:
            raise KeyError(f"no feature {key!r}; keys: {self._keys}")
        i = self._keys.index(key)
        B = self.stride()
        bounds = self.offset_per_key()
        lo, hi = bounds[i], bounds[i + 1]
        weights = None if self._weights is None else self._weights[lo:hi]
        return JaggedBatch([key], self._values[lo:hi], self._lengths[i * B : (i + 1) * B], weights)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedBatch:
        """The same batch with its tensors on ``device``."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return JaggedBatch(
            self._keys,
            move(self._values),
            move(self._lengths),
            None if self._weights is None else move(self._weights),
            None if self._offsets is None else move(self._offsets),
        )

    def to_kjt(self) -> Any:
        """This batch as a torchrec `KeyedJaggedTensor` (needs torchrec)."""
        from torchrec import KeyedJaggedTensor

        return KeyedJaggedTensor.from_lengths_sync(
            keys=self._keys, values=self._values, lengths=self._lengths, weights=self._weights
        )

    @classmethod
    def from_kjt(cls, kjt: KeyedJagged) -> JaggedBatch:
        """The fields of a torchrec `KeyedJaggedTensor`, as a `JaggedBatch`."""
        return cls(
            list(kjt.keys()),
            kjt.values(),
            kjt.lengths(),
            kjt.weights_or_none(),
            kjt.offsets_or_none(),  # kept when the KJT has them: computed once, not per call
        )

    def __repr__(self) -> str:
        weighted = ", weighted" if self._weights is not None else ""
        return (
            f"JaggedBatch(keys={self._keys}, batch={self.stride()}, "
            f"values[{self._values.numel()}]{weighted})"
        )


class PooledEmbeddings:
    """A collection's output for a `JaggedBatch` input: ``values()`` ``[B, sum of dims]``,
    one block of columns per key, with torchrec `KeyedTensor`'s read methods."""

    def __init__(self, keys: list[str], length_per_key: list[int], values: torch.Tensor) -> None:
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self._length_per_key:
            out.append(out[-1] + n)
        return out

    def key_dim(self) -> int:
        return 1

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Each key's columns ``[B, dim]`` (views of `values`)."""
        bounds = self.offset_per_key()
        return {k: self._values[:, bounds[i] : bounds[i + 1]] for i, k in enumerate(self._keys)}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(f"no key {key!r}; keys: {self._keys}")
        return self.to_dict()[key]

    def __repr__(self) -> str:
        return f"PooledEmbeddings(keys={self._keys}, values={tuple(self._values.shape)})"


def pooled_output(
    features: object, keys: list[str], length_per_key: list[int], values: torch.Tensor
) -> Any:
    """A torchrec `KeyedTensor` when ``features`` was a KJT, else a `PooledEmbeddings`."""
    if is_kjt(features):  # then torchrec is imported
        torchrec = sys.modules["torchrec"]
        return torchrec.KeyedTensor(keys=keys, length_per_key=length_per_key, values=values)
    return PooledEmbeddings(keys, length_per_key, values)


def as_jagged(features: object) -> JaggedBatch:
    """``features`` (a `JaggedBatch` or a torchrec KJT) as a `JaggedBatch`; anything else is a
    TypeError naming what is accepted."""
    if isinstance(features, JaggedBatch):
        return features
    if is_kjt(features):
        if features.variable_stride_per_key():
            raise ValueError(
                "KJTs with a variable batch size per feature (stride_per_key_per_rank) are not "
                "supported: every feature needs the same batch size B; pad the shorter "
                "features with empty bags"
            )
        offsets = features.offsets_or_none()
        # torchrec reads a KJT whose offsets start past 0 from that position: refuse it rather
        # than read it differently.
        if offsets is not None and offsets.numel() and int(offsets[0]) != 0:
            raise ValueError(f"KJT offsets must start at 0, got {int(offsets[0])}")
        return JaggedBatch.from_kjt(features)
    raise TypeError(
        "expected a torchrec KeyedJaggedTensor or an embcache.JaggedBatch, "
        f"got {type(features).__name__}"
    )


def checked_batch(
    batch: JaggedBatch, features: Sequence[str], is_weighted: bool, read_lengths: bool = True
) -> JaggedBatch:
    """``batch`` checked for a collection that looks up ``features``: each of them present,
    integer 1-D ids, consistent lengths, weights when ``is_weighted``. As in torchrec, keys the
    collection does not look up are ignored, and so are the weights of a batch given to an
    unweighted collection (the batch returned then carries none). Raises naming what is wrong;
    nothing is changed either way.

    Without ``read_lengths`` the checks that need the lengths' values on the host (none
    negative, their sum the number of values) are left pending on the batch returned
    (`JaggedBatch.check_lengths`): its first `length_per_key` makes them, and a caller that
    needs no counts folds them into a device check it reads anyway (the device path's fuse,
    `ShareMaker._fuse_together`), so the check costs no host sync of its own."""
    keys = batch.keys()
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"duplicate feature keys {dup} in {keys}")
    missing = [k for k in features if k not in keys]
    if missing:
        raise ValueError(
            f"the input lacks features {missing}; this collection looks up {list(features)}, "
            f"the input has {keys}"
        )
    values, lengths = batch.values(), batch.lengths()
    if not isinstance(values, torch.Tensor) or not isinstance(lengths, torch.Tensor):
        raise TypeError("values and lengths must be tensors")
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise TypeError(f"values must be integer ids, got dtype {values.dtype}")
    if values.dim() != 1:
        raise ValueError(
            f"values must be 1-D (the ids of all bags), got shape {tuple(values.shape)}"
        )
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must be integers, got dtype {lengths.dtype}")
    if len(keys) and lengths.numel() % len(keys):
        raise ValueError(
            f"lengths has {lengths.numel()} entries, not a multiple of the {len(keys)} features"
        )
    per_key_list = _read_lengths(values, lengths, len(keys)) if read_lengths else None
    weights = batch.weights_or_none()
    if is_weighted and weights is None:
        raise ValueError("this collection is_weighted=True but the input carries no weights")
    if weights is not None:
        if not weights.is_floating_point():
            raise TypeError(f"weights must be floating point, got {weights.dtype}")
        if weights.numel() != values.numel():
            raise ValueError(f"the input has {weights.numel()} weights for {values.numel()} values")
    # A new batch over the same tensors, carrying what the check read (the caller's object is
    # left as it was: a loader may refill its tensors in place for the next step).
    kept = weights if is_weighted else None
    return JaggedBatch(
        keys, values, lengths, kept, batch._offsets, per_key_list, _lengths_pending=not read_lengths
    )


def _read_lengths(values: torch.Tensor, lengths: torch.Tensor, num_keys: int) -> list[int]:
    """The values per feature, checked: one host read for every fact (the lowest length and
    the counts, whose sum is the total; the forward then cuts the values by feature without
    reading again).

    Raises:
        ValueError: a negative length, or lengths that do not sum to the values.
    """
    lowest = lengths.min() if lengths.numel() else lengths.new_zeros(())
    stride = lengths.numel() // max(num_keys, 1)
    per_key = (
        lengths.reshape(num_keys, stride).sum(dim=1) if stride else lengths.new_zeros(num_keys)
    )
    low, *per_key_list = torch.cat([lowest.reshape(1), per_key.to(lowest.dtype)]).tolist()
    total = sum(per_key_list)
    if low < 0:
        raise ValueError("lengths must be >= 0")
    if total != values.numel():
        raise ValueError(f"lengths sum to {total} but there are {values.numel()} values")
    return per_key_list


def group_inputs(
    batch: JaggedBatch, group_features: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Values, lengths and weights of ``group_features`` (keys of a checked batch, in the order
    given; a key may repeat, and the batch may hold others); the batch's own tensors when that
    is already its key order."""
    keys = batch.keys()
    B = batch.stride()
    values, lengths = batch.values(), batch.lengths()
    weights = batch.weights_or_none()
    if keys == group_features:
        return values, lengths, weights
    offsets = batch.offset_per_key()
    pos = {k: i for i, k in enumerate(keys)}
    order = [pos[f] for f in group_features]
    v = torch.cat([values[offsets[i] : offsets[i + 1]] for i in order])
    ln = torch.cat([lengths[i * B : (i + 1) * B] for i in order])
    w = None
    if weights is not None:
        w = torch.cat([weights[offsets[i] : offsets[i + 1]] for i in order])
    return v, ln, w
