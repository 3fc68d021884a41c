"""DistTensor: a 2-D tensor stored in the KV tier, indexed by row ids (RecStore/DGL style)."""

from __future__ import annotations

import torch

from embcache.recstore.kv_client import InitFunc, get_kv_client


class DistTensor:
    """``t[ids]`` pulls rows through the KV client; ``t[ids] = rows`` pushes them.

    Args:
        shape: ``(rows, dim)``.
        dtype: element type of pulled rows (stored as float32).
        name: the tensor's name in the KV tier; the same name with another shape or dtype is
            a ValueError, the same name with the same ones attaches to the same rows.
        init_func: ``init_func(shape, dtype)`` giving the initial tensor; None: zeros (as
            in RecStore).
    """

    def __init__(
        self,
        shape: tuple[int, int],
        dtype: torch.dtype = torch.float32,
        name: str | None = None,
        init_func: InitFunc | None = None,
    ) -> None:
        if name is None:
            raise ValueError("DistTensor needs a name (its key in the KV tier)")
        self.client = get_kv_client()
        self.client.init_data(name, tuple(shape), dtype, init_func=init_func)
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        return self.client.pull(self.name, ids).reshape(*ids.shape, self.shape[1])

    def __setitem__(self, ids, rows) -> None:
        ids = torch.as_tensor(ids)
        self.client.push(
            self.name, ids.reshape(-1), torch.as_tensor(rows).reshape(-1, self.shape[1])
        )

    def __repr__(self) -> str:
        return f"DistTensor(name={self.name!r}, shape={self.shape}, dtype={self.dtype})"
