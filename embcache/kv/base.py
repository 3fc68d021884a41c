"""The contract between the device cache and the tiers behind it.

A tier stores, per table, rows of the embedding weights and, beside them, the optimizer state
(``[D | S]``), so a fetch or a write-back is one contiguous row. The weights are kept in the
table's ``dtype`` (float32, float16 or bfloat16) and the state always in float32; a stored row
is a tensor of ``dtype`` whose last columns hold the float32 state's bits (two 16-bit columns
per state value for a half-precision table), so a half-precision row moves half the weight
bytes. `TableSpec.pack` / `TableSpec.unpack` convert between the two views.

Rows are created on first touch by the table's initialiser, which is a function of the ids
alone: the value a row starts with never depends on the order in which rows are touched.

A table may be bounded (`TableSpec.capacity`): the tier then keeps at most that many rows and,
to make room, evicts the rows of lowest score (`ScorePolicy`) that no reader has pinned
(`Store.get` with ``pin=True``, a count per row, released by `Store.unpin`). An evicted row is
gone: touched again, it is created from its initialiser as a new id would be. The device cache
pins the rows it holds, so a row that is resident, dirty or locked by a batch is never dropped
underneath it. Tiers that bound no table ignore pins.

Which rows exist matters for checkpoints: `Store.export_rows` lists only them, so whole-table
reads (``state_dict()``, ``table_rows``) go through `Store.read` and a checkpoint holds only
the rows that were looked up for training or written. The device cache reads misses through
`Store.get` when it trains and through `Store.read` under ``torch.no_grad()``: inference over
ids the tier never held writes nothing, and such a row, held clean by the cache, reaches the
tier only once a training step updates it and it is written back (as a direct-mapped cache's
rows do).
"""

from __future__ import annotations

import abc
import enum
import math
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from embcache.hashing import mix64, row_counters
from embcache.ops.registry import ops_for

_INTEGER_DTYPES = frozenset(  # accepted for ids, which are converted to int64
    {
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    }
)

RowInit = Callable[[torch.Tensor, int], torch.Tensor]
"""``init(ids, dim) -> rows``: int64 ``[n]`` ids to float32 ``[n, dim]`` initial weights."""

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ScorePolicy(enum.Enum):
    """Which rows a bounded table evicts first: the lowest score.

    LRU: the score is the tier's clock when the row was last released by a reader (`Store.unpin`)
    or used unpinned (a ``get`` or ``put`` without a pin); LFU: the number of such uses. Rows a
    reader holds pinned (the device cache's resident rows) keep their score until released.
    """

    LRU = "lru"
    LFU = "lfu"


