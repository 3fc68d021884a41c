"""What `CachedCollectionInterface._setup` (`engine.interface.build_collection`) makes of a
collection's tables beside its engines: the config objects `embedding_bag_configs` returns
(`as_config`), and the tables declared in the tier with their row initialisers
(`declare_tables`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from embcache.cache.config import CacheConfig
from embcache.engine.options import CollectionOptions
from embcache.engine.row_init import table_inits
from embcache.engine.tables import Table, TableConfig
from embcache.kv.base import Store, TableSpec


def as_config(table: Table, cfg: Any) -> Any:
    """The config object `embedding_bag_configs` returns for one table: ``cfg`` as given
    (torchrec's ``EmbeddingBagConfig``, its ``feature_names`` filled in as torchrec fills them),
    a `TableConfig` for a dict."""
    if isinstance(cfg, Mapping):
        return TableConfig(
            name=table.name,
            embedding_dim=table.dim,
            num_embeddings=table.num_embeddings,
            feature_names=list(table.feature_names),
            pooling=table.pooling,
            init_fn=table.init_fn,
            data_type=table.dtype,
        )
    if not cfg.feature_names:
        cfg.feature_names = list(table.feature_names)  # torchrec fills it in the same way
    return cfg


def _whole_tables(tables: Sequence[Table], cache: CacheConfig, device: torch.device) -> bool:
    """Whether every cache (one per dim, or per table: `CacheConfig.split`) holds all the rows
    of its tables."""
    for config, mine in cache.split(tables):
        sizes = [t.num_embeddings for t in mine]
        if None in sizes:
            return False
        rows = sum(s for s in sizes if s is not None)
        if config.rows_for(rows, mine[0].dim, device) < rows:
            return False
    return True


def declare_tables(
    store: Store,
    tables: Sequence[Table],
    options: CollectionOptions,
    cache: CacheConfig,
    device: torch.device,
    per_table: bool,
) -> dict[str, TableSpec]:
    """Declare every table in ``store`` (`Store.init_table`) and return their specs by name.

    The rows' initialisers are torchrec's draws when the whole ``options.cache`` holds every
    row (no ``tier_capacity``), else per-id draws (`engine.row_init`); ``cache`` (a sharded
    rank's share of it, or the whole) gives each table's precision and tier capacity.
    ``per_table``: torchrec's ``EmbeddingCollection`` draws (each table's ``normal_`` then its
    ``init_fn``) rather than the bag collection's.
    """
    whole_cfg = options.cache or CacheConfig()
    whole = whole_cfg.tier_capacity is None and _whole_tables(tables, whole_cfg, device)
    seed = options.seed
    inits = table_inits(tables, seed, whole, device, per_table=per_table)
    weight_dtype = cache.weight_dtype
    assert weight_dtype is None or isinstance(weight_dtype, torch.dtype)  # __post_init__
    specs = {
        t.name: TableSpec(
            t.name,
            t.dim,
            t.num_embeddings,
            init=inits[t.name],
            seed=seed or 0,
            dtype=weight_dtype or t.dtype,
            capacity=cache.tier_capacity_of(t.name),
            score=cache.tier_policy,
        )
        for t in tables
    }
    for spec in specs.values():
        store.init_table(spec)
    return specs
