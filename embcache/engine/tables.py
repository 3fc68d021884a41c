"""Table configs as users give them, normalised: torchrec `EmbeddingBagConfig` and
`EmbeddingConfig` objects (where torchrec is installed), embcache's own `TableConfig`, or
RecStore-style dicts.

    TableConfig(name="t0", embedding_dim=16, num_embeddings=10_000, feature_names=["f0"])
    {"name": "t0", "embedding_dim": 16, "num_embeddings": 10_000, "feature_names": ["f0"]}
    torchrec.EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=10_000,
                                feature_names=["f0"], pooling=PoolingType.SUM)

all describe the same table; `normalize_tables` turns a list of them into `Table` records.
A table is pooled (a bag of ids gives one row: SUM, MEAN, MAX) or unpooled (``pooling="none"``,
torchrec's ``EmbeddingConfig``: one row per id, for sequence models); a collection holds one
kind (`normalize_tables`' ``pooled``).

As in torchrec, a table without feature names looks up the feature named after it, and a
feature looked up in several tables gives one output key per table, ``feature@table``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from embcache.cache.config import weight_dtype_of
from embcache.kernels.pooling import PoolingMode

_POOLING_NAMES = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "max": PoolingMode.MAX}
_CONFIG_TYPES = ("EmbeddingBagConfig", "EmbeddingConfig")  # torchrec's, read by their fields
_FIELDS = ("name", "embedding_dim", "num_embeddings", "feature_names")
_OPTIONAL = {"pooling": PoolingMode.SUM, "init_fn": None, "data_type": "fp32"}


@dataclass(kw_only=True)
class TableConfig:
    """One embedding table, with the field names of torchrec's `EmbeddingBagConfig` (so code
    can move between the two unchanged); keyword arguments only.

    Attributes:
        name: the table's name (unique in a collection; its rows are stored under it).
        embedding_dim: columns of a row.
        num_embeddings: rows; ids of this table are ``0 <= id < num_embeddings``. None: an
            unbounded table of raw 64-bit ids (hashed features): any int64 id, its row created
            on first touch; its cache needs an explicit ``CacheConfig(capacity=...)``, and
            `CacheConfig.tier_capacity` bounds the rows its tier keeps.
        feature_names: the input keys looked up in this table (none: the table's name).
        pooling: how a bag's rows are combined: ``"sum"``, ``"mean"`` or ``"max"`` (or a
            `PoolingMode`, or torchrec's ``PoolingType.SUM``/``MEAN``); ``"none"`` (or
            ``PoolingType.NONE``): not combined, one row per id, for a
            `CachedEmbeddingCollection` (sequence embeddings).
        init_fn: initialiser of the weights, called on a ``[num_embeddings, embedding_dim]``
            tensor as torchrec calls it (``functools.partial(torch.nn.init.normal_, std=0.1)``);
            None: uniform in ``±sqrt(1 / num_embeddings)``, torchrec's default.
        data_type: the weights' type: ``"fp32"``, ``"fp16"``, ``"bf16"`` (or torchrec's
            ``DataType``, or a torch dtype), as stored in the cache and the tier (unless
            `CacheConfig.weight_dtype` says otherwise) and returned by ``state_dict()``.
    """

    name: str
    embedding_dim: int
    num_embeddings: int | None
    feature_names: list[str] = field(default_factory=list)
    pooling: PoolingMode | str | Any = PoolingMode.SUM
    init_fn: Callable[[torch.Tensor], Any] | None = None
    data_type: str | torch.dtype | Any = "fp32"

    def __post_init__(self) -> None:
        _checked(self.__dict__, f"TableConfig {self.name!r}")


@dataclass(frozen=True)
class Table:
    """One table of a collection, after validation.

    Attributes:
        index: position in the collection; the prefix of the table's fused ids.
        name: table name.
        dim: embedding dim.
        num_embeddings: rows (None: unbounded).
        feature_names: the input keys looked up in this table.
        pooling: how a bag's rows are combined; None: not combined (an unpooled table, one
            row per id).
        key_names: the output key of each feature: the feature's name, or
            ``feature@table`` when several tables look the feature up (torchrec's names).
        dtype: the weights' type in ``state_dict()``.
        init_fn: the config's initialiser (None: torchrec's default uniform).
        config: the config object as given (what ``embedding_bag_configs()`` returns).
    """

    index: int
    name: str
    dim: int
    num_embeddings: int | None
    feature_names: tuple[str, ...]
    pooling: PoolingMode | None
    key_names: tuple[str, ...]
    dtype: torch.dtype
    init_fn: Callable[[torch.Tensor], Any] | None = field(default=None, compare=False)
    config: Any = field(default=None, compare=False, repr=False)


def pooling_mode(value: Any, where: str) -> PoolingMode | None:
    """A `PoolingMode` from a mode, a name (``"sum"``) or a torchrec ``PoolingType``; None for
    ``"none"`` / ``PoolingType.NONE`` (unpooled)."""
    if isinstance(value, PoolingMode) or value is None:
        return value
    if isinstance(value, enum.Enum):  # torchrec's PoolingType, recognised without torchrec
        value = value.name
    if isinstance(value, str) and value.lower() == "none":
        return None
    if isinstance(value, str) and value.lower() in _POOLING_NAMES:
        return _POOLING_NAMES[value.lower()]
    raise ValueError(f"{where}: pooling must be SUM, MEAN, MAX or NONE, got {value!r}")


def weight_dtype(value: Any, where: str) -> torch.dtype:
    """The torch dtype of a table's weights from a name (``"fp16"``), a torch dtype or a
    torchrec ``DataType`` (FP32, FP16, BF16; the integer types are for quantized inference)."""
    try:
        return weight_dtype_of(value, f"{where}: data_type")
    except ValueError as err:
        raise ValueError(
            f"{err} (the integer types are torchrec's quantized inference formats, not "
            "trainable tables)"
        ) from None


def _checked(fields: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The fields of one table, checked; raises ValueError naming ``where``."""
    name = fields["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty string, got {name!r}")
    for key in ("embedding_dim", "num_embeddings"):
        value = fields[key]
        if value is None and key == "num_embeddings":
            continue  # unbounded: raw 64-bit ids
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = "a positive int or None (unbounded)" if key == "num_embeddings" else (
                "a positive int")  # fmt: skip
            raise ValueError(f"{where}: {key} must be {what}, got {value!r}")
    features = fields["feature_names"]
    if (
        isinstance(features, str)
        or not isinstance(features, Sequence)
        or not all(isinstance(f, str) and f for f in features)
    ):
        raise ValueError(f"{where}: feature_names must be a list of strings, got {features!r}")
    if len(set(features)) != len(features):
        raise ValueError(f"{where}: feature_names repeat a name: {list(features)}")
    init_fn = fields.get("init_fn")
    if init_fn is not None and not callable(init_fn):
        raise ValueError(f"{where}: init_fn must be callable, got {init_fn!r}")
    return {
        **fields,
        "feature_names": list(features) or [name],  # torchrec: the table's own name
        "pooling": pooling_mode(fields["pooling"], where),
        "data_type": weight_dtype(fields.get("data_type", "fp32"), where),
    }


