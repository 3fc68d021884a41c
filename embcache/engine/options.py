"""CollectionOptions: the options every cached collection takes, declared once.

The local collections (`CachedEmbeddingBagCollection`, `CachedEmbeddingCollection`), the
sharded ones (`ShardedEmbeddingBagCollection`, `ShardedEmbeddingCollection`) and RecStore's
(`RecStoreEmbeddingBagCollection`, `RecStoreEmbeddingCollection`) share a dozen options: the
cache, the tier, the device, id fusion, when the update runs, the fused optimizer. Each public
constructor takes them as keywords, as torchrec's and RecStore's users call it, or as one
``options=CollectionOptions(...)``; inside the package they travel as that one object, checked
once, here. What only one kind of collection takes stays in its constructor: the tables,
``is_weighted`` (bags), ``need_indices`` (sequences), ``process_group`` (sharded), the KV
client (RecStore).

Example::

    options = CollectionOptions(cache=CacheConfig(load_factor=0.1), device="cuda", seed=0)
    bags = CachedEmbeddingBagCollection(bag_tables, options=options)
    rows = CachedEmbeddingCollection(sequence_tables, options=options)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from embcache.cache.config import CacheConfig
from embcache.kv.base import Store

FUSION_K = 30  # a collection's default fusion_k
MAX_FUSION_K = 56  # leaves 6 bits (64 tables) of a non-negative int64 for the table index


@dataclasses.dataclass(frozen=True)
class CollectionOptions:
    """The options of a cached collection (local, sharded, sequence or RecStore).

    Attributes:
        cache: capacity and policy of each cache (one per distinct dim; a ``capacity`` or
            ``load_factor`` dict by table name gives those tables a cache each); None caches
            everything that fits the memory budget. A sharded collection's is per rank.
        store: the tier: a `Store`, a URL (``"redis://127.0.0.1:6379/0"``) or None for an
            in-process `HostKV`; a sharded collection also takes ``store(rank) -> Store |
            URL``. Opened (and a URL checked) when the collection is built.
        device: where the caches and outputs live: a `torch.device`, a device string or a
            CUDA index; None: torch's default device when the collection is built (``with
            torch.device("meta"):`` builds one of shapes only).
        enable_fusion: fuse the ids of all tables into one key space with ``fusion_k`` bits
            for the raw id (RecStore's layout). With False, the collection still fuses
            internally but with 48 id bits, so only ``num_embeddings`` limits ids.
        fusion_k: bits of the raw id inside a fused id, in ``[1, 56]``; every bounded table
            needs ``num_embeddings <= 2**fusion_k``.
        update_in_backward: apply the attached optimizer inside backward (FBGEMM-style)
            instead of recording a trace for ``step()``; same numbers.
        accumulate_grads: allow several forward/backward passes before one ``step()``, whose
            gradients are summed per id.
        lr: learning rate a sparse optimizer uses when given none (RecStore compatibility).
        seed: seed of the row initialisers (rows drawn per id, never materialised), an int
            >= 0; None: the randomness comes from torch's generator (`engine.row_init`).
        optimizer_type: a fused optimizer, as torchrec's ``FusedEmbeddingBagCollection`` takes
            it (``torch.optim.SGD``, ``Adagrad``, ``Adam``, torchrec's ``RowWiseAdagrad``),
            applied inside backward.
        optimizer_kwargs: its hyper-parameters (``{"lr": 0.02}``), by the torch names; kept
            read-only.
        allow_unsharded_replicas: let a process group of several ranks train one independent
            copy of a local collection's tables per rank (a sharded collection ignores it).

    Raises:
        TypeError: an option of the wrong type, naming it.
        ValueError: an option out of its range, naming it; ``optimizer_kwargs`` without an
            ``optimizer_type``.
    """

    cache: CacheConfig | None = None
    store: Store | str | Callable[[int], Store | str] | None = None
    device: torch.device | str | int | None = None
    enable_fusion: bool = True
    fusion_k: int = FUSION_K
    update_in_backward: bool = False
    accumulate_grads: bool = False
    lr: float | None = None
    seed: int | None = None
    optimizer_type: type | None = None
    optimizer_kwargs: Mapping[str, Any] | None = None
    allow_unsharded_replicas: bool = False

    def __post_init__(self) -> None:
        if self.cache is not None and not isinstance(self.cache, CacheConfig):
            raise TypeError(
                f"cache must be an embcache.CacheConfig or None, got {type(self.cache).__name__} "
                "(torchrec's third positional argument is device: pass device=...)"
            )
        _check_device(self.device)
        for name in ("enable_fusion", "update_in_backward", "accumulate_grads",
                     "allow_unsharded_replicas"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, str) or value not in (True, False):
                raise TypeError(f"{name} must be a bool, got {value!r}")
            object.__setattr__(self, name, bool(value))
        k = self.fusion_k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_FUSION_K:
            raise ValueError(f"fusion_k must be an int in [1, {MAX_FUSION_K}], got {k!r}")
        lr = self.lr
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, numbers.Real)):
            raise TypeError(f"lr must be a number or None, got {lr!r}")
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr must be finite and >= 0, got {lr!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be an int >= 0 or None, got {seed!r}")
        if self.optimizer_type is not None and not isinstance(self.optimizer_type, type):
            raise TypeError(
                "optimizer_type must be an optimizer class (e.g. torch.optim.SGD), got "
                f"{self.optimizer_type!r}"
            )
        kwargs = self.optimizer_kwargs
        if kwargs is not None:
            if not isinstance(kwargs, Mapping):
                raise TypeError(f"optimizer_kwargs must be a mapping, got {type(kwargs).__name__}")
            if kwargs and self.optimizer_type is None:
                raise ValueError("optimizer_kwargs needs an optimizer_type (e.g. torch.optim.SGD)")
            object.__setattr__(self, "optimizer_kwargs", MappingProxyType(dict(kwargs)))

    @property
    def applies_in_backward(self) -> bool:
        """Whether the update runs inside backward: ``update_in_backward``, or a fused
        ``optimizer_type``."""
        return self.update_in_backward or self.optimizer_type is not None

    @classmethod
    def given(
        cls,
        options: CollectionOptions | None,
        called: Mapping[str, Any],
        defaults: Mapping[str, Any] | None = None,
    ) -> CollectionOptions:
        """The options a public constructor was called with: ``options``, or its option
        keywords.

        Args:
            options: its ``options=`` argument.
            called: its option keywords as called (its parameters: other names are ignored,
                so a constructor passes ``locals()`` first thing).
            defaults: its defaults where they differ from the dataclass's (RecStore's lr).

        Raises:
            TypeError: ``options`` is no `CollectionOptions`, or a keyword given a value other
                than its default beside ``options`` (the keyword is named: give it once).
        """
        names = [f.name for f in dataclasses.fields(cls) if f.name in called]
        if options is None:
            return cls(**{name: called[name] for name in names})
        if not isinstance(options, CollectionOptions):
            raise TypeError(f"options must be a CollectionOptions, got {type(options).__name__}")
        default = {f.name: f.default for f in dataclasses.fields(cls)} | dict(defaults or {})
        both = [name for name in names if not _is_default(called[name], default[name])]
        if both:
            raise TypeError(
                f"{', '.join(both)} given both as a keyword argument and in "
                "options=CollectionOptions(...): give each option once"
            )
        return options


def model_collection_kwargs(kwargs: Mapping[str, Any], **model: Any) -> dict[str, Any]:
    """The keywords a model (`DLRM`, `SequenceRecommender`) builds a collection with: its own
    collection arguments ``model`` (``cache``, ``store``, ``device``, ``seed``) beside the
    caller's ``kwargs``. When the caller gave ``options=``, only the model arguments it set
    (those not None) go with it, so `CollectionOptions.given` names an option given twice
    instead of refusing the model's own defaults."""
    if kwargs.get("options") is None:
        return {**model, **kwargs}
    return {**{k: v for k, v in model.items() if v is not None}, **kwargs}


def option_names() -> tuple[str, ...]:
    """The names of `CollectionOptions`' fields, in order."""
    return tuple(f.name for f in dataclasses.fields(CollectionOptions))


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def _check_device(device: object) -> None:
    """Refuse what `devices.resolve_device` would (its index is resolved when a collection is
    built, on the thread that builds it)."""
    if device is None:
        return
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            "device must be a torch.device, a device string, a CUDA index or None, "
            f"got {type(device).__name__}"
        )
    if isinstance(device, int) and device < 0:
        raise ValueError(f"device: not a device: {device!r} (a CUDA index is >= 0)")
    if isinstance(device, str):
        try:
            torch.device(device)
        except (RuntimeError, ValueError) as err:  # torch says RuntimeError for a bad string
            raise ValueError(f"device: not a device: {device!r} ({err})") from None
