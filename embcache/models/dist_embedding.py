"""DistEmbedding: one embedding table in the KV tier, RecStore's single-table module.

Forward pulls the rows of ``ids`` through a `DistTensor`; backward dedups the ids
(``torch.unique`` + ``index_add_``) and appends ``(ids, grads)`` to ``_trace``; `SparseSGD`
then updates in Python: read the rows, ``w - lr * g``, write them back.
"""

from __future__ import annotations

import torch
from torch import nn

from embcache.distributed.dist_tensor import DistTensor
from embcache.distributed.kv_client import InitFunc


class DistEmbedding(nn.Module):
    """Args:
    num_embeddings: rows.
    embedding_dim: columns.
    name: the table's name in the KV tier.
    init_func: ``init_func(shape, dtype)``; None: default per-id initialiser.
    lr: the learning rate `SparseSGD` uses when given none.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        name: str,
        init_func: InitFunc | None = None,
        lr: float = 0.01,
    ) -> None:
        super().__init__()
        self._sparse_kind = "dist_embedding"  # how sparse optimizers recognise the module
        self.name = name
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.lr = lr
        self.weight = DistTensor((num_embeddings, embedding_dim), torch.float32, name, init_func)
        self._trace: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._grad_anchor = torch.empty(0, requires_grad=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``[*ids.shape, embedding_dim]``."""
        if torch.is_grad_enabled() and self._trace:
            raise RuntimeError(
                f"DistEmbedding {self.name!r}: forward while the previous backward's gradients "
                "are still in _trace; call optimizer.step() or zero_grad() first"
            )
        return _DistLookup.apply(self._grad_anchor, self, torch.as_tensor(ids))

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none
        self._trace = []


class _DistLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, module, ids):
        ctx.module, ctx.ids = module, ids
        return module.weight[ids]

    @staticmethod
    def backward(ctx, grad_out):
        ids = ctx.ids.reshape(-1).to(torch.int64)
        grads = grad_out.reshape(ids.numel(), -1).float()
        unique, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, grads)
        ctx.module._trace.append((unique, summed))
        return None, None, None
