"""The modules of a model whose table rows a checkpoint holds, as `save` and `load` both find
them: cached collections (their tables behind their caches), RecStore `DistEmbedding`s (one
tensor of their KV client each) and the tensors of a KV client given on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from embcache.cache.hot_cache import HotCache
from embcache.checkpoint.verify import dense_state
from embcache.engine.interface import CachedCollectionInterface
from embcache.kv.base import Store, TableSpec
from embcache.recstore.dist_embedding import DistEmbedding
from embcache.recstore.kv_client import KVClient

KV_CLIENT_MODULE = "<kv_client>"
"""The module name under which the tensors of `save`'s ``kv_client`` are recorded."""


@dataclass
class RowHolder:
    """A module whose table rows live in a tier: a cached collection (its tables behind its
    caches) or a `DistEmbedding` (one tensor of its KV client)."""

    store: Store
    tables: list[str]
    settle: Callable[[], None]  # before reading the tier: write everything pending to it
    reset: Callable[[], None]  # before writing the tier: drop what the module holds of it
    caches: Callable[[], list[HotCache]]  # its device caches (their policy state is saved too)
    fusion_k: int | None = None  # a collection's: raw ids of unbounded tables fold to it
    specs: dict[str, TableSpec] | None = None  # a collection's own specs (init kept in step)


def row_holders(model: nn.Module, kv_client: KVClient | None = None) -> list[tuple[str, RowHolder]]:
    """``(module name, rows)`` of every module of ``model`` whose rows live in a tier, in
    ``named_modules`` order, then the tensors of ``kv_client`` that no `DistEmbedding` of the
    model holds (under `KV_CLIENT_MODULE`)."""
    found: list[tuple[str, RowHolder]] = []
    dist_names: set[str] = set()
    for name, m in model.named_modules():
        if isinstance(m, CachedCollectionInterface):
            tables = [t.name for t in m.tables]
            rows = RowHolder(
                m.store, tables, m.flush, m.invalidate_caches, m.caches, m.fusion_k, m.specs
            )
            found.append((name, rows))
        elif isinstance(m, DistEmbedding):
            client = m.weight.client
            rows = RowHolder(client.store, [m.name], client.flush, client.flush, list)
            found.append((name, rows))
            if client is kv_client:
                dist_names.add(m.name)
    if kv_client is not None:
        # Its own tensors (`init_data`, DistTensor) that no DistEmbedding above holds; a
        # collection's tables registered on it are saved with the collection.
        names = [n for n in kv_client.tier_names() if n not in dist_names]
        found.append(
            (
                KV_CLIENT_MODULE,
                RowHolder(kv_client.store, names, kv_client.flush, kv_client.flush, list),
            )
        )
    return found


def model_dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's dense state: every parameter and persistent buffer outside its cached
    collections (`verify.dense_state`)."""
    return dense_state(model, CachedCollectionInterface)
