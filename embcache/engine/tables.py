"""Table configs as users give them, normalised: torchrec `EmbeddingBagConfig` objects (where
torchrec is installed), embcache's own `TableConfig`, or RecStore-style dicts.

    TableConfig(name="t0", embedding_dim=16, num_embeddings=10_000, feature_names=["f0"])
    {"name": "t0", "embedding_dim": 16, "num_embeddings": 10_000, "feature_names": ["f0"]}
    torchrec.EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=10_000,
                                feature_names=["f0"], pooling=PoolingType.SUM)

all describe the same table; `normalize_tables` turns a list of them into `Table` records.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from embcache.kernels.pooling import PoolingMode

_POOLING_NAMES = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "max": PoolingMode.MAX}
_FIELDS = ("name", "embedding_dim", "num_embeddings", "feature_names")


@dataclass(kw_only=True)
class TableConfig:
    """One embedding table, with the field names of torchrec's `EmbeddingBagConfig` (so code
    can move between the two unchanged); keyword arguments only.

    Attributes:
        name: the table's name (unique in a collection; its rows are stored under it).
        embedding_dim: columns of a row.
        num_embeddings: rows; ids of this table are ``0 <= id < num_embeddings``.
        feature_names: the input keys looked up in this table.
        pooling: how a bag's rows are combined: ``"sum"``, ``"mean"`` or ``"max"`` (or a
            `PoolingMode`, or torchrec's ``PoolingType.SUM``/``MEAN``).
    """

    name: str
    embedding_dim: int
    num_embeddings: int
    feature_names: list[str] = field(default_factory=list)
    pooling: PoolingMode | str | Any = PoolingMode.SUM

    def __post_init__(self) -> None:
        _checked(self.__dict__, f"TableConfig {self.name!r}")


@dataclass(frozen=True)
class Table:
    """One table of a collection, after validation.

    Attributes:
        index: position in the collection; the prefix of the table's fused ids.
        name: table name.
        dim: embedding dim.
        num_embeddings: rows.
        feature_names: the input keys looked up in this table.
        pooling: how a bag's rows are combined.
    """

    index: int
    name: str
    dim: int
    num_embeddings: int
    feature_names: tuple[str, ...]
    pooling: PoolingMode


def pooling_mode(value: Any, where: str) -> PoolingMode:
    """A `PoolingMode` from a mode, a name (``"sum"``) or a torchrec ``PoolingType``."""
    if isinstance(value, PoolingMode):
        return value
    if isinstance(value, enum.Enum):  # torchrec's PoolingType, recognised without torchrec
        if value.name == "NONE":
            raise ValueError(f"{where}: PoolingType.NONE (sequence embeddings) is not supported")
        value = value.name
    if isinstance(value, str) and value.lower() in _POOLING_NAMES:
        return _POOLING_NAMES[value.lower()]
    raise ValueError(f"{where}: pooling must be SUM, MEAN or MAX, got {value!r}")


def _checked(fields: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The fields of one table, checked; raises ValueError naming ``where``."""
    name = fields["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty string, got {name!r}")
    for key in ("embedding_dim", "num_embeddings"):
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
    features = fields["feature_names"]
    if (
        isinstance(features, str)
        or not isinstance(features, Sequence)
        or not features
        or not all(isinstance(f, str) and f for f in features)
    ):
        raise ValueError(
            f"{where}: feature_names must be a non-empty list of strings, got {features!r}"
        )
    return {**fields, "pooling": pooling_mode(fields.get("pooling", PoolingMode.SUM), where)}


def _fields_of(cfg: Any, index: int) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        missing = set(_FIELDS) - set(cfg)
        if missing:
            raise ValueError(f"table config {index}: missing {sorted(missing)}")
        return dict(cfg)
    if isinstance(cfg, TableConfig) or type(cfg).__name__ == "EmbeddingBagConfig":
        # torchrec's EmbeddingBagConfig is read by its fields, so torchrec need not be imported.
        return {k: getattr(cfg, k) for k in (*_FIELDS, "pooling")}
    raise TypeError(
        f"table config {index}: expected a TableConfig, torchrec EmbeddingBagConfig or dict, "
        f"got {type(cfg).__name__}"
    )


def normalize_tables(configs: Sequence[Any]) -> list[Table]:
    """Validate table configs (`TableConfig`, torchrec `EmbeddingBagConfig`, or dicts with
    ``name``, ``embedding_dim``, ``num_embeddings``, ``feature_names`` and optional
    ``pooling``).

    Raises:
        TypeError: a config of another type.
        ValueError: missing or bad fields, duplicate table names, a feature in two tables.
    """
    if isinstance(configs, (str, bytes, Mapping)) or not isinstance(configs, Sequence):
        raise TypeError(
            f"tables must be a list of TableConfig, EmbeddingBagConfig or dicts, got {configs!r}"
        )
    if not configs:
        raise ValueError("a collection needs at least one table")
    tables: list[Table] = []
    owner: dict[str, str] = {}
    for index, cfg in enumerate(configs):
        raw = _fields_of(cfg, index)
        where = f"table {raw['name']!r}" if isinstance(raw["name"], str) else f"table {index}"
        fields = _checked(raw, where)
        name = fields["name"]
        if any(t.name == name for t in tables):
            raise ValueError(f"{where}: duplicate table name")
        for feature in fields["feature_names"]:
            if feature in owner:
                raise ValueError(
                    f"{where}: feature {feature!r} is already looked up in table {owner[feature]!r}"
                )
            owner[feature] = name
        tables.append(
            Table(
                index=index,
                name=name,
                dim=fields["embedding_dim"],
                num_embeddings=fields["num_embeddings"],
                feature_names=tuple(fields["feature_names"]),
                pooling=fields["pooling"],
            )
        )
    return tables
