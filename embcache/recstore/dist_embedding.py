"""DistEmbedding: one embedding table in the KV tier, RecStore's single-table module.

Forward pulls the rows of ``ids`` through a `DistTensor` (the tier is on the host) and returns
them on ``ids``' device; backward sums the gradient rows of equal ids on the gradient's device
(`aggregate_grads`: deterministic there too) and appends ``(ids, grads)`` to ``_trace``;
`SparseSGD` then updates in Python: read the rows, ``w - lr * g``, write them back. Its rows
are its ``state_dict()`` (``weight``, ``[num_embeddings, embedding_dim]``) and go into
`embcache.save` checkpoints with whatever optimizer state its tensor keeps beside them.

One table, never one per rank. RecStore's table is one parameter-server table that every worker
reads and updates; a DistEmbedding's is a tensor of this process's KV client. In a process
group of several ranks each rank's would be its own copy, trained on that rank's batches only,
so a DistEmbedding refuses to be built there (and to run a forward there, for a group
initialised after it), before it declares any row, naming what is one table over the ranks:
`embcache.distributed.ShardedEmbeddingCollection` (one row per id, rows sharded over the
ranks, trained by the same `SparseSGD`) or `embcache.distributed.ShardedKVClient` (RecStore's KV
calls over sharded rows). A Redis tier shared by the ranks does not make the copies one table:
each rank's step reads its rows, subtracts its own gradient and writes them back, so the ranks'
steps overwrite each other's updates (and a host tier is each process's own). With
``allow_unsharded_replicas=True`` each rank keeps its own table on purpose, as the collections
allow.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from embcache.engine.lookup import lookup
from embcache.kernels.optim import OptimRule, aggregate_grads
from embcache.recstore.dist_tensor import DistTensor
from embcache.recstore.kv_client import InitFunc


class DistEmbedding(nn.Module):
    """Args:
    num_embeddings: rows.
    embedding_dim: columns.
    name: the table's name in the KV tier.
    init_func: ``init_func(shape, dtype)``; None: zeros (as in RecStore).
    lr: the learning rate `SparseSGD` uses when given none.
    allow_unsharded_replicas: in a process group of several ranks, let each rank train its own
        table (otherwise refused: `check_not_replicated`).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        name: str,
        init_func: InitFunc | None = None,
        lr: float = 0.01,
        *,
        allow_unsharded_replicas: bool = False,
    ) -> None:
        super().__init__()
        self.name = name
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.lr = lr
        self.allow_unsharded_replicas = bool(allow_unsharded_replicas)
        self.check_not_replicated()  # before the tensor (and its rows) is declared
        self.weight = DistTensor((num_embeddings, embedding_dim), torch.float32, name, init_func)
        self._trace: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._grad_anchor = torch.empty(0, requires_grad=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``[*ids.shape, embedding_dim]``, on ``ids``' device."""
        self.check_not_replicated()
        if torch.is_grad_enabled() and self._trace:
            raise RuntimeError(
                f"DistEmbedding {self.name!r}: forward while the previous backward's gradients "
                "are still in _trace; call optimizer.step() or zero_grad() first"
            )
        return lookup(self._grad_anchor, _DistStep(self, torch.as_tensor(ids)))[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none
        self._trace = []

    def check_not_replicated(self) -> None:
        """Refuse to be one rank's copy of the table (unless built with
        ``allow_unsharded_replicas=True``): in an initialised process group of more than one
        rank, each rank's DistEmbedding would be a table of its own (see the module docstring).
        A process group of one rank is fine.

        Raises:
            RuntimeError: naming `embcache.distributed.ShardedEmbeddingCollection` and
                `embcache.distributed.ShardedKVClient`.
        """
        dist = torch.distributed
        if self.allow_unsharded_replicas or not dist.is_available() or not dist.is_initialized():
            return
        world = dist.get_world_size()
        if world > 1:
            raise RuntimeError(
                f"DistEmbedding {self.name!r} is one tensor of this process's KV client, but the "
                f"process group has {world} ranks: each rank would train its own copy of the "
                "table and the copies would silently diverge (a Redis tier shared by the ranks "
                "does not join them: each rank's SparseSGD step reads its rows, subtracts its "
                "own gradient and writes them back over the other ranks' updates). For one "
                "table over the ranks use embcache.distributed.ShardedEmbeddingCollection (one "
                "row per id, as DistEmbedding; rows sharded over the ranks; trained by "
                f"embcache.SparseSGD): tables=[EmbeddingConfig(name={self.name!r}, "
                f"embedding_dim={self.embedding_dim}, num_embeddings={self.num_embeddings}, "
                f"feature_names=[{self.name!r}])], the ids as a KeyedJaggedTensor of that "
                f"feature, the rows in out[{self.name!r}].values(); or "
                "embcache.distributed.ShardedKVClient for RecStore's KV calls (pull, "
                "update_async) over sharded rows. To keep one independent table per rank on "
                "purpose, build it with allow_unsharded_replicas=True."
            )

    # -- what a sparse optimizer drives (embcache.optim.SparseParameters) ------------------

    def attach_sparse_optimizer(self, optimizer: Any) -> None:
        if optimizer.rule is not OptimRule.SGD:
            raise TypeError(
                f"{type(optimizer).__name__} cannot update DistEmbedding {self.name!r}: "
                "DistEmbedding is updated the RecStore way, by SparseSGD only"
            )

    def sparse_gradients(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        return [(self.name, ids, grads) for ids, grads in self._trace]

    def apply_sparse_gradients(self, optimizer: Any) -> None:
        """RecStore's Python-side SGD: sum the gradients per id, read the rows,
        ``w - lr * g``, write them back."""
        entries, self._trace = self._trace, []
        if not entries:
            return
        ids = torch.cat([ids for ids, _ in entries])
        grads = torch.cat([g for _, g in entries])
        unique, summed = aggregate_grads(ids, grads)
        rows = self.weight[unique]  # on the host, where the tier is
        self.weight[unique] = rows - optimizer.lr * summed.to(rows.device, rows.dtype)

    def sparse_tables(self) -> list[Any]:
        return []  # SGD keeps no state beside the rows

    def flush(self) -> None:
        """Every write of its KV client applied (`KVClient.flush`; the rows are written at
        each step)."""
        self.weight.client.flush()

    def table_rows(self, table: str) -> torch.Tensor:
        return self.weight[torch.arange(self.num_embeddings)]

    # -- state_dict: the rows, under ``weight`` (as nn.Embedding names them) --------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[f"{prefix}weight"] = self.weight[torch.arange(self.num_embeddings)]

    def _load_from_state_dict(
        self,
        state_dict,
        prefix,
        local_metadata,
        strict,
        missing_keys,
        unexpected_keys,
        error_msgs,
    ) -> None:
        key = f"{prefix}weight"
        # Every key under this module's prefix is ours: it has no parameters or children.
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k != key)
        if key not in state_dict:
            missing_keys.append(key)
            return
        value = state_dict[key]
        shape = (self.num_embeddings, self.embedding_dim)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            error_msgs.append(
                f"{key} has dtype {getattr(value, 'dtype', type(value).__name__)}; "
                "DistEmbedding rows must be floating point"
            )
        elif tuple(value.shape) != shape:
            error_msgs.append(
                f"size mismatch for {key}: checkpoint has {tuple(value.shape)}, DistEmbedding "
                f"{self.name!r} is {shape}"
            )
        elif not bool(torch.isfinite(value).all()):
            error_msgs.append(f"{key} holds NaN or Inf values")
        if error_msgs or (strict and unexpected_keys):
            return  # nn.Module raises with these messages; nothing was written
        self.weight[torch.arange(self.num_embeddings)] = value.detach()

    def write_table_rows(self, table: str, rows: torch.Tensor, columns: slice) -> None:
        raise RuntimeError("DistEmbedding holds no optimizer state to write")


class _DistStep:
    """One lookup of the tensor's rows, as `engine.lookup.CachedLookup` runs it: backward
    records the gradient of each distinct id (duplicates summed) for the optimizer."""

    anchor_grad = False

    def __init__(self, module: DistEmbedding, ids: torch.Tensor) -> None:
        self.module, self.ids = module, ids

    def forward(self) -> tuple[torch.Tensor, ...]:
        return (self.module.weight[self.ids].to(self.ids.device),)

    def backward(self, grads: tuple[torch.Tensor, ...]) -> None:
        grads_ = grads[0].reshape(self.ids.numel(), -1).float().contiguous()
        ids = self.ids.reshape(-1).to(device=grads_.device, dtype=torch.int64)
        self.module._trace.append(aggregate_grads(ids, grads_))
