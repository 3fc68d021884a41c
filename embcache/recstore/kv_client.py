"""A KV client with RecStore's calls over a tier: named 2-D tensors read and written by row id,
and a backend optimizer that `update_async` hands gradients to.

    kv = get_kv_client()
    kv.init_data("user", (1000, 16), torch.float32)          # zeros; backend SGD, lr 0.01
    kv.init_data("item", (500, 16), optimizer=KVOptimizer("AdaGrad", lr=0.05))
    rows = kv.pull("user", ids)                               # [n, 16]
    handle = kv.update_async("user", ids, grads)              # SGD steps the rows (background)
    kv.wait(handle)
    kv.push("user", ids, rows)                                # overwrite (optimizer state kept)
    kv.add_async("user", ids, deltas)                         # raw: rows += deltas

RecStore's call shapes are accepted beside embcache's, so RecStore code runs unchanged:
``init_data(name, shape, dtype, part_policy, init_func, is_gdata, base_offset,
initialize_values)`` (embcache's positional ``init_data(name, shape, dtype, init_func)`` still
works: a callable fourth argument is the init_func), ``prefetch(ids, name=None)`` beside
``prefetch(name, ids)``, ``wait_and_get(handle, embedding_dim, device=)``, ``push(name, ids,
data=)`` (``rows=`` too), ``update(name, ids, grads)`` (synchronous), ``data_name_list()``,
``get_data_meta(name) -> (dtype, shape)``, ``flush_async_updates()``, and
``save_checkpoint(path, metadata)`` / ``load_checkpoint(path, metadata)``. Handles are
`KVHandle` objects (RecStore's are ints); pass them back as they are.

Backend optimizer. As RecStore's parameter server does, `update_async(name, ids, grads)` sums the
gradients of duplicate ids, then applies the tensor's optimizer — SGD, AdaGrad, RowWiseAdaGrad,
Adam or AdamW (`KVOptimizer`: every rule of `kernels.optim_rules.RULES` by its RecStore name,
the same rules and formulas as the sparse optimizers) — whose state lives beside each row in
the tier (``[dim | state]``, as the caches keep it). A tensor's optimizer is given at
`init_data`, else it is the client's (``KVClient(optimizer=...)``: a `KVOptimizer`, or a mapping
with RecStore's configuration keys ``type``, ``learning_rate``, ``epsilon``, ``weight_decay``,
``beta1``, ``beta2``); the default is SGD at lr 0.01.
One learning rate per client (`KVClient.learning_rate`): its optimizer's, 0.01 unless given.
`update_async` applies it to every tensor declared without an optimizer of its own and, on a
client with a backend optimizer, to the collections' tables too. What else may ask for another
one is warned about (`KVLearningRateWarning`, once per tensor, naming both values): a tensor
declared with an optimizer of another lr (which it keeps: `init_data`), and, on a client
without a backend optimizer, a collection's table, which ``update_async`` steps as its
collection's ``step()`` does (its attached sparse optimizer's rule and lr, else SGD at the
collection's ``lr``). Give the client the optimizer (``get_kv_client(optimizer=...)``) to have
one learning rate everywhere.
A client given an optimizer has a *backend optimizer* (`KVClient.backend_optimizer`): the
collections on it are updated by it too, whatever sparse optimizer steps them (see
`RecStoreEmbeddingBagCollection`; `RecStoreEmbeddingCollection`, its unpooled twin, alike).
`push` overwrites the weights; `add_async` is the raw additive update.

Ordering. Operations on tier tensors run on one worker thread in submission order, so updates
keep their order and a `pull` (which queues behind them) sees every earlier call of this
client: read-your-writes, with or without `wait`.

A collection's tables. A `RecStoreEmbeddingBagCollection` (or `RecStoreEmbeddingCollection`)
registers its tables with its client (``module.kv_client``; `get_kv_client()` for the default
store). Calls on them go through the collection's caches, so they see and keep the rows the
training has: `pull` returns the newest copy (a dirty cached row included), `push` writes a
cached row in its slot and others in the tier, and `update_async` applies the collection's
sparse optimizer to the rows and the state in its cache (the backend optimizer when the client
has one; else the attached sparse optimizer, or without one SGD at the collection's ``lr``).
These calls run on the calling thread, between training steps, because the training thread reads
the cache slots without a lock; their handles are complete when returned.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from embcache.kernels.ids import dedup
from embcache.kernels.optim import OptimRule, RowUpdate, aggregate_grads, apply_row_update
from embcache.kernels.optim_rules import RULES, by_recstore
from embcache.kv.base import Store, TableSpec, hashed_init
from embcache.kv.url import open_store
from embcache.recstore.kv_checkpoint import load_tensors, save_tensors

InitFunc = Callable[[tuple[int, int], torch.dtype], torch.Tensor]
"""DGL/RecStore style: ``init_func(shape, dtype) -> tensor of that shape``."""

# RecStore configuration keys, and the KVOptimizer field each one sets.
_CONFIG_KEYS = {
    "type": "type",
    "learning_rate": "lr",
    "lr": "lr",
    "epsilon": "eps",
    "eps": "eps",
    "weight_decay": "weight_decay",
    "initial_accumulator_value": "initial_accumulator_value",
    "beta1": "beta1",
    "beta2": "beta2",
}


@dataclass(frozen=True)
class KVOptimizer:
    """The optimizer `KVClient.update_async` applies to a tensor (RecStore's backend optimizer).

    Attributes:
        type: a rule's RecStore name: ``"SGD"``, ``"AdaGrad"``, ``"RowWiseAdaGrad"``,
            ``"Adam"`` or ``"AdamW"`` (case, ``_`` and ``-`` ignored).
        lr: learning rate.
        eps: added to the root in the denominators (None: the rule's default, 1e-10 for
            AdaGrad, 1e-8 for RowWiseAdaGrad (FBGEMM's), Adam and AdamW).
        weight_decay: L2 coefficient added to the gradient of the updated rows (AdamW: its
            decoupled decay); None: the rule's default (AdamW 1e-2, others 0).
        initial_accumulator_value: AdaGrad's accumulator of a fresh row.
        beta1, beta2: Adam's and AdamW's moment decays.
    """

    type: str = "SGD"
    lr: float = 0.01
    eps: float | None = None
    weight_decay: float | None = None
    initial_accumulator_value: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        spec = by_recstore(self.type)
        if spec is None:
            names = ", ".join(s.recstore for s in RULES.values())
            raise ValueError(f"KVOptimizer.type={self.type!r}: the backend has {names}")
        for name in ("eps", "weight_decay"):  # None: the rule's default
            if getattr(self, name) is None:
                default = spec.hyper.get(name, 1e-10 if name == "eps" else 0.0)
                object.__setattr__(self, name, default)
        value = self.initial_accumulator_value
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"KVOptimizer.initial_accumulator_value must be >= 0, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"KVOptimizer.initial_accumulator_value must be finite, got {value}")
        self.update  # noqa: B018 (checks lr, eps and weight_decay, naming the bad one)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> KVOptimizer:
        """From RecStore's optimizer configuration (``{"type": "AdaGrad", "learning_rate":
        0.05, "epsilon": 1e-10}``; Adam's and AdamW's ``beta1``, ``beta2`` too, accepted and
        unused by the other rules); any other key is a ValueError."""
        spec = by_recstore(config.get("type", cls.type))
        fields = {}
        for key, value in config.items():
            if key not in _CONFIG_KEYS:
                raise ValueError(
                    f"unknown backend optimizer setting {key!r}; known: {sorted(_CONFIG_KEYS)}"
                )
            if key in ("beta1", "beta2") and spec is not None and "betas" not in spec.hyper:
                continue
            fields[_CONFIG_KEYS[key]] = value
        return cls(**fields)

    @property
    def rule(self) -> OptimRule:
        spec = by_recstore(self.type)
        assert spec is not None  # checked at construction
        return spec.rule

    @property
    def update(self) -> RowUpdate:
        spec = RULES[self.rule]
        group = {
            "lr": self.lr,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "lr_decay": 0.0,
            "betas": (self.beta1, self.beta2),
        }
        return RowUpdate(self.rule, **spec.update_fields(group))

    def state_dim(self, dim: int) -> int:
        """State columns beside a row of ``dim`` weights."""
        return self.update.state_dim(dim)


def as_kv_optimizer(optimizer: KVOptimizer | Mapping[str, Any] | None) -> KVOptimizer:
    """A `KVOptimizer` from itself, a RecStore configuration mapping, or None (the default)."""
    if optimizer is None:
        return KVOptimizer()
    if isinstance(optimizer, KVOptimizer):
        return optimizer
    if isinstance(optimizer, Mapping):
        return KVOptimizer.from_config(optimizer)
    raise TypeError(
        "optimizer must be a KVOptimizer or a configuration mapping, got "
        f"{type(optimizer).__name__}"
    )


class TableView(Protocol):
    """A table that lives elsewhere than this client's tier tensors (a collection's, behind its
    cache), registered with `KVClient.register`; it must not keep its collection alive. Ids are
    checked CPU int64 ``[n]``, rows CPU float32 ``[n, dim]``."""

    shape: tuple[int, int]

    def read(self, ids: torch.Tensor) -> torch.Tensor: ...

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None: ...

    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None: ...

    def add(self, ids: torch.Tensor, deltas: torch.Tensor) -> None: ...


@dataclass
class _Tensor:
    shape: tuple[int, int]
    dtype: torch.dtype
    optimizer: KVOptimizer
    base_offset: int = 0  # the id of row 0 (RecStore's base_offset)
    part_policy: Any = None  # RecStore's partition policy: kept, unused (one partition)
    steps: int = 0  # update_async calls applied (AdaGrad's step count)


class KVLearningRateWarning(UserWarning):
    """``update_async`` on a tensor applies another learning rate than its client's
    (`KVClient.learning_rate`); said once per tensor."""


class KVHandle:
    """A pending asynchronous operation; `KVClient.wait` / `wait_and_get` resolve it."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()


