"""The rows' gradient as torch's gradient utilities see it: the ``.grad`` of a collection's
``grad_anchor``.

torch's utilities find gradients through ``p.grad``: `torch.amp.GradScaler` unscales those of
an optimizer's parameters in place and skips its step when one holds Inf or NaN;
``clip_grad_norm_`` and ``clip_grad_value_`` scale or clamp those of the parameters they are
given. On torchrec's EmbeddingBagCollection they reach every table's weight gradient. A cached
collection's rows are not parameters; `GradAnchor`, the zero-size parameter that stands for
them in ``model.parameters()``, gives their gradient as its ``.grad`` (`RowGradients`): one flat
tensor holding the recorded gradient rows of every table side by side (each table's rows summed
per id when several backwards accumulate). Its norm, its elements and their finiteness are
those of torchrec's weight gradients without their zero rows, and the trace entries the step
applies are views of it, so what a utility does to it in place is what the step applies.

It is made when read, not at backward: on the TBE step a backward records the pooled gradient
only (`engine.tbe_step`), and its rows cost more than the rest of the step. A loop that never
reads ``.grad`` (``loss.backward(); opt.step()``) never makes it.

As with torch's own parameters:

* ``p.grad = None`` (``optimizer.zero_grad()``, ``model.zero_grad()``) drops the gradient: the
  collection's trace is dropped and its slots released (a step skipped by GradScaler, say);
* a torch optimizer's step takes it (`models.torch_optim`): the step applies it to the rows, or
  leaves it to the collection's own optimizer, and the optimizer's own update never sees it.

After an update inside backward (``update_in_backward=True``, ``optimizer_type=``) the rows
have moved already, so that update cannot be unscaled, clipped or skipped. torchrec's fused
collections have no gradient then, which GradScaler and clipping pass by silently; here
``.grad`` is `AppliedInBackward`, which raises at any use but ``zero_grad``'s, naming the call,
until the next forward, ``zero_grad`` or optimizer step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from embcache.engine.batch_state import TraceEntry
from embcache.kernels.optim import aggregate_grads

# ``Tensor.grad`` as autograd keeps it: the zero-size gradient `CachedLookup` gives the anchor.
_AUTOGRAD_GRAD: Any = torch.Tensor.grad


class GradAnchor(nn.Parameter):
    """A collection's stand-in in ``model.parameters()``: a zero-size ``[0, 1]`` parameter
    (what `CachedLookup` records the lookup against) whose ``.grad`` is the rows' gradient,
    read and written through ``rows`` (`RowGradients`; None: autograd's own field)."""

    rows: RowGradients | None

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> GradAnchor:
        anchor = super().__new__(cls, data, requires_grad)
        anchor.rows = None
        return anchor

    @property
    def grad(self) -> torch.Tensor | None:
        rows = self.rows
        return _AUTOGRAD_GRAD.__get__(self) if rows is None else rows.read()

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if self.rows is None:
            _AUTOGRAD_GRAD.__set__(self, value)
            return
        _AUTOGRAD_GRAD.__set__(self, None)  # autograd's zero-size gradient, never read
        self.rows.write(value)


class RowGradients:
    """The gradient of a collection's rows as one flat float32 tensor, made from its trace when
    read (see the module's docstring).

    Args:
        collection: the collection (held weakly: it holds this).
    """

    def __init__(self, collection: Any) -> None:
        self._collection = weakref.ref(collection)
        # A torch optimizer's step took the gradient since the last training forward.
        self.taken = False
        # The last backward's update ran inside it (update_in_backward).
        self.applied = False
        # The last tensor made, and the trace list (with its length) it was made of.
        self._flat: torch.Tensor | None = None
        self._made_of: tuple[list[TraceEntry], int] | None = None

    def _owner(self) -> Any:
        collection = self._collection()
        if collection is None:
            raise RuntimeError("the collection of this grad_anchor no longer exists")
        return collection

    # -- the collection's side --------------------------------------------------------------

    def forward_started(self) -> None:
        """A training forward: the gradient its backward records is nobody's yet."""
        self.taken = self.applied = False

    def drop_if_zeroed(self) -> None:
        """Before a training forward: a gradient made and then zeroed in place
        (``zero_grad(set_to_none=False)``) is dropped, as torch's next backward would start
        from it; so is its step's claim on the slots. One host read, only when ``.grad`` was
        made for the trace that awaits its step."""
        flat, made_of = self._flat, self._made_of
        engines = self._owner().engines
        if (
            flat is None
            or made_of is None
            or not engines.has_gradients
            or made_of[0] is not engines.entries()
            or made_of[1] != len(made_of[0])
        ):
            return
        if not bool(flat.any()):
            self._owner().zero_grad()
            self._flat = self._made_of = None

    def backward_done(self, anchor: torch.Tensor) -> None:
        """A backward reached ``anchor``: its post-accumulate-grad hook (held by the anchor,
        which holds this, not the collection)."""
        self.applied = self._owner().engines.update_in_backward

    # -- a torch optimizer's side -----------------------------------------------------------

    def pending(self) -> bool:
        """Whether a gradient awaits a step and no torch optimizer took it (nothing made)."""
        return not self.taken and self._owner().engines.has_gradients

    def take(self) -> None:
        """A torch optimizer's step took the gradient (applied it, or left it to the
        collection's own optimizer): its own update must not see it."""
        self.taken, self.applied = True, False

    # -- ``.grad`` ----------------------------------------------------------------------------

    def read(self) -> torch.Tensor | None:
        """``grad_anchor.grad``: the flat gradient of the rows, `AppliedInBackward` after an
        update inside backward, or None."""
        if self.taken:
            return None
        collection = self._owner()
        engines = collection.engines
        if engines.has_gradients:
            return self._flat_gradient(engines, collection.device)
        self._flat = self._made_of = None
        if self.applied:
            return AppliedInBackward.on(collection.device, type(collection).__name__)
        return None

    def write(self, value: torch.Tensor | None) -> None:
        """``grad_anchor.grad = value``: None drops the gradient (``zero_grad``); a tensor of
        the gradient's shape replaces its values, which the step then applies.

        Raises:
            RuntimeError: a tensor where there is no gradient to replace.
            ValueError: a tensor of another shape.
        """
        if value is None:
            if self.pending():
                self._owner().zero_grad()
            self.applied = False
            return
        current = self.read()
        if current is None or isinstance(current, AppliedInBackward):
            raise RuntimeError(
                "grad_anchor.grad can only be replaced while the rows' gradient of a backward "
                "awaits its step (it is made of that gradient); set it to None to drop it"
            )
        if value is current:
            return
        if value.shape != current.shape:
            raise ValueError(
                f"grad_anchor.grad: a tensor of shape {tuple(value.shape)} cannot replace the "
                f"rows' gradient, of shape {tuple(current.shape)}"
            )
        with torch.no_grad():
            current.copy_(value)

    def _flat_gradient(self, engines: Any, device: torch.device) -> torch.Tensor:
        """The trace as one flat tensor, the trace's entries made views of it (once per
        trace: asked again for the same trace, the same tensor)."""
        entries = engines.entries()  # a TBE step's pending update becomes per-row entries
        if (
            self._flat is not None
            and self._made_of is not None
            and self._made_of[0] is entries
            and self._made_of[1] == len(entries)
        ):
            return self._flat
        entries = _one_per_table(entries)
        if entries:
            flat = torch.cat([e.grads.reshape(-1) for e in entries])
        else:
            flat = torch.zeros(0, device=device)
        views, at = [], 0
        for e in entries:
            n = e.grads.numel()
            rows = flat[at : at + n].view(e.grads.shape)
            views.append(TraceEntry(e.table_name, e.ids, rows, e.engine, e.batch))
            at += n
        engines.replace_entries(views)
        self._flat, self._made_of = flat, (views, len(views))
        return flat


def _one_per_table(entries: list[TraceEntry]) -> list[TraceEntry]:
    """``entries`` with each table's entries of several backwards summed per id, as torch sums
    a weight's gradients: norms and clamps then see torchrec's gradient. No forward's slots
    hold such a sum's rows, so the step resolves them again (`CacheEngine.locate`)."""
    by_table: dict[str, list[TraceEntry]] = {}
    for e in entries:
        by_table.setdefault(e.table_name, []).append(e)
    if len(by_table) == len(entries):
        return entries
    out = []
    for name, mine in by_table.items():
        if len(mine) == 1:
            out.append(mine[0])
            continue
        ids, grads = aggregate_grads(
            torch.cat([e.ids for e in mine]), torch.cat([e.grads for e in mine])
        )
        out.append(TraceEntry(name, ids, grads, mine[0].engine, None))
    return out


# What ``zero_grad`` does to a gradient (``set_to_none=False``), and printing it.
_ALLOWED: set[Callable[..., Any]] = {
    torch.Tensor.zero_,
    torch.Tensor.detach_,
    torch.Tensor.requires_grad_,
    torch._foreach_zero_,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
}

# The torch call each utility makes first on a gradient, by the name the user called.
_CALLS = {
    "_amp_foreach_non_finite_check_and_unscale_": "GradScaler.unscale_ (or scaler.step)",
    "_foreach_norm": "clip_grad_norm_",
    "linalg_vector_norm": "clip_grad_norm_",
    "norm": "clip_grad_norm_",
    "_foreach_clamp_min_": "clip_grad_value_",
    "_foreach_clamp_max_": "clip_grad_value_",
    "clamp_": "clip_grad_value_",
}


class AppliedInBackward(torch.Tensor):
    """``grad_anchor.grad`` after an update inside backward: an empty tensor that refuses
    every operation but ``zero_grad``'s (and property reads), naming the call."""

    owner_name: str

    @staticmethod
    def on(device: torch.device, owner_name: str) -> AppliedInBackward:
        grad = torch.zeros(0, device=device).as_subclass(AppliedInBackward)
        grad.owner_name = owner_name
        return grad

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _ALLOWED or getattr(func, "__name__", "") == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        owner = next(
            (a.owner_name for a in _flat_args(args) if isinstance(a, AppliedInBackward)),
            "collection",
        )
        raise RuntimeError(
            f"{_CALLS.get(name, name)} reached the rows' gradient of a {owner} that updates "
            "them inside backward (update_in_backward=True or optimizer_type=...): that update "
            "is applied already, so it cannot be unscaled, clipped or skipped (under GradScaler "
            "it applied the scaled gradient). Train the tables with a torch optimizer over "
            "model.parameters(), or an embcache optimizer's step() without update_in_backward, "
            "as torchrec's non-fused EmbeddingBagCollection is trained"
        )


def _flat_args(args: Any) -> list[Any]:
    """``args`` with lists and tuples opened (the foreach ops take lists of tensors)."""
    out: list[Any] = []
    for a in args:
        out.extend(_flat_args(a) if isinstance(a, list | tuple) else [a])
    return out
