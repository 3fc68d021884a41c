"""Table configs as users give them (torchrec dataclasses or RecStore-style dicts), normalised."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchrec import EmbeddingBagConfig, PoolingType

from embcache.kernels.pooling import PoolingMode

_POOLING_NAMES = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "max": PoolingMode.MAX}


@dataclass(frozen=True)
class TableConfig:
    """One table of a collection, after validation.

    Attributes:
        index: position in the collection; the prefix of the table's fused ids.
        name: table name (torchrec's ``EmbeddingBagConfig.name``).
        dim: embedding dim.
        num_embeddings: rows.
        feature_names: the KJT keys looked up in this table.
        pooling: how a bag's rows are combined.
    """

    index: int
    name: str
    dim: int
    num_embeddings: int
    feature_names: tuple[str, ...]
    pooling: PoolingMode


def _pooling(value: Any, where: str) -> PoolingMode:
    if isinstance(value, PoolingMode):
        return value
    if isinstance(value, PoolingType):
        if value is PoolingType.NONE:
            raise ValueError(f"{where}: PoolingType.NONE (sequence embeddings) is not supported")
        return PoolingMode[value.name]
    if isinstance(value, str) and value.lower() in _POOLING_NAMES:
        return _POOLING_NAMES[value.lower()]
    raise ValueError(f"{where}: pooling must be SUM, MEAN or MAX, got {value!r}")


def normalize_tables(
    configs: Sequence[EmbeddingBagConfig | Mapping[str, Any]],
) -> list[TableConfig]:
    """Validate table configs (torchrec `EmbeddingBagConfig` objects or dicts with ``name``,
    ``embedding_dim``, ``num_embeddings``, ``feature_names`` and optional ``pooling``).

    Raises:
        TypeError: a config of another type.
        ValueError: missing or bad fields, duplicate table names, a feature in two tables.
    """
    if isinstance(configs, (str, bytes, Mapping)) or not isinstance(configs, Sequence):
        raise TypeError(f"tables must be a list of EmbeddingBagConfig or dicts, got {configs!r}")
    if not configs:
        raise ValueError("a collection needs at least one table")
    tables: list[TableConfig] = []
    owner: dict[str, str] = {}
    for index, cfg in enumerate(configs):
        if isinstance(cfg, EmbeddingBagConfig):
            fields = {
                "name": cfg.name,
                "embedding_dim": cfg.embedding_dim,
                "num_embeddings": cfg.num_embeddings,
                "feature_names": cfg.feature_names,
                "pooling": cfg.pooling,
            }
        elif isinstance(cfg, Mapping):
            missing = {"name", "embedding_dim", "num_embeddings", "feature_names"} - set(cfg)
            if missing:
                raise ValueError(f"table config {index}: missing {sorted(missing)}")
            fields = {"pooling": PoolingType.SUM, **cfg}
        else:
            raise TypeError(
                f"table config {index}: expected EmbeddingBagConfig or dict, "
                f"got {type(cfg).__name__}"
            )
        name = fields["name"]
        where = f"table {name!r}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"table config {index}: name must be a non-empty string")
        if any(t.name == name for t in tables):
            raise ValueError(f"{where}: duplicate table name")
        for key in ("embedding_dim", "num_embeddings"):
            value = fields[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
        features = fields["feature_names"]
        if isinstance(features, str) or not features:
            raise ValueError(f"{where}: feature_names must be a non-empty list of strings")
        for feature in features:
            if feature in owner:
                raise ValueError(
                    f"{where}: feature {feature!r} is already looked up in table {owner[feature]!r}"
                )
            owner[feature] = name
        tables.append(
            TableConfig(
                index=index,
                name=name,
                dim=fields["embedding_dim"],
                num_embeddings=fields["num_embeddings"],
                feature_names=tuple(features),
                pooling=_pooling(fields["pooling"], where),
            )
        )
    return tables