def _done(result: Any = None) -> KVHandle:
    future: Future = Future()
    future.set_result(result)
    return KVHandle(future)


def _embcache_order(
    name: str, part_policy: Any, init_func: Any, optimizer: Any
) -> tuple[Any, InitFunc | None, Any]:
    """`KVClient.init_data`'s ``(part_policy, init_func, optimizer)`` as RecStore's keywords
    mean them: a callable ``part_policy`` is embcache's older positional ``init_func`` (its
    order: name, shape, dtype, init_func, optimizer), and then ``init_func``'s place holds the
    ``optimizer``.

    Raises:
        TypeError: two init functions, or two optimizers.
    """
    if callable(part_policy) and not isinstance(part_policy, type):
        # embcache's positional order: (name, shape, dtype, init_func, optimizer).
        if init_func is not None and callable(init_func):
            raise TypeError(
                f"tensor {name!r}: two init functions given (part_policy and init_func)"
            )
        if init_func is not None:
            if optimizer is not None:
                raise TypeError(f"tensor {name!r}: optimizer given twice")
            optimizer = init_func
        part_policy, init_func = None, part_policy
    return part_policy, init_func, optimizer


def _check_declaration(
    name: str, shape: tuple[int, int], dtype: torch.dtype, base_offset: int
) -> None:
    """`KVClient.init_data`'s name, shape, dtype and base_offset checked.

    Raises:
        ValueError, TypeError: one of them is not what a tensor takes.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
    if len(shape) != 2 or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape
    ):
        raise ValueError(f"tensor {name!r}: shape must be (rows, dim) positive ints, got {shape!r}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"tensor {name!r}: dtype must be a floating dtype, got {dtype}")
    if isinstance(base_offset, bool) or not isinstance(base_offset, int) or base_offset < 0:
        raise ValueError(f"tensor {name!r}: base_offset must be an int >= 0, got {base_offset!r}")


class KVClient:
    """Named 2-D float tensors stored row-wise in a tier, read and written by id.

    Args:
        store: the tier (a `Store`, a URL, or None for an in-process HostKV).
        optimizer: the backend optimizer (`backend_optimizer`): of tensors declared without one,
            and of the collections on this client. None: tensors get SGD at lr 0.01 and
            collections keep their sparse optimizer's rule.
    """

    def __init__(
        self,
        store: Store | str | None = None,
        optimizer: KVOptimizer | Mapping[str, Any] | None = None,
    ) -> None:
        self.store = open_store(store)
        self.backend_optimizer = None if optimizer is None else as_kv_optimizer(optimizer)
        self.optimizer = self.backend_optimizer or KVOptimizer()
        self._prefetch_table_name: str | None = None
        self._tensors: dict[str, _Tensor] = {}
        # name -> (its collection, weakly: the entry goes with it; the table's view)
        self._views: dict[str, tuple[weakref.ReferenceType, TableView]] = {}
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embcache-kv")
        self._lr_warned: set[str] = set()

    @property
    def learning_rate(self) -> float:
        """The client's one learning rate (see the module docstring): its optimizer's lr,
        0.01 unless ``optimizer=`` gave another."""
        return float(self.optimizer.lr)

    def check_learning_rate(self, name: str, lr: float, source: str) -> None:
        """Warn (`KVLearningRateWarning`, once per tensor) when ``update_async`` on tensor
        ``name`` applies ``lr`` (``source``'s) rather than the client's `learning_rate`."""
        if float(lr) == self.learning_rate:
            return
        with self._lock:
            if name in self._lr_warned:
                return
            self._lr_warned.add(name)
        warnings.warn(
            f"KV tensor {name!r}: update_async applies {source}'s learning rate {float(lr):g}, "
            f"not the KV client's {self.learning_rate:g}; for one learning rate everywhere, "
            "give the client the optimizer (get_kv_client(optimizer={'type': 'SGD', "
            "'learning_rate': ...})) or use the client's",
            KVLearningRateWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------------------------------
    # declarations

    def init_data(
        self,
        name: str,
        shape: tuple[int, int],
        dtype: torch.dtype = torch.float32,
        part_policy: Any = None,
        init_func: InitFunc | None = None,
        is_gdata: bool = True,
        base_offset: int = 0,
        initialize_values: bool = True,
        *,
        optimizer: KVOptimizer | Mapping[str, Any] | None = None,
    ) -> None:
        """Declare a tensor (RecStore's signature). Declaring the same name again with the same
        shape, dtype, optimizer and base_offset is a no-op (several modules may share a
        tensor); anything else different is a ValueError.

        Args:
            name: the tensor's name.
            shape: ``(rows, dim)``.
            dtype: the dtype rows are pulled in (stored as float32).
            part_policy: RecStore's partition policy: kept, unused (a tier is one partition).
                A callable here is embcache's older positional ``init_func`` (and a fifth
                positional argument its ``optimizer``).
            init_func: ``init_func(shape, dtype)``: the initial rows, materialised once, here.
                None: rows start at zeros, as in RecStore (made on first touch, so a large
                tensor costs nothing up front; rows a persistent tier already holds are kept).
            is_gdata: accepted (RecStore's graph-data flag); no effect.
            base_offset: the id of row 0: the tensor's ids are ``[base_offset, base_offset +
                rows)`` in every call.
            initialize_values: False skips ``init_func`` (rows start at zeros).
            optimizer: what `update_async` applies (None: the client's).
        """
        del is_gdata
        part_policy, init_func, optimizer = _embcache_order(name, part_policy, init_func, optimizer)
        _check_declaration(name, shape, dtype, base_offset)
        if not initialize_values:
            init_func = None
        opt = self.optimizer if optimizer is None else as_kv_optimizer(optimizer)
        if optimizer is not None and name not in self._tensors:
            self.check_learning_rate(name, opt.lr, "its own optimizer (init_data)")
        meta = _Tensor((int(shape[0]), int(shape[1])), dtype, opt, base_offset, part_policy)
        with self._lock:
            if self._view(name) is not None:
                raise ValueError(
                    f"tensor {name!r} is a table of a collection registered with this client; "
                    "choose another name"
                )
            known = self._tensors.get(name)
            if known is not None:
                declared = (known.shape, known.dtype, known.optimizer, known.base_offset)
                if declared != (meta.shape, dtype, opt, base_offset):
                    raise ValueError(
                        f"tensor {name!r} exists with shape {known.shape}, dtype {known.dtype}, "
                        f"optimizer {known.optimizer} and base_offset {known.base_offset}; "
                        f"cannot redeclare it as {meta.shape}, {dtype}, {opt}, {base_offset}"
                    )
                return
            self._create(name, meta, init_func)

    def _create(self, name: str, meta: _Tensor, init_func: InitFunc | None) -> None:
        """The tier table of a new tensor (`init_data`, under ``_lock``), its rows written from
        ``init_func`` when given."""
        opt, dtype = meta.optimizer, meta.dtype
        initial = None
        if init_func is not None:
            initial = init_func(meta.shape, dtype)
            if tuple(initial.shape) != meta.shape:
                raise ValueError(
                    f"tensor {name!r}: init_func returned shape {tuple(initial.shape)}, "
                    f"expected {meta.shape}"
                )
        rows, dim = meta.shape
        spec = TableSpec(
            name, dim, rows, state_dim=opt.state_dim(dim),
            state_init=float(opt.initial_accumulator_value),
            init=hashed_init(name, 0, "constant", value=0.0),
        )  # fmt: skip
        self.store.init_table(spec)
        if initial is not None:
            full = spec.initial_rows(torch.arange(rows))
            full[:, :dim] = initial.float().cpu()
            self.store.put(name, torch.arange(rows), full)
        self._tensors[name] = meta

    def register(self, name: str, view: TableView, owner: object) -> None:
        """Make ``view`` the tensor ``name`` for as long as ``owner`` (a collection) lives.

        Raises:
            ValueError: ``name`` is a tier tensor of this client, or another live collection's.
        """
        with self._lock:
            if name in self._tensors:
                raise ValueError(
                    f"table {name!r}: this KV client already holds a tensor of that name "
                    "(init_data, a DistTensor or DistEmbedding); give the table another name"
                )
            current = self._view(name)
            if current is not None and current is not view:
                raise ValueError(
                    f"table {name!r} belongs to another live collection on this KV client; "
                    "two collections would cache the same rows. Give the tables distinct names "
                    "or the collections distinct stores"
                )
            self._views[name] = (weakref.ref(owner, self._forget_view(name)), view)

    def _forget_view(self, name: str) -> Callable[[weakref.ReferenceType], None]:
        """The callback that drops ``name``'s entry when its collection is collected."""

        def forget(ref: weakref.ReferenceType) -> None:
            if self._views.get(name, (None,))[0] is ref:
                del self._views[name]

        return forget

    def _view(self, name: str) -> TableView | None:
        entry = self._views.get(name)
        return entry[1] if entry is not None and entry[0]() is not None else None

    def shape(self, name: str) -> tuple[int, int]:
        view = self._view(name)
        return view.shape if view is not None else self._meta(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype tensor ``name`` was declared with (rows are pulled in it); float32 for a
        collection's table."""
        return torch.float32 if self._view(name) is not None else self._meta(name).dtype

    def optimizer_of(self, name: str) -> KVOptimizer:
        """The backend optimizer of a tier tensor."""
        return self._meta(name).optimizer

    def names(self) -> list[str]:
        """Every tensor: tier tensors and registered collection tables."""
        live = [n for n in self._views if self._view(n) is not None]
        return sorted({*self._tensors, *live})

    def tier_names(self) -> list[str]:
        """The tensors this client keeps in its tier (`init_data`, `DistTensor`,
        `DistEmbedding`), without the collections' registered tables: what
        ``embcache.save(..., kv_client=client)`` saves."""
        with self._lock:
            return sorted(self._tensors)

    def _meta(self, name: str) -> _Tensor:
        if name not in self._tensors:
            raise KeyError(f"unknown tensor {name!r}; declared: {self.names()}")
        return self._tensors[name]

    def checked_ids(self, name: str, ids) -> torch.Tensor:
        """``ids`` of tensor ``name`` as int64 row numbers on the CPU (its ``base_offset``
        taken off); `TypeError`/`ValueError` when they are not integers or out of its rows."""
        rows = self.shape(name)[0]
        offset = 0 if self._view(name) is not None else self._meta(name).base_offset
        ids = torch.as_tensor(ids)
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"tensor {name!r}: ids must be integers, got dtype {ids.dtype}")
        ids = ids.reshape(-1).to(torch.int64).cpu()
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < offset or hi >= offset + rows:
                bad = lo if lo < offset else hi
                raise ValueError(
                    f"tensor {name!r}: id {bad} out of range [{offset}, {offset + rows})"
                )
        return ids - offset if offset else ids

    def checked_rows(
        self, name: str, ids: torch.Tensor, rows: torch.Tensor, what: str
    ) -> torch.Tensor:
        """``rows`` for ``ids`` of tensor ``name`` as float32 ``[len(ids), dim]`` on the CPU;
        `TypeError`/`ValueError` (naming ``what``) when they are not."""
        dim = self.shape(name)[1]
        # Python numbers (RecStore's examples pass lists) are values; an integer tensor is a bug.
        rows = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.float32)
        if not rows.numel() and not ids.numel():
            rows = rows.reshape(0, dim)
        if not rows.is_floating_point():
            raise TypeError(f"tensor {name!r}: {what} must be floating point, got {rows.dtype}")
        if tuple(rows.shape) != (ids.numel(), dim):
            raise ValueError(
                f"tensor {name!r}: {what} has shape {tuple(rows.shape)}, expected "
                f"{(ids.numel(), dim)}"
            )
        return rows.detach().to(torch.float32).cpu()

    def export_rows(self, name: str) -> torch.Tensor:
        """Every row of tensor ``name``, float32: ``[rows, dim + state]`` for a tier tensor
        (weights, then its backend optimizer's state), ``[rows, dim]`` for a collection's
        table (its optimizer state is the collection's, saved by `embcache.save`)."""
        view = self._view(name)
        every = torch.arange(self.shape(name)[0])
        if view is not None:
            return view.read(every)
        return self._worker.submit(self.store.read, name, every).result().float()

    def import_rows(self, name: str, rows: torch.Tensor) -> None:
        """Overwrite every row of tensor ``name`` with what `export_rows` gave."""
        view = self._view(name)
        every = torch.arange(self.shape(name)[0])
        if view is not None:
            view.write(every, rows)
        else:
            self._worker.submit(self.store.put, name, every, rows).result()

    def _finite(self, name: str, rows: torch.Tensor, call: str) -> None:
        if not bool(torch.isfinite(rows).all()):
            raise ValueError(f"tensor {name!r}: {call} got NaN or Inf values")

    # ------------------------------------------------------------------------------------------
    # operations on tier tensors (all run on the worker, in order)

    def _get(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        meta = self._meta(name)
        if not ids.numel():
            return torch.empty(0, meta.shape[1], dtype=meta.dtype)
        unique, inverse, _ = dedup(ids, with_counts=False)
        return self.store.read(name, unique)[inverse, : meta.shape[1]].to(meta.dtype)

    def _put(self, name: str, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if ids.numel():
            rows = self.store.read(name, ids)
            rows[:, : weights.shape[1]] = weights
            self.store.put(name, ids, rows)

    def _step(self, name: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        meta = self._meta(name)
        if not ids.numel():
            return
        unique, summed = aggregate_grads(ids, grads)
        rows = self.store.read(name, unique)
        meta.steps += 1
        dim, slots = meta.shape[1], torch.arange(unique.numel())
        # Views of the row's two parts: the update writes them in place, inside ``rows``.
        apply_row_update(rows[:, :dim], rows[:, dim:], slots, summed, meta.optimizer.update,
                         meta.steps)  # fmt: skip
        self.store.put(name, unique, rows)

    def _add(self, name: str, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        if not ids.numel():
            return
        unique, summed = aggregate_grads(ids, deltas)
        rows = self.store.read(name, unique)
        rows[:, : deltas.shape[1]] += summed
        self.store.put(name, unique, rows)

    # ------------------------------------------------------------------------------------------
    # RecStore's calls

    def prefetch(self, *args: Any, name: str | None = None, ids: Any = None) -> KVHandle:
        """Start reading rows; `wait_and_get` returns them. Sees every earlier write.

        Two call shapes: embcache's ``prefetch(name, ids)`` and RecStore's ``prefetch(ids,
        name=None)``, whose ``name`` None means the tensor `set_prefetch_table_name` chose.
        """
        if len(args) > 2:
            raise TypeError(f"prefetch takes (name, ids) or (ids, name), got {len(args)} values")
        if args and isinstance(args[0], str):
            if name is not None or (len(args) > 1 and ids is not None):
                raise TypeError("prefetch: the tensor name or the ids given twice")
            name, ids = args[0], args[1] if len(args) > 1 else ids
        elif args:
            if ids is not None or (len(args) > 1 and name is not None):
                raise TypeError("prefetch: the tensor name or the ids given twice")
            ids, name = args[0], args[1] if len(args) > 1 else name
        if name is None:
            name = self._prefetch_table_name
            if name is None:
                raise ValueError("prefetch: no tensor name given and none set by "
                                 "set_prefetch_table_name")  # fmt: skip
        if ids is None:
            raise TypeError(f"prefetch of tensor {name!r}: no ids given")
        ids = self.checked_ids(name, ids)
        view = self._view(name)
        if view is not None:
            return _done(view.read(ids))
        return KVHandle(self._worker.submit(self._get, name, ids))

    def set_prefetch_table_name(self, name: str) -> None:
        """The tensor a RecStore-style ``prefetch(ids)`` without a name reads."""
        self.shape(name)  # KeyError for an unknown tensor
        self._prefetch_table_name = name

    def wait_and_get(
        self,
        handle: KVHandle,
        embedding_dim: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The rows ``[n, dim]`` a `prefetch` read. RecStore's arguments: ``embedding_dim``
        (checked against the rows: a mismatch is a ValueError) and ``device`` (the rows are
        returned there; default: the CPU)."""
        rows = handle._future.result()
        if embedding_dim is not None and int(embedding_dim) != rows.shape[1]:
            raise ValueError(
                f"wait_and_get: embedding_dim={embedding_dim}, but the prefetched rows have "
                f"dim {rows.shape[1]}"
            )
        return rows if device is None else rows.to(device)

    def pull(self, name: str, ids) -> torch.Tensor:
        """Rows ``[n, dim]`` of ``ids`` (any shape, flattened; duplicates allowed)."""
        return self.wait_and_get(self.prefetch(name, ids))

    def push(self, name: str, ids, data=None, *, rows=None) -> None:
        """Overwrite the weights of rows with ``data`` (RecStore's name; ``rows=`` is
        embcache's), keeping their optimizer state. Ids must be distinct (which of two values
        would win is undefined). Applied when it returns."""
        if (data is None) == (rows is None):
            raise TypeError(f"push to tensor {name!r}: give the rows once, as data (or rows=)")
        rows = data if rows is None else rows
        ids = self.checked_ids(name, ids)
        rows = self.checked_rows(name, ids, rows, "rows")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"tensor {name!r}: push got duplicate ids")
        view = self._view(name)
        if view is not None:
            view.write(ids, rows)
            return
        self._worker.submit(self._put, name, ids, rows).result()

    def update_async(self, name: str, ids, grads) -> KVHandle:
        """Hand gradients to the tensor's backend optimizer: duplicate ids summed, one step of
        its rule on the rows and their state, in the background after every earlier call;
        returns a handle for `wait`."""
        ids = self.checked_ids(name, ids)
        grads = self.checked_rows(name, ids, grads, "grads")
        self._finite(name, grads, "update_async")
        view = self._view(name)
        if view is not None:
            view.step(ids, grads)
            return _done()
        return KVHandle(self._worker.submit(self._step, name, ids, grads))

    def add_async(self, name: str, ids, deltas) -> KVHandle:
        """Add ``deltas`` to the rows (duplicates summed), without any optimizer, in the
        background after every earlier call; returns a handle for `wait`."""
        ids = self.checked_ids(name, ids)
        deltas = self.checked_rows(name, ids, deltas, "deltas")
        self._finite(name, deltas, "add_async")
        view = self._view(name)
        if view is not None:
            view.add(ids, deltas)
            return _done()
        return KVHandle(self._worker.submit(self._add, name, ids, deltas))

    def update(self, name: str, ids, grads) -> None:
        """`update_async`, then `wait` (RecStore's synchronous update)."""
        self.wait(self.update_async(name, ids, grads))

    def wait(self, handle: KVHandle) -> None:
        """Block until an `update_async` / `add_async` has been applied (re-raises its error)."""
        handle._future.result()

    def flush(self) -> None:
        """Block until every operation submitted so far has been applied."""
        self._worker.submit(lambda: None).result()

    def flush_async_updates(self) -> None:
        """RecStore's name for `flush`: every queued update applied."""
        self.flush()

    def data_name_list(self) -> list[str]:
        """RecStore's name for `names`: every tensor, collection tables included."""
        return self.names()

    def get_data_meta(self, name: str) -> tuple[torch.dtype, tuple[int, int]]:
        """``(dtype, shape)`` of a tensor, as RecStore returns it."""
        return self.dtype(name), self.shape(name)

    def save_checkpoint(self, path: str | os.PathLike, metadata: Mapping[str, Any] | str) -> None:
        """Write every tensor (rows and their backend optimizer state; a collection's tables'
        rows) into directory ``path``, after every queued update (RecStore's call).
        ``metadata``: JSON (a dict or a string) with ``identity`` (a dict) and a non-empty
        ``checkpoint_id``; `load_checkpoint` must be given the same. See
        `embcache.recstore.kv_checkpoint`."""
        self.flush()
        save_tensors(self, path, metadata)

    def load_checkpoint(self, path: str | os.PathLike, metadata: Mapping[str, Any] | str) -> None:
        """Restore what `save_checkpoint` wrote with the same ``metadata``, into tensors
        declared with the same shapes: everything is verified (checksums, names, shapes)
        before any row is written."""
        self.flush()
        load_tensors(self, path, metadata)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


_client: KVClient | None = None
_client_lock = threading.Lock()


def get_kv_client(
    store: Store | str | None = None,
    optimizer: KVOptimizer | Mapping[str, Any] | None = None,
) -> KVClient:
    """The process's KV client, created on first call (over ``store``, default HostKV, with
    ``optimizer`` as its tensors' default backend optimizer).

    Passing a store or an optimizer once a client exists with others is an error;
    `reset_kv_client` drops the current client.
    """
    global _client
    with _client_lock:
        if _client is None:
            _client = KVClient(store, optimizer)
        elif store is not None and store is not _client.store:
            raise ValueError(
                "the KV client already exists over another store; call reset_kv_client() first"
            )
        elif optimizer is not None and as_kv_optimizer(optimizer) != _client.optimizer:
            raise ValueError(
                "the KV client already exists with another default optimizer; call "
                "reset_kv_client() first, or give the optimizer per tensor at init_data"
            )
        return _client


def reset_kv_client() -> None:
    """Close and forget the process's KV client (its tensors go with it)."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
        _client = None
