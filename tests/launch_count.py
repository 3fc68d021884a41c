"""Counting device launches on the CPU: the kernels a training step would queue on a GPU.

`LaunchCounter` counts, while active, every Triton kernel launch (through the interpreter,
``TRITON_INTERPRET=1``) and every aten op that would run a kernel on the device: ops that only
make a view or read metadata launch nothing and are not counted, nor are ops in the tiers'
code, which only ever sees host tensors (`tests.sync_count._on_host_side`). On a GPU each
launch costs the host a few microseconds whatever its size, so a step whose launches grow with
the number of tables or dims is host-bound on wide models.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import embcache
from tests.sync_count import _on_host_side

# Ops that launch nothing on a GPU: views, metadata, and allocations without a fill.
_NO_LAUNCH = {
    "aten.view", "aten._unsafe_view", "aten.as_strided", "aten.slice", "aten.select",
    "aten.expand", "aten.permute", "aten.transpose", "aten.t", "aten.unsqueeze", "aten.squeeze",
    "aten.reshape", "aten.alias", "aten.detach", "aten.split", "aten.split_with_sizes",
    "aten.unbind", "aten.narrow", "aten.empty", "aten.empty_like", "aten.empty_strided",
    "aten.new_empty", "aten.new_empty_strided", "aten.lift_fresh", "aten._to_copy_meta",
    "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.is_same_size", "aten.set_",
    "aten.resize_", "aten._local_scalar_dense", "aten.unfold", "aten.diagonal", "aten.chunk",
}  # fmt: skip


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts
        # Inside an interpreted Triton launch: the interpreter's own copies of the kernel's
        # tensor arguments (to its host buffers and back, one ``copy_`` per storage) are no
        # launch on a GPU, where the kernel is the one launch.
        self.in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name not in _NO_LAUNCH and not self.in_triton and not _on_host_side():
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class LaunchCounter:
    """``with LaunchCounter() as c: ...`` then ``c.total``, ``c.triton`` and ``c.counts``."""

    def __enter__(self) -> LaunchCounter:
        from triton.runtime import interpreter

        self.counts: Counter = Counter()
        self._mode = _Ops(self.counts)
        self._mode.__enter__()
        run = interpreter.InterpretedFunction.run
        thread, counts = threading.get_ident(), self.counts

        mode = self._mode

        def counted(fn, *args, **kwargs):
            if threading.get_ident() != thread:
                return run(fn, *args, **kwargs)
            counts[f"triton.{fn.fn.__name__}"] += 1
            mode.in_triton += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                mode.in_triton -= 1

        self._restore = (interpreter.InterpretedFunction, run)
        interpreter.InterpretedFunction.run = counted
        return self

    def __exit__(self, *exc) -> None:
        cls, run = self._restore
        cls.run = run
        self._mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def triton(self) -> int:
        return sum(v for k, v in self.counts.items() if k.startswith("triton."))


def counted_collection(num_tables: int, num_dims: int, load_factor: float, rows: int = 1000):
    """What the device-path counts run (`tests/engine/test_launch_count.py`,
    `benchmarks/device_counts.py`): a collection of ``num_tables`` tables of ``rows`` rows over
    ``num_dims`` dims (8, 16, ...), ``load_factor`` of them cached in 4-way sets, with sparse
    AdaGrad; and ``batch(samples, gen)``, random bags of 1 to 4 ids for each of its features.
    With 1,000 rows a table, a tenth cached is less than the largest batches' unique rows
    (the overflow path through the scratch area); with 10,000, a batch fits."""
    tables = [
        embcache.TableConfig(
            name=f"t{i}",
            embedding_dim=8 * (1 + i % num_dims),
            num_embeddings=rows,
            feature_names=[f"f{i}"],
        )
        for i in range(num_tables)
    ]
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=tables, cache=embcache.CacheConfig(load_factor=load_factor, ways=4)
    )
    opt = embcache.SparseAdaGrad([ebc], lr=0.1)
    keys = [f"f{i}" for i in range(num_tables)]

    def batch(samples: int, gen: torch.Generator) -> embcache.JaggedBatch:
        lengths = torch.randint(1, 5, (num_tables * samples,), generator=gen)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        return embcache.JaggedBatch.from_lengths(keys, values, lengths)

    return ebc, opt, batch
