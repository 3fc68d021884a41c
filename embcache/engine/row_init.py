"""How a collection's rows start: torchrec's initialisation where the tables can be held whole,
a per-id draw where they cannot.

torchrec's `EmbeddingBagCollection` builds one ``nn.EmbeddingBag`` per table (each draws
``normal_`` from torch's generator), then calls every table's ``init_fn`` on its weights. A
collection whose caches hold every row (the default, ``cache=None``) repeats exactly that, on
its device, when it is built without a ``seed``: after the same ``torch.manual_seed`` its
initial rows equal torchrec's bit for bit. The weights drawn are kept on the host (`DrawnInit`)
and read when a row is first touched.

Tables too large for that (a cache holding part of them), and collections given a ``seed``,
draw each row from a counter-based hash of (seed, table, id, column) (`kv.base.hashed_init`), so
a row's value never depends on the order of access and no table is ever materialised. The
distribution is the ``init_fn``'s when it is recognised: ``torch.nn.init.uniform_``,
``normal_``, ``constant_``, ``zeros_``, ``ones_`` (plain or through ``functools.partial``) and
torchrec's default uniform; another ``init_fn`` is refused for such a table. Without a
``seed``, the seed is taken from torch's generator, so ``torch.manual_seed`` still decides
the rows.

torch's generator. Without a ``seed``, building a collection moves torch's generators as
torchrec's collection does, whatever its cache size, tier or backend: the draws above are made
(and, for caches holding part of the tables, dropped) whenever they fit a quarter of the
device's memory (`draws_fit`), and the hash's seed is then read from torch's generator without
moving it. So the layers a model builds next (a DLRM's MLPs) start from the same weights as
with torchrec's collection, and an A/B of cache sizes starts its dense layers alike. Tables
whose draws do not fit (and unbounded ones, which torchrec cannot build) take one draw from
the generator as their seed instead. On the meta device nothing is drawn, as in torchrec; with
a ``seed`` nothing is drawn at all.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from embcache.cache.config import device_memory
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


DRAW_MEMORY_FRACTION = 0.25  # of the device's memory that torchrec's draws may take


def draws_fit(tables: Sequence[Table], device: torch.device) -> bool:
    """Whether torchrec's initial draws of ``tables`` can be made on ``device``: every table is
    bounded and the draws (on the device, in each table's dtype; kept on the host in float32
    when they become the rows) take at most `DRAW_MEMORY_FRACTION` of the device's memory (a
    GPU's, or this machine's on the CPU). Neither the cache nor the tier enters."""
    if any(t.num_embeddings is None for t in tables):
        return False
    if device.type == "cuda" and not torch.cuda.is_available():
        return False  # no device to draw on (the build fails further on, saying so)
    weights = [(t.num_embeddings or 0) * t.dim for t in tables]
    drawn = sum(n * t.dtype.itemsize for n, t in zip(weights, tables, strict=True))
    kept = 4 * sum(weights)
    return max(drawn, kept) <= DRAW_MEMORY_FRACTION * device_memory(device)


def table_inits(
    tables: Sequence[Table],
    seed: int | None,
    whole: bool,
    device: torch.device,
    per_table: bool = False,
) -> dict[str, RowInit | None]:
    """The row initialiser of each table (None on the meta device, where no row exists).

    Without a ``seed``, torch's generators end where torchrec's collection leaves them whenever
    `draws_fit`, whatever ``whole`` says (see the module docstring).

    Args:
        tables: the collection's tables, in order.
        seed: the collection's seed; None takes the randomness from torch's generator.
        whole: the caches hold every row, so torchrec's draws can be the rows.
        device: the collection's device (torchrec draws its weights there).
        per_table: torchrec's `EmbeddingCollection` order (each table's ``normal_`` then its
            ``init_fn``, table after table), not its `EmbeddingBagCollection`'s (every
            ``normal_``, then every ``init_fn``).

    Raises:
        ValueError: a table drawn per id whose ``init_fn`` is not recognised (raised before
            anything is drawn).
    """
    if device.type == "meta":  # torchrec draws nothing there either
        return {t.name: None for t in tables}
    as_torchrec = seed is None and draws_fit(tables, device)
    if as_torchrec and whole:
        return {
            t.name: DrawnInit(w.to("cpu", torch.float32))
            for t, w in zip(tables, _torchrec_draws(tables, device, per_table), strict=True)
        }
    recipes = {t.name: _per_id_distribution(t) for t in tables}
    if seed is None and as_torchrec:
        # The seed is read without moving the generator, then torchrec's draws are made and
        # dropped: the generator ends where torchrec's collection leaves it.
        generator = torch.default_generator
        state = generator.get_state()
        seed = int(torch.randint(0, 1 << 62, (), generator=generator, device="cpu"))
        generator.set_state(state)
        _torchrec_draws(tables, device, per_table)
    elif seed is None:
        seed = int(torch.randint(0, 1 << 62, ()))
    return {
        name: hashed_init(name, seed, distribution, **params)
        for name, (distribution, params) in recipes.items()
    }


def _per_id_distribution(table: Table) -> tuple[str, dict[str, float]]:
    """`init_distribution` of a table drawn per id, or a ValueError saying what to do."""
    found = init_distribution(table)
    if found is None:
        raise ValueError(
            f"table {table.name!r}: init_fn {table.init_fn!r} cannot be drawn row by row, which "
            "a table only partly cached (or one whose draws exceed a quarter of the device's "
            "memory, or a collection given a seed) needs; use "
            "torch.nn.init.uniform_/normal_/constant_ (or functools.partial of them), or "
            "cache the whole table and build the collection without a seed"
        )
    return found


def _torchrec_draws(
    tables: Sequence[Table], device: torch.device, per_table: bool
) -> list[torch.Tensor]:
    """torchrec's initial weights on ``device``, drawn as its `EmbeddingBagCollection` (or,
    ``per_table``, its `EmbeddingCollection`) draws them."""
    weights = []
    with torch.no_grad():
        for t in tables:  # nn.EmbeddingBag's (nn.Embedding's) own reset_parameters
            assert t.num_embeddings is not None  # draws_fit: every table is bounded
            w = torch.empty(t.num_embeddings, t.dim, dtype=t.dtype, device=device)
            torch.nn.init.normal_(w)
            if per_table:
                (t.init_fn or default_init_fn(t))(w)
            weights.append(w)
        if not per_table:  # then every table's init_fn
            for t, w in zip(tables, weights, strict=True):
                (t.init_fn or default_init_fn(t))(w)
    return weights


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
