"""How a collection's rows start: torchrec's initialisation where the tables can be held whole,
a per-id draw where they cannot.

torchrec's `EmbeddingBagCollection` builds one ``nn.EmbeddingBag`` per table (each draws
``normal_`` from torch's generator), then calls every table's ``init_fn`` on its weights. A
collection whose caches hold every row (the default, ``cache=None``) repeats exactly that, on
its device, when it is built without a ``seed``: after the same ``torch.manual_seed`` its
initial rows equal torchrec's bit for bit, and torch's generator is left where torchrec leaves
it, so every later random draw of the program matches a torchrec run. The weights drawn are
kept on the host (`DrawnInit`) and read when a row is first touched.

Tables too large for that (a cache holding part of them), and collections given a ``seed``,
draw each row from a counter-based hash of (seed, table, id, column) (`kv.base.hashed_init`), so
a row's value never depends on the order of access and no table is ever materialised. The
distribution is the ``init_fn``'s when it is recognised: ``torch.nn.init.uniform_``,
``normal_``, ``constant_``, ``zeros_``, ``ones_`` (plain or through ``functools.partial``) and
torchrec's default uniform; another ``init_fn`` is refused for such a table. Without a
``seed``, the seed is one draw from torch's generator, so ``torch.manual_seed`` still decides
the rows.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from embcache.engine.tables import Table
from embcache.kv.base import RowInit, hashed_init

_RECOGNISED: dict[Callable[..., Any], tuple[str, Callable[[dict[str, Any]], dict[str, float]]]] = {
    torch.nn.init.uniform_: ("uniform", lambda a: {"low": a["a"], "high": a["b"]}),
    torch.nn.init.normal_: ("normal", lambda a: {"mean": a["mean"], "std": a["std"]}),
    torch.nn.init.constant_: ("constant", lambda a: {"value": a["val"]}),
    torch.nn.init.zeros_: ("constant", lambda a: {"value": 0.0}),
    torch.nn.init.ones_: ("constant", lambda a: {"value": 1.0}),
}


def default_init_fn(table: Table) -> Callable[[torch.Tensor], Any]:
    """torchrec's default: uniform in ``±sqrt(1 / num_embeddings)`` (an unbounded table:
    ``±sqrt(1 / dim)``, as `kv.base.default_init`)."""
    bound = math.sqrt(1.0 / (table.num_embeddings or table.dim))
    return functools.partial(torch.nn.init.uniform_, a=-bound, b=bound)


def init_distribution(table: Table) -> tuple[str, dict[str, float]] | None:
    """The distribution a table's ``init_fn`` draws from, as `hashed_init` names it, or None
    when it is not one of the recognised initialisers."""
    fn = table.init_fn or default_init_fn(table)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    while isinstance(fn, functools.partial):
        args, kwargs = fn.args + args, {**fn.keywords, **kwargs}
        fn = fn.func
    if fn not in _RECOGNISED:
        return None
    try:
        bound = inspect.signature(fn).bind(None, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    distribution, params = _RECOGNISED[fn]
    return distribution, {k: float(v) for k, v in params(bound.arguments).items()}


def table_inits(
    tables: Sequence[Table],
    seed: int | None,
    whole: bool,
    device: torch.device,
    per_table: bool = False,
) -> dict[str, RowInit | None]:
    """The row initialiser of each table (None on the meta device, where no row exists).

    Args:
        tables: the collection's tables, in order.
        seed: the collection's seed; None takes the randomness from torch's generator.
        whole: the caches hold every row, so torchrec's initialisation can be repeated.
        device: the collection's device (torchrec draws its weights there).
        per_table: torchrec's `EmbeddingCollection` order (each table's ``normal_`` then its
            ``init_fn``, table after table), not its `EmbeddingBagCollection`'s (every
            ``normal_``, then every ``init_fn``).

    Raises:
        ValueError: a table drawn per id whose ``init_fn`` is not recognised.
    """
    if device.type == "meta":  # torchrec draws nothing there either
        return {t.name: None for t in tables}
    if seed is None and whole:
        return _as_torchrec(tables, device, per_table)
    if seed is None:
        seed = int(torch.randint(0, 1 << 62, ()))
    inits: dict[str, RowInit | None] = {}
    for t in tables:
        found = init_distribution(t)
        if found is None:
            raise ValueError(
                f"table {t.name!r}: init_fn {t.init_fn!r} cannot be drawn row by row, which a "
                "table only partly cached (or a collection given a seed) needs; use "
                "torch.nn.init.uniform_/normal_/constant_ (or functools.partial of them), or "
                "cache the whole table and build the collection without a seed"
            )
        distribution, params = found
        inits[t.name] = hashed_init(t.name, seed, distribution, **params)
    return inits


def _as_torchrec(
    tables: Sequence[Table], device: torch.device, per_table: bool
) -> dict[str, RowInit | None]:
    """torchrec's initial weights, drawn as its `EmbeddingBagCollection` (or, ``per_table``,
    its `EmbeddingCollection`) draws them."""
    inits: dict[str, RowInit | None] = {}
    weights = []
    with torch.no_grad():
        for t in tables:  # nn.EmbeddingBag's (nn.Embedding's) own reset_parameters
            assert t.num_embeddings is not None  # held whole: every table is bounded
            w = torch.empty(t.num_embeddings, t.dim, dtype=t.dtype, device=device)
            torch.nn.init.normal_(w)
            if per_table:
                (t.init_fn or default_init_fn(t))(w)
            weights.append(w)
        for t, w in zip(tables, weights, strict=True):  # then every table's init_fn
            if not per_table:
                (t.init_fn or default_init_fn(t))(w)
            inits[t.name] = DrawnInit(w.to("cpu", torch.float32))
    return inits


class DrawnInit:
    """Initial rows drawn whole (torchrec's draws, `table_inits`), kept on the host and read
    on first touch. They come from torch's generator, not from a recipe, so a checkpoint
    keeps the draws themselves (`embcache.checkpoint`) to give back the rows never touched.

    Args:
        weights: CPU float32 ``[num_embeddings, dim]``.
    """

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights

    def __call__(self, ids: torch.Tensor, dim: int) -> torch.Tensor:
        del dim
        return self.weights.index_select(0, ids.to(torch.int64))