def _fields_of(cfg: Any, index: int, pooled: bool) -> dict[str, Any]:
    """A config's fields; a config without a pooling (a dict, torchrec's `EmbeddingConfig`)
    takes the collection's kind: SUM when ``pooled``, else none."""
    defaults = {**_OPTIONAL, "pooling": PoolingMode.SUM if pooled else None}
    if isinstance(cfg, Mapping):
        missing = {"name", "embedding_dim", "num_embeddings"} - set(cfg)
        if missing:
            raise ValueError(f"table config {index}: missing {sorted(missing)}")
        return {"feature_names": [], "pooling": defaults["pooling"], **cfg}
    if isinstance(cfg, TableConfig) or type(cfg).__name__ in _CONFIG_TYPES:
        # torchrec's configs are read by their fields, so torchrec need not be imported.
        fields = {k: getattr(cfg, k) for k in _FIELDS}
        return {**fields, **{k: getattr(cfg, k, v) for k, v in defaults.items()}}
    raise TypeError(
        f"table config {index}: expected a TableConfig, torchrec EmbeddingBagConfig, "
        f"EmbeddingConfig or dict, got {type(cfg).__name__}"
    )


def _check_kind(pooling: PoolingMode | None, pooled: bool, where: str) -> None:
    if pooled and pooling is None:
        raise ValueError(
            f"{where}: pooling NONE (one row per id) in a bag collection, which pools every "
            "table: look unpooled tables up with embcache.CachedEmbeddingCollection (a model "
            "may hold both kinds, one collection each)"
        )
    if not pooled and pooling is not None:
        raise ValueError(
            f"{where}: pooling {pooling.name} in a CachedEmbeddingCollection, which looks up "
            "one row per id: give pooling='none' (or a torchrec EmbeddingConfig), or pool it "
            "in a CachedEmbeddingBagCollection (a model may hold both kinds, one collection "
            "each)"
        )


def normalize_tables(configs: Sequence[Any], pooled: bool = True) -> list[Table]:
    """Validate table configs (`TableConfig`, torchrec `EmbeddingBagConfig` or
    `EmbeddingConfig`, or dicts with ``name``, ``embedding_dim``, ``num_embeddings`` and
    optional ``feature_names``, ``pooling``, ``init_fn``, ``data_type``). An empty list is a
    collection of no tables.

    Args:
        configs: the tables.
        pooled: the collection's kind: every table pooled (a bag collection), or every table
            unpooled (``pooling="none"``: a sequence collection).

    Raises:
        TypeError: a config of another type.
        ValueError: missing or bad fields, duplicate table or feature names, a table of the
            other kind.
    """
    if isinstance(configs, (str, bytes, Mapping)) or not isinstance(configs, Sequence):
        raise TypeError(
            f"tables must be a list of TableConfig, EmbeddingBagConfig or dicts, got {configs!r}"
        )
    checked: list[dict[str, Any]] = []
    for index, cfg in enumerate(configs):
        raw = _fields_of(cfg, index, pooled)
        where = f"table {raw['name']!r}" if isinstance(raw["name"], str) else f"table {index}"
        fields = _checked(raw, where)
        _check_kind(fields["pooling"], pooled, where)
        if any(f["name"] == fields["name"] for f in checked):
            raise ValueError(f"{where}: duplicate table name")
        checked.append(fields)
    # torchrec's output names: a feature looked up by several tables is "feature@table".
    uses: dict[str, int] = {}
    for fields in checked:
        for feature in fields["feature_names"]:
            uses[feature] = uses.get(feature, 0) + 1
    return [
        Table(
            index=index,
            name=fields["name"],
            dim=fields["embedding_dim"],
            num_embeddings=fields["num_embeddings"],
            feature_names=tuple(fields["feature_names"]),
            pooling=fields["pooling"],
            key_names=tuple(
                f"{f}@{fields['name']}" if uses[f] > 1 else f for f in fields["feature_names"]
            ),
            dtype=fields["data_type"],
            init_fn=fields.get("init_fn"),
            config=cfg,
        )
        for index, (fields, cfg) in enumerate(zip(checked, configs, strict=True))
    ]
