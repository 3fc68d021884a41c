"""Configuration of a device cache: how many rows, which eviction policy, how associative, in
which precision, and what bounds the tier behind it."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from embcache.cache.policy_registry import policy_name
from embcache.kernels.optim_rules import WIDEST_STATE
from embcache.kv.base import ScorePolicy, host_memory_bytes

_DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EXACT_LFU_MAX_ROWS = 1 << 24  # "auto": exact per-row LFU counts up to this many rows (128 MiB)

CPU_MEMORY_BUDGET = 1 << 30  # bytes of slots a default cache takes on the CPU
GPU_MEMORY_FRACTION = 0.25  # ... and the fraction of a GPU's memory it takes there
SLOT_OVERHEAD = 8 + 4 + 1 + 8  # bytes of a slot besides its row: key, lock, dirty flag, score
# WIDEST_STATE: state values per weight of the widest optimizer rule (Adam's 2), from the rules.


def slot_bytes(width: int) -> int:
    """Device bytes of one slot holding a row of ``width`` float32 values."""
    return 4 * width + SLOT_OVERHEAD


def weight_dtype_of(value: Any, where: str) -> torch.dtype:
    """A weight dtype from ``"fp32"``/``"fp16"``/``"bf16"``, a torch dtype, or torchrec's
    ``DataType`` (FP32, FP16, BF16)."""
    if isinstance(value, torch.dtype) and value in _DTYPE_NAMES.values():
        return value
    if isinstance(value, enum.Enum):  # torchrec's DataType, recognised without torchrec
        value = value.name
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    raise ValueError(f"{where} must be FP32, FP16 or BF16, got {value!r}")


class CachePolicy(enum.StrEnum):
    """The names of the built-in eviction policies (which resident row a miss evicts); a
    member equals its name, and `CacheConfig.policy` takes either, or the name of any policy
    registered in `embcache.cache.policy_registry`.

    LRU evicts the way of its set used longest ago. LFU evicts the way whose row has been asked
    for least often; frequencies are kept per row of the whole table (as FBGEMM does), so they
    survive eviction and the cache converges to the most frequent rows.
    """

    LRU = "lru"
    LFU = "lfu"


@dataclass
class CacheConfig:
    """Size and policy of the device cache of a collection (one cache per embedding dim).

    Attributes:
        capacity: rows held on the device, per cache. Mutually exclusive with ``load_factor``.
            A dict by table name (``{"t0": 4096, "t1": 512}``) gives each table it names a
            cache of its own of that many rows (see "Per-table sizes" below).
        load_factor: capacity as a fraction of the rows of the tables a cache serves; a dict
            by table name (``{"t0": 0.1, "t1": 0.5}``, as FBGEMM's and dynamicemb's per-table
            cache sizes) gives each table it names a cache of its own holding that fraction of
            its rows. With neither given, the whole table is cached when its slots fit
            ``memory_budget``; otherwise the cache holds the rows that fit (a load factor
            below 1, said once in the log).
        memory_budget: bytes the slots of a cache may take when neither ``capacity`` nor
            ``load_factor`` is given, each slot counted at its widest (weights, Adam's two
            state values per weight, its key, lock, score and dirty flag). None: a quarter of
            a GPU's memory, 1 GiB on the CPU.
        policy: the eviction policy's name: ``"lru"``, ``"lfu"`` (a `CachePolicy`) or any
            other registered in `embcache.cache.policy_registry`; kept as its lower-case name.
        ways: associativity: slots per set. A capacity below ``ways`` gives one set.
        max_scratch_rows: bound on the scratch area that serves the rows of a batch that find
            no free way in their set (or do not fit the cache at all). It grows on demand up to
            this many rows; a batch needing more is refused with an error saying what to set.
        lfu_decay: LFU only: every ``lfu_decay_interval`` lookups all frequencies are multiplied
            by this factor (0 < decay < 1), for traffic whose popular ids drift. None: no decay.
        lfu_decay_interval: lookups (batches) between two decays.
        lfu_counters: LFU only: where frequencies live. ``"exact"``: one count per row of the
            cache's tables (kept across evictions, as FBGEMM does; 8 bytes a row); ``"sketch"``:
            a count-min sketch of ``sketch_depth x sketch_width`` int32 counters, whatever the
            tables' size (overestimates a little; conservative update); ``"auto"``: exact for
            tables of up to 16M rows in all, the sketch for larger or unbounded ones.
        sketch_width: counters per row of a count-min sketch (LFU's and admission's).
        sketch_depth: rows (hash functions) of a count-min sketch.
        weight_dtype: the weights' precision in the cache and the tier: ``"fp32"``, ``"fp16"``,
            ``"bf16"`` (or a torch dtype); None: each table's ``data_type``. Optimizer state
            stays float32; half-precision updates round stochastically.
        stochastic_rounding: round half-precision updates stochastically (unbiased, FBGEMM's
            default for fp16 weights); False rounds to nearest.
        tier_capacity: most rows the tier keeps per table (an int for every table, or a dict by
            table name); None: no bound. A full table evicts its unpinned rows of lowest
            score (never one the cache holds); an evicted row comes back from its
            initialiser. Must leave room beyond the rows the cache holds.
        tier_policy: the tier's eviction score (`embcache.kv.base.ScorePolicy`), ``"lru"`` or
            ``"lfu"``.
        admit_after: an id gets its own row only at its N-th sighting (a batch it appears in,
            counted by a count-min sketch): before, it reads a row of zeros and its gradients
            are dropped (``admissions_refused`` and ``gradients_dropped`` in `cache_stats`).
            An int for every table or a dict by table name; None or 1: every id is admitted.
        admission_window: sightings (unique ids of a batch, of the tables with admission)
            between two halvings of every counter of the admission sketch (TinyLFU's aging):
            one-off ids' counts fall back to 0, so the sketch keeps refusing them on an endless
            stream; an id must reach ``admit_after`` within about a window. None:
            ``sketch_width`` (one sighting per counter of a row; a much longer window lets
            collisions raise every counter and admit nearly every new id).

    A capacity at least the number of rows of a cache's (bounded) tables maps every row to its
    own slot: nothing is ever evicted and no lookup is needed (unless the tier is bounded).

    Per-table sizes. Tables of one dim share one cache, sized for all of them, unless
    ``capacity`` or ``load_factor`` is a dict: then each table it names gets its own cache
    (rows of other tables never evict its rows, nor its rows theirs) of the size given, and the
    tables it does not name share their dim's cache as with neither given (whole when it fits
    ``memory_budget``). Each cache costs its own lookups per step, so name only the tables
    whose size matters. A name that is no table of the collection is refused when the
    collection is built (`check_tables`).
    """

    capacity: int | Mapping[str, int] | None = None
    load_factor: float | Mapping[str, float] | None = None
    policy: str = CachePolicy.LRU
    ways: int = 32
    memory_budget: int | None = None
    max_scratch_rows: int = 1 << 20
    lfu_decay: float | None = None
    lfu_decay_interval: int = 1000
    lfu_counters: str = "auto"
    sketch_width: int = 1 << 20
    sketch_depth: int = 4
    weight_dtype: str | torch.dtype | Any = None
    stochastic_rounding: bool = True
    tier_capacity: int | Mapping[str, int] | None = None
    tier_policy: ScorePolicy | str = ScorePolicy.LRU
    admit_after: int | Mapping[str, int] | None = field(default=None)
    admission_window: int | None = None

    def __post_init__(self) -> None:
        if self.capacity is not None and self.load_factor is not None:
            raise ValueError("CacheConfig: give capacity or load_factor, not both")
        if isinstance(self.capacity, Mapping):
            self.capacity = dict(self.capacity)
            for table, value in self.capacity.items():
                _check_capacity(value, f"CacheConfig.capacity[{table!r}]")
        elif self.capacity is not None:
            _check_capacity(self.capacity, "CacheConfig.capacity")
        if isinstance(self.load_factor, Mapping):
            self.load_factor = dict(self.load_factor)
            for table, fraction in self.load_factor.items():
                _check_load_factor(fraction, f"CacheConfig.load_factor[{table!r}]")
        elif self.load_factor is not None:
            _check_load_factor(self.load_factor, "CacheConfig.load_factor")
        self.policy = policy_name(self.policy, "CacheConfig.policy")
        if self.memory_budget is not None and (
            isinstance(self.memory_budget, bool)
            or not isinstance(self.memory_budget, int)
            or self.memory_budget < 1
        ):
            raise ValueError(
                f"CacheConfig.memory_budget must be an int >= 1 (bytes), got {self.memory_budget!r}"
            )
        if not isinstance(self.ways, int) or self.ways < 1:
            raise ValueError(f"CacheConfig.ways must be an int >= 1, got {self.ways!r}")
        if not isinstance(self.max_scratch_rows, int) or self.max_scratch_rows < 0:
            raise ValueError(
                f"CacheConfig.max_scratch_rows must be an int >= 0, got {self.max_scratch_rows!r}"
            )
        if self.lfu_decay is not None and not (0.0 < self.lfu_decay < 1.0):
            raise ValueError(f"CacheConfig.lfu_decay must be in (0, 1), got {self.lfu_decay}")
        if self.lfu_decay_interval < 1:
            raise ValueError("CacheConfig.lfu_decay_interval must be >= 1")
        if self.lfu_counters not in ("auto", "exact", "sketch"):
            raise ValueError(
                f"CacheConfig.lfu_counters must be 'auto', 'exact' or 'sketch', got "
                f"{self.lfu_counters!r}"
            )
        for name in ("sketch_width", "sketch_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CacheConfig.{name} must be an int >= 1, got {value!r}")
        window = self.admission_window
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(
                f"CacheConfig.admission_window must be an int >= 1 (sightings) or None, got "
                f"{window!r}"
            )
        if self.weight_dtype is not None:
            self.weight_dtype = weight_dtype_of(self.weight_dtype, "CacheConfig.weight_dtype")
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(
                f"CacheConfig.stochastic_rounding must be a bool, got {self.stochastic_rounding!r}"
            )
        try:
            self.tier_policy = ScorePolicy(
                self.tier_policy.lower() if isinstance(self.tier_policy, str) else self.tier_policy
            )
        except ValueError:
            scores = " or ".join(repr(p.value) for p in ScorePolicy)
            raise ValueError(
                f"CacheConfig.tier_policy must be {scores}, got {self.tier_policy!r}"
            ) from None
        for name in ("tier_capacity", "admit_after"):
            value = getattr(self, name)
            values = value.values() if isinstance(value, Mapping) else [value]
            if any(
                v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1)
                for v in values
            ):
                raise ValueError(
                    f"CacheConfig.{name} must be an int >= 1, a dict of them by table name, or "
                    f"None; got {value!r}"
                )

    @property
    def per_table(self) -> Mapping[str, int] | Mapping[str, float] | None:
        """The dict of ``capacity`` or ``load_factor`` by table name, if one was given."""
        for value in (self.capacity, self.load_factor):
            if isinstance(value, Mapping):
                return value
        return None

    def check_tables(self, names: list[str]) -> None:
        """Refuse (ValueError) a per-table size naming no table of ``names``."""
        sizes = self.per_table
        if sizes is None:
            return
        field_name = "capacity" if isinstance(self.capacity, Mapping) else "load_factor"
        unknown = [k for k in sizes if k not in names]
        if unknown:
            raise ValueError(
                f"CacheConfig.{field_name} names table {unknown[0]!r}, which the collection "
                f"does not have (tables: {names})"
            )

    def split(self, tables: Sequence[Any]) -> list[tuple[CacheConfig, list[Any]]]:
        """The caches of ``tables`` (objects with ``name`` and ``dim``), by ascending dim: per
        dim, one cache for the tables no per-table size names, then one per table named (in
        table order), each with its own config (a plain ``capacity`` or ``load_factor``)."""
        sizes = self.per_table
        out: list[tuple[CacheConfig, list[Any]]] = []
        for dim in sorted({t.dim for t in tables}):
            mine = [t for t in tables if t.dim == dim]
            if sizes is None:
                out.append((self, mine))
                continue
            shared = [t for t in mine if t.name not in sizes]
            if shared:
                out.append((replace(self, capacity=None, load_factor=None), shared))
            for t in mine:
                if t.name in sizes:
                    out.append((self.for_table(t.name), [t]))
        return out

    def for_table(self, table: str) -> CacheConfig:
        """The config of a cache of ``table`` alone: its per-table size (or neither, when the
        dicts do not name it); a plain size is kept."""
        if self.per_table is None:
            return self
        capacity = self.capacity.get(table) if isinstance(self.capacity, Mapping) else None
        load_factor = self.load_factor.get(table) if isinstance(self.load_factor, Mapping) else None
        return replace(self, capacity=capacity, load_factor=load_factor)

    def rows_for(
        self,
        table_rows: int | None,
        dim: int | None = None,
        device: torch.device | str = "cpu",
    ) -> int:
        """Capacity in rows for a cache serving ``table_rows`` rows (None: unbounded tables).

        With neither ``capacity`` nor ``load_factor`` and rows of ``dim`` weights, the rows
        whose slots fit `budget` on ``device``, each slot counted at its widest (weights and
        Adam's two state values per weight) so that attaching any optimizer keeps to it: all
        of them when they fit, at least one. Without ``dim``: all of them.

        Raises:
            ValueError: a per-table size (`split` gives each cache its own config).
        """
        if self.per_table is not None:
            raise ValueError(
                "CacheConfig.rows_for: capacity/load_factor by table name size one cache per "
                "table: ask the config of each cache (CacheConfig.split or for_table)"
            )
        assert not isinstance(self.capacity, Mapping)
        assert not isinstance(self.load_factor, Mapping)
        if self.capacity is not None:
            return self.capacity if table_rows is None else min(self.capacity, table_rows)
        if table_rows is None:
            raise ValueError(
                "CacheConfig: a cache serving an unbounded (hashed-id) table needs an explicit "
                "capacity; load_factor is a fraction of a known row count"
            )
        if self.load_factor is None and dim is not None:
            widest = slot_bytes((1 + WIDEST_STATE) * dim)
            return max(1, min(table_rows, self.budget(device) // widest))
        return max(1, math.ceil((self.load_factor or 1.0) * table_rows))

    def tier_capacity_of(self, table: str) -> int | None:
        """The tier capacity of ``table`` (None: unbounded)."""
        if isinstance(self.tier_capacity, Mapping):
            return self.tier_capacity.get(table)
        return self.tier_capacity

    def admit_after_of(self, table: str) -> int:
        """Sightings before an id of ``table`` gets its own row (1: at once)."""
        value = (
            self.admit_after.get(table)
            if isinstance(self.admit_after, Mapping)
            else self.admit_after
        )
        return value or 1

    @property
    def effective_admission_window(self) -> int:
        """Sightings between two halvings of the admission sketch."""
        return self.admission_window or self.sketch_width

    def budget(self, device: torch.device | str) -> int:
        """``memory_budget``, or the default one on ``device`` (see the class docstring)."""
        if self.memory_budget is not None:
            return self.memory_budget
        device = torch.device(device)
        if device.type == "cuda":
            return int(GPU_MEMORY_FRACTION * device_memory(device))
        return CPU_MEMORY_BUDGET


def _check_capacity(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where} must be an int (rows), got {value!r}")
    if value < 1:
        raise ValueError(f"{where} must be >= 1 row, got {value}")


def _check_load_factor(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a float in (0, 1], got {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{where} must be in (0, 1], got {value}")


def device_memory(device: torch.device | str) -> int:
    """Total bytes of memory of ``device``: a GPU's, or this machine's physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()