@dataclass
class TableSpec:
    """One table of a tier.

    Attributes:
        name: table name, unique within a store.
        dim: embedding dimension D.
        num_embeddings: number of rows (ids in ``[0, num_embeddings)``), or None for an
            unbounded table of arbitrary non-negative int64 ids (hashed features).
        state_dim: optimizer-state columns S kept beside each row (0 when no optimizer).
        state_init: initial value of every state column (AdaGrad's initial accumulator).
        init: initialiser of the weights of new rows; None for `default_init`.
        seed: seed of the default initialiser.
        dtype: the weights' storage type: float32, float16 or bfloat16 (the state is float32).
        capacity: most rows the tier keeps for this table (None: no bound). When full, making
            room evicts the unpinned rows of lowest score; an evicted row touched again starts
            from its initialiser.
        score: the eviction score of a bounded table (`ScorePolicy` or ``"lru"``/``"lfu"``).
    """

    name: str
    dim: int
    num_embeddings: int | None = None
    state_dim: int = 0
    state_init: float = 0.0
    init: RowInit | None = None
    seed: int = 0
    dtype: torch.dtype = torch.float32
    capacity: int | None = None
    score: ScorePolicy | str = ScorePolicy.LRU

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim must be a positive int, got {self.dim!r}")
        if self.num_embeddings is not None and (
            not isinstance(self.num_embeddings, int) or self.num_embeddings < 1
        ):
            raise ValueError(
                f"table {self.name!r}: num_embeddings must be a positive int or None, "
                f"got {self.num_embeddings!r}"
            )
        if not isinstance(self.state_dim, int) or self.state_dim < 0:
            raise ValueError(
                f"table {self.name!r}: state_dim must be an int >= 0, got {self.state_dim!r}"
            )
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"table {self.name!r}: dtype must be float32, float16 or bfloat16, got "
                f"{self.dtype!r}"
            )
        if self.capacity is not None and (
            isinstance(self.capacity, bool) or not isinstance(self.capacity, int)
            or self.capacity < 1
        ):  # fmt: skip
            raise ValueError(
                f"table {self.name!r}: capacity must be a positive int or None, got "
                f"{self.capacity!r}"
            )
        try:
            self.score = ScorePolicy(
                self.score.lower() if isinstance(self.score, str) else self.score
            )
        except ValueError:
            raise ValueError(
                f"table {self.name!r}: score must be 'lru' or 'lfu', got {self.score!r}"
            ) from None

    @property
    def row_width(self) -> int:
        """Values of a row as float32: ``dim + state_dim`` (weights, then state)."""
        return self.dim + self.state_dim

    @property
    def state_columns(self) -> int:
        """Columns of ``dtype`` the float32 state takes in a stored row."""
        return self.state_dim * 4 // self.dtype.itemsize

    @property
    def stored_width(self) -> int:
        """Columns of a stored row: ``dim`` weights and the state's `state_columns`."""
        return self.dim + self.state_columns

    @property
    def row_bytes(self) -> int:
        """Bytes of a stored row."""
        return self.stored_width * self.dtype.itemsize

    def pack(self, weights: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[n, stored_width]`` of ``dtype`` from weights ``[n, dim]`` (of
        ``dtype``, or float32, rounded to nearest) and float32 state ``[n, state_dim]``."""
        rows = torch.empty(weights.shape[0], self.stored_width, dtype=self.dtype,
                           device=weights.device)  # fmt: skip
        rows[:, : self.dim] = weights
        if self.state_dim:
            state = state.to(torch.float32).contiguous().view(self.dtype)
            rows[:, self.dim :] = state
        return rows

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [n, dim] of dtype, state [n, state_dim] float32)`` of stored rows (the
        weights are a view, the state a copy)."""
        state = rows[:, self.dim :].contiguous().view(torch.float32)
        return rows[:, : self.dim], state

    def state_fill(self) -> torch.Tensor:
        """The state columns of a fresh stored row: ``state_init`` as float32 bits, in
        ``dtype`` (``[state_columns]``)."""
        state = torch.full((self.state_dim,), float(self.state_init), dtype=torch.float32)
        return state.view(self.dtype)

    def to_float(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows as float32 ``[n, dim + state_dim]``: weights widened, then state."""
        weights, state = self.unpack(rows)
        return torch.cat([weights.to(torch.float32), state], dim=1)

    def from_float(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows from float32 ``[n, dim + state_dim]`` (weights rounded to nearest)."""
        rows = rows.to(torch.float32)
        return self.pack(rows[:, : self.dim], rows[:, self.dim :])

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Fresh stored rows ``[n, stored_width]`` for ``ids`` (CPU int64 ``[n]``): the
        initialiser's float32 weights (rounded to nearest into ``dtype``), state_init state."""
        init = self.init or default_init(self)
        weights = init(ids, self.dim)
        if weights.shape != (ids.numel(), self.dim):
            raise ValueError(
                f"table {self.name!r}: init returned shape {tuple(weights.shape)}, "
                f"expected {(ids.numel(), self.dim)}"
            )
        state = torch.full((ids.numel(), self.state_dim), float(self.state_init))
        return self.pack(weights, state)


def host_memory_bytes() -> int:
    """This machine's physical memory, in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def table_hash(name: str) -> int:
    """A stable (process-independent) 31-bit number for a table name."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def default_init(spec: TableSpec) -> RowInit:
    """Uniform in ``±sqrt(1 / num_embeddings)`` (torchrec's default), from a counter-based hash.

    Each value is a function of ``(seed, table name, id, column)`` alone, so any order of first
    touches gives the same rows, on any tier. Unbounded tables use ``±sqrt(1 / dim)``.
    """
    bound = math.sqrt(1.0 / (spec.num_embeddings or spec.dim))
    return hashed_init(spec.name, spec.seed, "uniform", low=-bound, high=bound)


HASHED_DISTRIBUTIONS = {
    "uniform": ("low", "high"),
    "normal": ("mean", "std"),
    "constant": ("value",),
}
_ANGLE_SALT = 0x5851F42D4C957F2D  # a second, independent stream for Box-Muller's angle


@dataclass(frozen=True, eq=False)
class HashedInit:
    """A `hashed_init` initialiser: callable as a `RowInit`, and its recipe, which is all a
    checkpoint needs to give back every row never touched (`recipe`, `from_recipe`).

    Attributes:
        name: the table's name (salts the hash).
        seed: the seed.
        distribution: ``"uniform"``, ``"normal"`` or ``"constant"``.
        params: the distribution's parameters (`HASHED_DISTRIBUTIONS`).
    """

    name: str
    seed: int
    distribution: str
    params: dict[str, float]
    draw: RowInit

    def __call__(self, ids: torch.Tensor, dim: int) -> torch.Tensor:
        return self.draw(ids, dim)

    def recipe(self) -> dict[str, Any]:
        """JSON: ``{"kind": "hashed", "seed", "distribution", "params"}``."""
        return {
            "kind": "hashed",
            "seed": self.seed,
            "distribution": self.distribution,
            "params": dict(self.params),
        }

    @staticmethod
    def from_recipe(name: str, recipe: Any) -> HashedInit:
        """The initialiser `recipe` describes, for table ``name``.

        Raises:
            ValueError: not a valid recipe (what is wrong is said).
        """
        if not isinstance(recipe, dict) or recipe.get("kind") != "hashed":
            raise ValueError(f"table {name!r}: not a hashed init recipe: {recipe!r}")
        seed, params = recipe.get("seed"), recipe.get("params")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"table {name!r}: init recipe seed {seed!r} is not an int >= 0")
        if not isinstance(params, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in params.values()
        ):
            raise ValueError(f"table {name!r}: init recipe params {params!r} are not numbers")
        return hashed_init(name, seed, str(recipe.get("distribution")), **params)


def hashed_init(name: str, seed: int, distribution: str, **params: float) -> HashedInit:
    """Weights drawn per id from a counter-based hash of ``(seed, table name, id, column)``:
    any order of first touches gives the same rows, on any tier. The result is a `RowInit`
    that also knows its recipe (`HashedInit`).

    Args:
        name: the table's name (salts the hash, so tables differ).
        seed: the seed.
        distribution: ``"uniform"`` (``low``, ``high``; 24 random bits per value),
            ``"normal"`` (``mean``, ``std``; Box-Muller on two 53-bit draws) or ``"constant"``
            (``value``).
        **params: the distribution's parameters, named as above.
    """
    if distribution not in HASHED_DISTRIBUTIONS or set(params) != set(
        HASHED_DISTRIBUTIONS[distribution]
    ):
        raise ValueError(
            f"table {name!r}: unknown init {distribution}({sorted(params)}); known: "
            f"{HASHED_DISTRIBUTIONS}"
        )
    params = {k: float(v) for k, v in params.items()}
    return HashedInit(
        name, int(seed), distribution, params, _hashed_draw(name, seed, distribution, params)
    )


def _hashed_draw(name: str, seed: int, distribution: str, params: dict[str, float]) -> RowInit:
    salt = (seed * 1_000_003 + table_hash(name)) & 0x7FFFFFFFFFFF
    if distribution == "constant":
        value = float(params["value"])
        return lambda ids, dim: torch.full((ids.numel(), dim), value, dtype=torch.float32)

    if distribution == "uniform":
        mid = (params["high"] + params["low"]) / 2.0
        half = (params["high"] - params["low"]) / 2.0
        rows = ops_for("cpu").rows  # bound when made: the compiled pass draws in one pass

        def uniform(ids: torch.Tensor, dim: int) -> torch.Tensor:
            # The same bits from every implementation.
            return rows.hashed_uniform(ids, salt, mid, half, dim)

        return uniform

    mean, std = float(params["mean"]), float(params["std"])

    def normal(ids: torch.Tensor, dim: int) -> torch.Tensor:
        c = row_counters(ids.cpu(), salt, dim)
        u1 = (((mix64(c) >> 11) & ((1 << 53) - 1)).to(torch.float64) + 0.5) / (1 << 53)
        u2 = ((mix64(c ^ _ANGLE_SALT) >> 11) & ((1 << 53) - 1)).to(torch.float64) / (1 << 53)
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
        return (mean + std * z).to(torch.float32)

    return normal


def checked_ids(spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` as contiguous CPU int64 ``[n]``, or a TypeError/ValueError saying what is wrong."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"table {spec.name!r}: ids must be a torch.Tensor, got {type(ids).__name__}"
        )
    if ids.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"table {spec.name!r}: ids must have an integer dtype, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"table {spec.name!r}: ids must be 1-D, got shape {tuple(ids.shape)}")
    ids = ids.to(device="cpu", dtype=torch.int64).contiguous()
    if ids.numel() == 0:
        return ids
    low, high = (int(bound) for bound in torch.aminmax(ids))
    limit = spec.num_embeddings
    if low < 0:
        at = int((ids < 0).nonzero()[0])
        raise ValueError(
            f"table {spec.name!r}: id {int(ids[at])} at position {at} is negative; ids must be "
            + (f"in [0, {limit})" if limit is not None else ">= 0")
        )
    if limit is not None and high >= limit:
        at = int((ids >= limit).nonzero()[0])
        raise ValueError(
            f"table {spec.name!r}: id {int(ids[at])} at position {at} is out of range; "
            f"ids must be in [0, {limit}) (num_embeddings={limit})"
        )
    return ids


def checked_rows(spec: TableSpec, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as contiguous CPU stored rows ``[n, stored_width]`` of ``spec.dtype``, or a
    TypeError/ValueError.

    Accepted: stored rows (``spec.dtype``, ``stored_width`` columns), or any floating
    ``[n, dim + state_dim]`` float view (`TableSpec.to_float`), whose weights are rounded to
    nearest into ``spec.dtype``. For a float32 table the two are the same.
    """
    if not isinstance(rows, torch.Tensor):
        raise TypeError(
            f"table {spec.name!r}: rows must be a torch.Tensor, got {type(rows).__name__}"
        )
    if not rows.is_floating_point():
        raise TypeError(f"table {spec.name!r}: rows must be floating point, got {rows.dtype}")
    rows = rows.detach().to("cpu")
    if rows.dtype == spec.dtype and tuple(rows.shape) == (ids.numel(), spec.stored_width):
        return rows.contiguous()
    expected = (ids.numel(), spec.row_width)
    if tuple(rows.shape) != expected:
        stored = f" or {spec.dtype} {(ids.numel(), spec.stored_width)}"
        raise ValueError(
            f"table {spec.name!r}: rows have shape {tuple(rows.shape)} {rows.dtype}, expected "
            f"{expected} ({ids.numel()} ids x (dim={spec.dim} + state_dim={spec.state_dim}))"
            + (stored if spec.dtype != torch.float32 else "")
        )
    return spec.from_float(rows).contiguous()


class Store(abc.ABC):
    """A backing tier: batched row reads and writes, per table. Tiers subclass it.

    ``get`` creates rows that do not exist yet (with the table's initialiser) and returns them;
    ``read`` returns the same values but creates nothing (a row never written reads as its
    initial value, which is a function of its id, and stays absent); ``put`` overwrites rows
    (creating them). All take CPU int64 ids; rows are CPU stored rows ``[n, stored_width]`` of
    the table's dtype (float32 ``[n, dim + state_dim]`` for a float32 table; see
    `TableSpec.pack`), and ``put`` also takes the float32 view. Ids within one call are
    distinct. Calls are synchronous: when ``put`` returns, a later ``get`` or ``read`` sees the
    rows. Which rows exist, pins of bounded tables, and which of ``get`` and ``read`` the
    device cache calls: see the module's docstring.

    Capabilities, declared here with their defaults so callers never probe for them:

    * ``parallel_io``: True when concurrent calls overlap their latency (a remote tier); the
      cache then issues its per-table calls concurrently.
    * `io_stats` / `reset_io_stats`: traffic counters (empty when a tier keeps none).
    * `flush`: make every accepted write durable in the tier's own backing (a no-op for tiers
      that write through).
    * ``lease_owner``: the token under which this client holds its tables (None when the tier
      has no leases).
    * `unclean_ends`, `save_run_record`, `run_record`: what a persistent tier remembers of the
      jobs on it (nothing, by default).
    * `keeps_scores`: whether `export_rows` can give a table's eviction scores (bounded tables).
    * `remove`, `row_count`: drop rows, count them (not every tier can).
    * `get_grouped` / `read_grouped` / `put_grouped`: several tables in one call (here, one
      call per table; an in-process tier does them in one pass).
    """

    parallel_io: bool = False

    @abc.abstractmethod
    def init_table(self, spec: TableSpec) -> None:
        """Declare a table. Declaring it again with another ``state_dim``/``state_init`` keeps
        the weights and resets the state columns; another ``dim``, ``num_embeddings`` or
        ``dtype`` is a ``ValueError``."""

    @abc.abstractmethod
    def table_spec(self, table: str) -> TableSpec:
        """The spec a table was declared with (``KeyError`` naming it when unknown)."""

    @abc.abstractmethod
    def tables(self) -> list[str]:
        """Names of the declared tables."""

    @abc.abstractmethod
    def get(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Stored rows of ``ids``; missing rows are created first. ``pin``: hold them until
        `unpin` (bounded tables never evict a pinned row)."""

    @abc.abstractmethod
    def read(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Stored rows of ``ids`` without creating any: a row that does not exist reads as
        its initial value and is not stored. ``pin``: hold the rows that exist until `unpin`
        (bounded tables); a row that does not exist is not pinned, and an `unpin` of it is
        ignored."""

    @abc.abstractmethod
    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows (stored, or the float32 view) for ``ids``."""

    def get_grouped(
        self,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        pins: Sequence[bool] | None = None,
    ) -> torch.Tensor:
        """`get` of several tables (of one row layout) at once: ``ids`` holds ``counts[k]`` ids
        of ``tables[k]`` after those of ``tables[:k]``; returns their stored rows in that
        order, one tensor. ``pins[k]``: pin table ``k``'s rows (bounded tables). Here, one
        `get` per table; a tier that serves several tables in one pass overrides it."""
        return _per_table(self.get, tables, ids, counts, pins)

    def read_grouped(
        self,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        pins: Sequence[bool] | None = None,
    ) -> torch.Tensor:
        """`read` of several tables (of one row layout) at once, ``ids`` and ``pins`` as
        `get_grouped` takes them: no row is created. Here, one `read` per table."""
        return _per_table(self.read, tables, ids, counts, pins)

    def put_grouped(
        self, tables: Sequence[str], ids: torch.Tensor, counts: Sequence[int], rows: torch.Tensor
    ) -> None:
        """`put` of several tables (of one row layout) at once, ``ids`` as `get_grouped` takes
        them and ``rows`` in their order. Here, one `put` per table, after every table's ids
        are checked (a bad one raises before any table is written)."""
        _put_per_table(self, tables, ids, counts, rows)

    def get_grouped_into(
        self,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
    ) -> bool:
        """`get_grouped` straight into a CPU cache's slot storage, for a tier that can: the
        stored row of ``ids[i]`` lands in ``weights[slots[i]]`` (its first
        ``weights.shape[1]`` values) and ``state[slots[i]]`` (the rest), without a rows tensor
        between. True when every row was moved (all of them existed: it creates none, so a
        read that must not create may take it too); False when this tier cannot take the call
        (here: never) or a row does not exist, with nothing read, written or counted: the
        caller then makes it through `get_grouped` (which creates rows and raises as it says)
        or `read_grouped`."""
        return False

    def put_grouped_from(
        self,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
    ) -> bool:
        """`put_grouped` straight out of a CPU cache's slot storage, for a tier that can:
        ``ids[i]``'s stored row is ``weights[slots[i]]`` then ``state[slots[i]]``. True when
        every row was written; False when this tier cannot take the call (here: never), with
        nothing written: the caller then makes it through `put_grouped`."""
        return False

    @abc.abstractmethod
    def export_rows(
        self, table: str, chunk_rows: int = 65536, scores: bool = False
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Every existing row of a table as ``(ids, rows)`` chunks of at most ``chunk_rows``,
        ids ascending; with ``scores`` (tiers that `keeps_scores`), ``(ids, rows, scores)``.
        Rows never touched are not listed (their value is the initialiser's)."""

    @abc.abstractmethod
    def import_rows(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        """Load rows from a checkpoint (same meaning as ``put``), with their eviction scores
        when given (bounded tables)."""

    def unpin(self, table: str, ids: torch.Tensor) -> None:  # noqa: B027 (no pins kept by default)
        """Release one pin of each of ``ids`` (pinned by ``get(..., pin=True)``)."""

    def keeps_scores(self, table: str) -> bool:
        """Whether ``table`` is bounded here, with eviction scores `export_rows` can give."""
        del table
        return False

    def remove(self, table: str, ids: torch.Tensor) -> None:
        """Drop the rows of ``ids`` (absent ones are ignored): touched again, they start from
        their initialiser."""
        raise NotImplementedError(f"{type(self).__name__} cannot remove rows of {table!r}")

    def row_count(self, table: str) -> int:
        """Rows of ``table`` that exist in this tier (here: by streaming `export_rows`; tiers
        that keep a count answer at once)."""
        return sum(chunk[0].numel() for chunk in self.export_rows(table))

    def close(self) -> None:  # noqa: B027 (a tier holding no resources needs nothing here)
        """Release resources (connections, files). The store is unusable afterwards."""

    def flush(self) -> None:  # noqa: B027 (write-through tiers have nothing to flush)
        """Make every accepted write durable in this tier's backing."""

    def io_stats(self) -> dict[str, int]:
        """Traffic counters (rows and bytes read and written, calls); empty when not kept."""
        return {}

    def reset_io_stats(self) -> None:  # noqa: B027 (no counters kept by default)
        """Zero the counters of `io_stats`."""

    @property
    def lease_owner(self) -> str | None:
        """The token under which this client holds its tables; None without leases."""
        return None

    def tier_state(self, count_rows: bool = True) -> Any:
        """What this tier holds now for the tables declared through it, as a
        `embcache.kv.tier_state.TierState` to record beside a run or checkpoint; None (the
        default) for a tier that keeps nothing between processes."""
        del count_rows
        return None

    def expect_state(self, state: Any) -> None:  # noqa: B027 (nothing kept: nothing to check)
        """Continue from ``state`` (an earlier run's `tier_state`): a tier that lost what it
        recorded raises `TierDataLossError` (see `embcache.kv.tier_state`). The default keeps
        nothing between processes, so there is nothing to check."""

    def unclean_ends(self) -> list[dict[str, Any]]:
        """Jobs that used this tier before and ended without closing it (their caches' dirty
        rows never reached it); none for a tier that keeps nothing between processes."""
        return []

    def save_run_record(self, name: str, record: dict[str, Any]) -> None:  # noqa: B027
        """Keep a run record (JSON-able) with the tier itself; the default keeps nothing."""

    def run_record(self, name: str) -> dict[str, Any] | None:
        """The run record ``name`` kept with the tier (None: none, or a tier that keeps
        nothing between processes)."""
        del name
        return None


class IOStats(dict):
    """Traffic counters of a tier's ``get``/``put`` (what its ``io_stats()`` returns): rows and
    bytes read and written, calls, rows created on first touch, rows evicted from bounded
    tables (``tier_evictions``), plus any ``extra`` keys."""

    KEYS = (
        "rows_read",
        "rows_written",
        "bytes_read",
        "bytes_written",
        "get_calls",
        "put_calls",
        "rows_created",
        "tier_evictions",
    )

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        super().__init__(dict.fromkeys(self.KEYS + extra, 0))

    def reset(self) -> None:
        """Zero every counter."""
        for key in self:
            self[key] = 0

    def count(self, direction: str, rows: int, row_bytes: int) -> None:
        """One ``get`` (``direction="read"``) or ``put`` (``"written"``) of ``rows`` rows."""
        self[f"rows_{direction}"] += rows
        self[f"bytes_{direction}"] += rows * row_bytes
        self["get_calls" if direction == "read" else "put_calls"] += 1


def _per_table(
    call: Callable[..., torch.Tensor],
    tables: Sequence[str],
    ids: torch.Tensor,
    counts: Sequence[int],
    pins: Sequence[bool] | None,
) -> torch.Tensor:
    """``call(table, ids)`` (`Store.get` or `Store.read`) per table of a grouped call, the rows
    in order, one tensor. ``pin=True`` is passed only when pinning: a tier's own ``get`` may
    not take the argument."""
    parts = []
    start = 0
    for k, (table, n) in enumerate(zip(tables, counts, strict=True)):
        part = ids[start : start + n]
        pinned = pins is not None and pins[k]
        parts.append(call(table, part, pin=True) if pinned else call(table, part))
        start += n
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _put_per_table(
    store: Store,
    tables: Sequence[str],
    ids: torch.Tensor,
    counts: Sequence[int],
    rows: torch.Tensor,
) -> None:
    """`Store.put` per table of a grouped write, after every table's ids are checked."""
    start = 0
    for table, n in zip(tables, counts, strict=True):
        checked_ids(store.table_spec(table), ids[start : start + n])
        start += n
    start = 0
    for table, n in zip(tables, counts, strict=True):
        store.put(table, ids[start : start + n], rows[start : start + n])
        start += n
