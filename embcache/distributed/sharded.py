"""Row-wise sharding over torch.distributed: every row lives on exactly one rank, its owner.

Owner of a row. A collection row is named by its fused id ``id | (table_idx << fusion_k)``;
`owner_of` maps it to its owner rank, and `kv_owner_of` does the same for the rows of a
`ShardedKVClient` tensor. The owner hash (splitmix64's finaliser of the salted id, modulo the
world size) and why it is salted are documented in `embcache.distributed.exchange`, with the
all_to_all helper (`Comm`) and `CollectiveError`; `ShardedKVClient` lives in
`embcache.distributed.sharded_kv`. All of them are importable from here too.

`ShardedEmbeddingBagCollection` is a `CachedEmbeddingBagCollection` whose caches (one per dim)
and store hold only the rows this rank owns; `ShardedEmbeddingCollection`
(`embcache.distributed.sharded_sequence`) is the same for a `CachedEmbeddingCollection` (one
row per id, unpooled). Both are a `ShardedCollection`, whose `ShardExchange` makes the
exchanges; they differ only in their outputs (`ShardedCollection._outputs`) and in each
cache's reduction (`engine.reduction`: pool bags, or gather one row per value). A training
step with G caches (embedding dims) makes 2 + 2G all_to_alls:

* forward, on every rank: validate, fuse and dedup its own batch per cache; send every unique id
  to its owner (1: a ``[W, 5]`` header of counts, op code, tag, status and prefetch; 2: the ids,
  grouped by owner). Each owner dedups what it received, resolves those ids to slots in its own
  `HotCache` (locked until the step, as in one process) and, per cache, sends each requester
  its rows ``[n, dim]`` in the order asked, behind one status row (3: G exchanges). The
  requester pools its bags (or gathers each value's row) locally from the received rows (the
  cache's `engine.reduction`, the slots being the rows' positions in what it received).
* backward, per cache: the reduction's backward gives one gradient row per unique id of the
  requester, sent to the owners (4: G exchanges). Each owner sums the rows of an id over the
  ranks in rank order (`aggregate_grads`, deterministic) and records them in its ``_trace``.

The optimizer is the ordinary one: ``SparseAdaGrad([sharded], lr=...)``. Its ``step()`` only
reads the owner's trace and applies `apply_row_update` in the owner's cache slots, so every row
has one writer and no step needs communication. Results equal one process trained on the
concatenated global batch up to the order of float32 additions (a row's gradient is summed per
rank, then over ranks).

Prefetch. `issue_fused_prefetch` (and `TrainPipeline`, which calls it for batch i+1 before
batch i's forward) runs steps 1 and 2 and the owners' resolve on the collection's prefetch
worker, over a process group of its own created at construction (gloo and NCCL do not order
the collectives of one group across threads). The owners only lock the slots: rows are sent at
the forward, after the previous step updated them, so the forward with a handle makes its
header and the G row exchanges (step 2 and the tier I/O are hidden), and the numbers are those
of a forward without prefetch, bit for bit. The forward's header says which prefetch each rank
uses: unless every rank uses the same one (a rank has none, released it, or its owner side
failed, e.g. a `CacheCapacityError` because the batch in flight leaves too little room), every
rank gives its prefetched slots back and runs the whole exchange in the forward. A rank whose
prefetch input is refused raises at the issue; the peers' prefetches fail and their forwards
read synchronously.

Collectives. ``forward``, its backward, ``table_rows``/``state_dict`` and
``cache_stats(all_ranks=True)`` are collectives: every rank makes them in the same order (an
empty batch included; a rank's ``backward`` must reach its output, e.g. ``kt.values().sum()``).
A rank whose input is refused (bad ids, a pending trace) still takes part in the header, so every
rank raises (the others a `CollectiveError` naming it) and nothing changes anywhere. Calls that do
not match across ranks (a forward against a KV pull, training against ``no_grad``) raise on
every rank. A peer that dies or times out turns into a `CollectiveError` naming the exchange.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from embcache.cache.config import CacheConfig
from embcache.distributed.exchange import (
    NO_PREFETCH,
    OP_FORWARD,
    OP_PREFETCH,
    OWNER_SALT,
    CollectiveError,
    Comm,
    Route,
    kv_owner_of,
    owner_of,
    with_status,
)
from embcache.distributed.sharded_kv import ShardedKVClient
from embcache.engine.batch_state import FusedPrefetchHandle, InFlight, Prefetched, Prepared
from embcache.engine.group import EngineGroup
from embcache.engine.inputs import JaggedBatch, pooled_output
from embcache.engine.interface import CachedCollectionInterface
from embcache.engine.lookup import lookup
from embcache.engine.options import FUSION_K, CollectionOptions
from embcache.engine.tables import Table
from embcache.kernels.optim import aggregate_grads
from embcache.kv.base import Store
from embcache.models.torch_optim import FusedOptimizerConventions

__all__ = [
    "OWNER_SALT",
    "CollectiveError",
    "ShardedCollection",
    "ShardedEmbeddingBagCollection",
    "ShardedKVClient",
    "kv_owner_of",
    "owner_of",
]


@dataclass
class _Request:
    """One cache's share of this rank's batch, as the requester reduces it (a `Share` of
    `engine.reduction`)."""

    inverse: torch.Tensor  # int64 [nnz] unique index of each value
    offsets: torch.Tensor  # int64 [F*B + 1]
    weights: torch.Tensor | None
    order: torch.Tensor  # int64 [U]: reply position -> unique index (sorted by owner, stable)
    position: torch.Tensor  # int64 [U]: unique index -> reply position
    counts: list[int]  # unique ids sent to each rank
    saved: Any = None  # what the reduction's backward needs (MAX pooling's argmax rows)
    cuts: list[int] | None = None  # where each lookup's values start (None: read them)


@dataclass
class _Owned:
    """One cache's share of the ids this rank received as their owner."""

    ids: torch.Tensor  # int64 [n] in the order received (by source rank)
    counts: list[int]  # how many came from each rank
    prepared: Prepared | None = None  # their unique ids (ascending) and slots


@dataclass
class _Exchange:
    """This rank's side of one lookup before the rows come back: its unique ids of every
    cache, concatenated, and per cache how it reduces what the owners send."""

    ids: torch.Tensor  # int64 [sum U]
    requests: list[_Request]


@dataclass
class _Prefetch:
    """A prefetch's exchange state (`Prefetched.payload`): issue number, this rank's side, and
    the ids it resolved as owner (their slots locked)."""

    seq: int
    exchange: _Exchange | None
    owned: list[_Owned]


@dataclass
class _Step:
    """A forward's exchanges, kept for its backward."""

    features: JaggedBatch  # the checked batch
    batch_size: int
    requests: list[_Request]
    owned: list[_Owned]
    batch: InFlight | None


def _one_source(counts: list[int]) -> bool:
    """Whether every id came from one rank: then they are that rank's unique ids of a cache,
    distinct and ascending, so the owner needs no dedup and no gradient sum."""
    return sum(1 for c in counts if c) <= 1


def _shard_cache_config(cache: CacheConfig | None, world_size: int) -> CacheConfig:
    """Each rank's cache config: capacity as given (rows per rank and cache), load_factor as a
    fraction of the rows a rank owns (about 1/world_size of the table; a dict by table name
    likewise, table by table), None: every row."""
    cache = cache or CacheConfig()
    lf = cache.load_factor
    if isinstance(lf, Mapping):
        return dataclasses.replace(cache, load_factor={k: v / world_size for k, v in lf.items()})
    if lf is not None:
        return dataclasses.replace(cache, load_factor=lf / world_size)
    return cache


class ShardedCollection(FusedOptimizerConventions, CachedCollectionInterface):
    """The rows of a collection's tables sharded over the ranks, each rank owning a shard:
    what `ShardedEmbeddingBagCollection` and `ShardedEmbeddingCollection` share. Its
    `ShardExchange` (``exchange``) makes the exchanges of lookups, prefetches, gradients and
    whole tables (the module docstring walks through them).

    A subclass gives ``forward`` its output: `_outputs` allocates a lookup's outputs and
    `_target` says where in them each cache's reduction writes (and, in the outputs'
    gradients, reads); `_run` makes the lookup. The arguments are
    `ShardedEmbeddingBagCollection`'s.
    """

    def __init__(
        self,
        tables: Sequence[Any],
        is_weighted: bool,
        options: CollectionOptions,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        comm = Comm(process_group)
        store = options.store
        if callable(store) and not isinstance(store, Store):
            options = dataclasses.replace(options, store=store(comm.rank))
        super().__init__()
        # Each rank's caches hold a share of the rows; the rows start as one process's would
        # (torchrec's draws when every row is cached): decided by the whole config.
        self._setup(
            tables, is_weighted, options, cache=_shard_cache_config(options.cache, comm.world_size)
        )
        # torchrec's ways train the rows as on one process (`models.torch_optim`): a torch
        # optimizer's step applies this rank's owned rows' gradients with the same row rule.
        self._setup_torch_training(options)
        self.rank, self.world_size = comm.rank, comm.world_size
        self.exchange = ShardExchange(
            comm, self.engines, self.tables, self.checked_input, self._outputs, self._target
        )

    # ------------------------------------------------------------------------------------------
    # the outputs (each collection's own)

    @abc.abstractmethod
    def _outputs(self, batch_size: int, requests: list[_Request]) -> tuple[torch.Tensor, ...]:
        """A lookup's outputs, allocated (the values `forward` returns, and what autograd
        gives their gradients for)."""

    @abc.abstractmethod
    def _target(
        self, gi: int, outputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Where cache ``gi``'s reduction writes in ``outputs`` (or reads in their gradients):
        ``(tensor, first column of each feature, columns[0] when they lie side by side)``."""

    # ------------------------------------------------------------------------------------------
    # the data path (`ShardExchange`)

    def _run(self, features: JaggedBatch | Any) -> tuple[tuple[torch.Tensor, ...], JaggedBatch]:
        """A forward's lookup (collective): its `_outputs` (one autograd node when gradients
        are on, `_ShardedStep`) and the checked batch."""
        if torch.is_grad_enabled():
            run = _ShardedStep(self.exchange, features)
            outs = lookup(self.grad_anchor, run)
            assert run.step is not None
            return outs, run.step.features
        outs, step = self.exchange.lookup(features, training=False)
        return outs, step.features

    def issue_fused_prefetch(self, features: JaggedBatch | Any) -> FusedPrefetchHandle:
        """Start a batch's lookup ahead of its forward and return at once (collective, on the
        prefetch worker and its own process group: every rank issues the same number of
        prefetches in the same order). The worker dedups, sends the ids to their owners, and
        each owner resolves and locks them in its cache (tier I/O included); the forward then
        only has the owners send their rows. A bad id raises here, and every other rank's
        prefetch fails (its forward then reads synchronously)."""
        return self.exchange.issue_prefetch(id(self), features)

    # ------------------------------------------------------------------------------------------
    # whole tables (collective reads, local writes), statistics

    def table_rows(self, table: str, chunk_rows: int = 1 << 16) -> torch.Tensor:
        """Every row ``[num_embeddings, dim + state_dim]`` of a table, gathered from the owners
        to every rank (collective). CPU float32."""
        return self.exchange.gather_table(self.store, table, chunk_rows)

    def write_table_rows(self, table: str, rows: torch.Tensor, columns: slice) -> None:
        """Overwrite ``columns`` of the rows this rank owns (``rows`` holds every row of the
        table, as on every rank); empties the table's cache. Not a collective."""
        self.exchange.write_owned(self.store, table, rows, columns)

    def cache_stats(self, all_ranks: bool = False) -> dict[str, float]:
        """This rank's cache counters (hits/misses count the unique ids it was asked for as
        owner); ``all_ranks=True`` sums them over the ranks (a collective)."""
        stats = super().cache_stats()
        return self.exchange.summed_stats(stats) if all_ranks else stats

    def comm_stats(self) -> dict[str, int]:
        """all_to_alls made and bytes this rank sent (``bytes_to_peers``: excluding the chunk
        to itself) since creation or `reset_comm_stats`, prefetches included."""
        return self.exchange.comm_stats()

    def reset_comm_stats(self) -> None:
        self.exchange.reset_comm_stats()


class ShardExchange:
    """One rank's side of a sharded collection's exchanges (the module docstring walks through
    them): as requester, its unique ids sent to their owners and the rows they send back
    reduced into the collection's outputs; as owner, the ids it receives resolved (and locked)
    in its caches, their rows sent back and their gradients summed into its trace; and the
    whole tables' collectives. The forward's collectives run on the collection's process
    group, the prefetch worker's on a group of their own (gloo and NCCL do not order the
    collectives of one group across threads).

    Args:
        comm: the collection's process group.
        engines: the collection's `EngineGroup` (this rank's caches, of the rows it owns).
        tables: the collection's tables, in order.
        checked_input: the collection's `CachedCollectionInterface.checked_input`.
        outputs, target: the collection's `ShardedCollection._outputs` and `_target`.
    """

    def __init__(
        self,
        comm: Comm,
        engines: EngineGroup,
        tables: Sequence[Table],
        checked_input: Callable[[Any], JaggedBatch],
        outputs: Callable[[int, list[_Request]], tuple[torch.Tensor, ...]],
        target: Callable[
            [int, tuple[torch.Tensor, ...]], tuple[torch.Tensor, torch.Tensor, int | None]
        ],
    ) -> None:
        self.comm = comm
        self.prefetch_comm = comm.new_comm()  # the prefetch worker's collectives
        self.rank, self.world_size = comm.rank, comm.world_size
        self.engines = engines
        self.device = engines.device
        self.fusion_k = engines.fusion_k
        self._checked_input = checked_input
        self._outputs = outputs
        self._target = target
        engine_of = {t.name: i for i, e in enumerate(engines.engines) for t in e.layout.tables}
        self._table_engine = torch.tensor([engine_of[t.name] for t in tables], device=self.device)

    def lookup(self, features: Any, training: bool) -> tuple[tuple[torch.Tensor, ...], _Step]:
        """The exchanges of one forward inside the engines' step protocol, as one process
        makes it (`EngineGroup.forward_shares`) but with the ranks' header between its phases:
        a training forward is opened (`EngineGroup.open_forward`: a refusal joins the header,
        so every rank raises), the prefetch taken, and once every rank agrees, the stale locks
        dropped (`EngineGroup.begin_batch`) and the owned shares recorded
        (`EngineGroup.start`). `_ShardedStep` claims the step around it."""
        error: BaseException | None = None
        mine: _Exchange | None = None
        prefetched: Prefetched | None = None
        try:
            if training:  # the stale locks are dropped once every rank agrees (below)
                self.engines.open_forward(release_stale=False)
            features = self._checked_input(features)
            prefetched = self.engines.take_prefetch(features)
            if prefetched is not None:
                mine = prefetched.payload.exchange
            else:
                mine = self._requester([engine.fuse(features) for engine in self.engines.engines])
        except Exception as e:
            error = e
            self.engines.prefetches.release_all()  # as one process does: its locks would stay
        ids = mine.ids if mine is not None else self._no_ids()
        owners = owner_of(ids, self.world_size)
        try:
            header = self.comm.handshake(
                torch.bincount(owners, minlength=self.world_size),
                OP_FORWARD,
                int(training),
                error,
                prefetch=prefetched.payload.seq if prefetched is not None else NO_PREFETCH,
            )
        except BaseException:
            if prefetched is not None:
                self._unlock(prefetched.payload.owned)
            raise
        assert mine is not None  # the header raised otherwise
        if training:
            self.engines.begin_batch()  # drops the locks of forwards never backpropagated
        if prefetched is not None and len(set(header.prefetch)) == 1:
            owned, error = prefetched.payload.owned, None  # every rank uses the same prefetch
        else:
            if prefetched is not None:  # another rank reads synchronously: so does this one
                self._unlock(prefetched.payload.owned)
            route = self.comm.send_ids(ids, owners, header.counts, OP_FORWARD)
            owned, error = self._serve(route, training)
        requests = mine.requests
        try:
            replies = [self._reply(gi, o, error) for gi, o in enumerate(owned)]
            if not training:
                self._unlock(owned)
            got = [
                self.comm.reply(r, o.counts, q.counts, error, "the forward's rows")
                for r, o, q in zip(replies, owned, requests, strict=True)
            ]
        except BaseException:
            self._unlock(owned)  # an owner failed: this forward holds no slot
            raise
        batch = self.engines.start([o.prepared for o in owned]) if training else None
        step = _Step(features, features.stride(), requests, owned, batch)
        return self._reduce(step, got), step

    def _requester(
        self, fused: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    ) -> _Exchange:
        """This rank's side of a lookup: per cache, its unique ids and where their rows will
        land in the owners' replies."""
        uniques, requests = [], []
        for engine, args in zip(self.engines.engines, fused, strict=True):
            p = engine.dedup(*args)
            owners = owner_of(p.unique, self.world_size)
            order = torch.argsort(owners, stable=True)
            position = torch.empty_like(order)
            position[order] = torch.arange(order.numel(), device=self.device)
            counts = torch.bincount(owners, minlength=self.world_size).tolist()
            requests.append(_Request(p.inverse, p.offsets, p.weights, order, position, counts))
            uniques.append(p.unique)
        return _Exchange(torch.cat(uniques) if uniques else self._no_ids(), requests)

    # ------------------------------------------------------------------------------------------
    # prefetch

    def issue_prefetch(self, owner_id: int, features: JaggedBatch | Any) -> FusedPrefetchHandle:
        """`ShardedCollection.issue_fused_prefetch` of the collection ``owner_id``: the
        refusal of a bad input still takes part in the peers' prefetch header (the refused
        job), then raises."""
        error: Exception | None = None
        fused = None
        try:
            batch = self._checked_input(features)
            fused = [engine.fuse(batch) for engine in self.engines.engines]
        except Exception as e:
            error = e
        job = functools.partial(self._prefetch, fused, error)
        if error is not None:
            self.engines.prefetches.issue_refused(job)  # the peers' prefetch needs its header
            raise error
        return self.engines.issue(owner_id, batch, job)

    def _prefetch(self, fused: list | None, error: Exception | None, seq: int) -> Prefetched:
        """Worker-thread body of `issue_fused_prefetch`: header, ids to owners, owner resolve
        (a failing owner keeps its error; its rank's forward then reads synchronously, and so
        do all the others)."""
        mine = None
        if error is None:
            try:
                mine = self._requester(fused)
            except Exception as e:
                error = e
        ids = mine.ids if mine is not None else self._no_ids()
        route = self.prefetch_comm.route(
            ids, owner_of(ids, self.world_size), OP_PREFETCH, seq, error
        )
        owned, failure = self._serve(route, lock=True)
        payload = _Prefetch(seq, mine, owned)
        if failure is not None:
            return Prefetched([], payload, failure)
        return Prefetched([o.prepared for o in owned], payload)

    def _no_ids(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _serve(self, route: Route, lock: bool) -> tuple[list[_Owned], Exception | None]:
        """Resolve the received ids in this rank's caches (the owner's side of a forward)."""
        W = self.world_size
        recv_ids = route.recv_ids
        source = torch.repeat_interleave(
            torch.arange(W, device=self.device), torch.tensor(route.recv_counts, device=self.device)
        )
        engines = self.engines.engines
        engine_of = self._table_engine[recv_ids >> self.fusion_k]
        owned = []
        for i in range(len(engines)):
            mine = engine_of == i
            counts = torch.bincount(source[mine], minlength=W).tolist()
            owned.append(_Owned(recv_ids[mine], counts))
        try:
            for engine, o in zip(engines, owned, strict=True):
                if _one_source(o.counts):  # one requester's unique ids: distinct, ascending
                    o.prepared = engine.resolve(o.ids, lock=lock)
                else:
                    p = engine.dedup(o.ids, o.ids[:0], None)
                    o.prepared = engine.resolve(p.unique, lock=lock)
                    o.prepared.inverse = p.inverse
        except Exception as e:
            self._unlock(owned)
            return owned, e
        return owned, None

    def _reply(self, gi: int, o: _Owned, error: BaseException | None) -> torch.Tensor:
        cache = self.engines.engines[gi].cache
        if error is not None:
            return with_status(None, self._no_ids(), o.counts, cache.dim)
        with cache.lock:
            return with_status(
                cache.weights, o.prepared.slots[o.prepared.inverse], o.counts, cache.dim
            )

    def _unlock(self, owned: list[_Owned]) -> None:
        for engine, o in zip(self.engines.engines, owned, strict=True):
            if o.prepared is not None:
                engine.release(o.prepared)
            engine.cache.release()

    def _reduce(
        self, step: _Step, got: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, ...]:
        """Pool this rank's bags (or gather its values' rows) straight from the buffers its
        owners sent (one per cache) into the step's `_outputs`."""
        B = step.batch_size
        outs = self._outputs(B, step.requests)
        for gi, (engine, req, (rows, data)) in enumerate(
            zip(self.engines.engines, step.requests, got, strict=True)
        ):
            slots = data[req.position]  # where each unique id's row landed in `rows`
            out, cols, start = self._target(gi, outs)
            req.saved = engine.reduction.forward(rows, slots, req, B, out, cols, start)
        return outs

    def backward(self, step: _Step, grad_outs: tuple[torch.Tensor, ...]) -> None:
        """Gradient rows per unique id -> their owners, who sum them and record the trace."""
        B = step.batch_size
        grad_outs = tuple(g.to(torch.float32).contiguous() for g in grad_outs)
        received = []
        for gi, (engine, req, o) in enumerate(
            zip(self.engines.engines, step.requests, step.owned, strict=True)
        ):
            grad_out, cols, start = self._target(gi, grad_outs)
            grad = engine.reduction.backward(grad_out, req.order.numel(), req, B, cols, start,
                                             req.saved)  # fmt: skip
            received.append(
                self.comm.exchange(grad[req.order], req.counts, o.counts, "the gradients")
            )
        # Every exchange first: an error below (a NaN refused by update_in_backward) must not
        # leave a peer waiting in one.
        summed = [
            grads if _one_source(o.counts) else aggregate_grads(o.ids, grads)[1]
            for o, grads in zip(step.owned, received, strict=True)
        ]
        self.engines.record_backward(step.batch, summed)

    # ------------------------------------------------------------------------------------------
    # whole tables, statistics

    def _owned_ids(self, table: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids in [lo, hi), their owners)`` of a table."""
        ids = torch.arange(lo, hi)
        fused = ids | (self.engines.table_index[table] << self.fusion_k)
        return ids, owner_of(fused, self.world_size)

    def gather_table(self, store: Store, table: str, chunk_rows: int) -> torch.Tensor:
        """Every row ``[num_embeddings, dim + state_dim]`` of a table, gathered from the owners
        to every rank (collective): `ShardedCollection.table_rows`."""
        self.engines.engine_of(table).cache.flush()
        spec = store.table_spec(table)
        out = torch.empty(spec.num_embeddings, spec.row_width)
        W = self.world_size
        for lo in range(0, spec.num_embeddings, chunk_rows):
            ids, owners = self._owned_ids(table, lo, min(lo + chunk_rows, spec.num_embeddings))
            counts = torch.bincount(owners, minlength=W)
            mine = store.read(table, ids[owners == self.rank])  # creates no row
            padded = torch.zeros(int(counts.max()), spec.row_width)
            padded[: mine.shape[0]] = mine
            parts = [torch.empty_like(padded, device=self.comm.device) for _ in range(W)]
            self.comm.run(
                f"all_gather of table_rows({table!r})",
                lambda parts=parts, padded=padded: dist.all_gather(
                    parts, padded.to(self.comm.device), group=self.comm.group
                ),
            )
            rows = torch.cat([p[:c].cpu() for p, c in zip(parts, counts.tolist(), strict=True)])
            out[ids[torch.argsort(owners, stable=True)]] = rows
        return out

    def write_owned(self, store: Store, table: str, rows: torch.Tensor, columns: slice) -> None:
        """Overwrite ``columns`` of the rows this rank owns (``rows`` holds every row of the
        table, as on every rank); empties the table's cache. Not a collective."""
        if self.engines.inflight or self.engines.has_gradients:
            raise RuntimeError("cannot overwrite tables while a batch is in flight")
        self.engines.engine_of(table).cache.invalidate()
        self.engines.generation += 1
        n = store.table_spec(table).num_embeddings
        rows = rows.detach().to(torch.float32).cpu()
        chunk = 1 << 16
        for lo in range(0, n, chunk):
            ids, owners = self._owned_ids(table, lo, min(lo + chunk, n))
            mine = ids[owners == self.rank]
            current = store.get(table, mine)
            current[:, columns] = rows[mine]
            store.put(table, mine, current)

    def summed_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """This rank's cache counters summed over the ranks (a collective), with the hit
        rate."""
        keys = ("hits", "misses", "evictions", "writebacks")
        total = torch.tensor([stats[k] for k in keys], device=self.comm.device)
        self.comm.run(
            "all_reduce of cache_stats", lambda: dist.all_reduce(total, group=self.comm.group)
        )
        summed: dict[str, float] = dict(zip(keys, (int(v) for v in total.tolist()), strict=True))
        looked_up = summed["hits"] + summed["misses"]
        summed["hit_rate"] = summed["hits"] / looked_up if looked_up else 0.0
        return summed

    def comm_stats(self) -> dict[str, int]:
        """`ShardedCollection.comm_stats`: the forward's and the prefetch worker's."""
        forward, prefetch = self.comm.stats(), self.prefetch_comm.stats()
        return {k: forward[k] + prefetch[k] for k in forward}

    def reset_comm_stats(self) -> None:
        self.comm.reset_stats()
        self.prefetch_comm.reset_stats()


class ShardedEmbeddingBagCollection(ShardedCollection):
    """`CachedEmbeddingBagCollection` over several ranks, each owning a shard of the rows.

    Same input, output, keys and values as one `CachedEmbeddingBagCollection` given the same
    tables, seed and batch; every rank passes its own batch (any size, empty included) and gets
    its own pooled output. Train it with the ordinary sparse optimizers
    (``SparseAdaGrad([ebc], lr=...)``); ``step()`` updates, on each rank, the rows it owns.
    See the module docstring for the exchanges (the owner hash: `embcache.distributed.exchange`).

    Takes every argument `CachedEmbeddingBagCollection` takes, with the same meaning and
    defaults, plus ``process_group``. Built without a ``seed`` after the same
    ``torch.manual_seed`` on every rank, its rows start where one process's collection (and
    torchrec's ``EmbeddingBagCollection``) start. Besides embcache's optimizers, the torchrec
    ways train it as on one process: a torch optimizer over ``parameters()`` (``grad_anchor``;
    its step updates, on each rank, the rows it owns with the same row rule, and refuses
    optimizers that have none) or ``optimizer_type=`` (applied inside backward). Gradient
    utilities (``clip_grad_norm_``, ``GradScaler``) see ``grad_anchor.grad``, the gradient of the
    rows this rank owns, not the global one.

    Args:
        tables, is_weighted, enable_fusion, fusion_k, update_in_backward, accumulate_grads, lr,
            seed, optimizer_type, optimizer_kwargs: as in `CachedEmbeddingBagCollection`
            (every rank must give the same).
        location, allow_unsharded_replicas: accepted for `CachedEmbeddingBagCollection`'s
            signature; the cache decides placement, and a sharded collection is no replica
            (it ignores ``allow_unsharded_replicas``).
        cache: per rank: ``capacity`` is the rows of each of this rank's caches;
            ``load_factor`` a fraction of the rows this rank owns (about ``1/world_size`` of the
            tables); None keeps every owned row resident (direct-mapped slots sized by the whole
            table, of which a rank fills only its share: give a load_factor to bound memory).
        store: this rank's tier: a `Store`, a URL, None (an in-process `HostKV`), or a callable
            ``store(rank) -> Store | URL``. A shared store (one Redis) also works: each rank
            writes only the rows it owns; give every rank the same lease owner
            (``open_store(url, owner=token)``, as ``embcache train --nproc`` does), since a
            table is otherwise leased to one job. Not ``?shared=1``: that opens the tables
            read-only (no lease, every write refused), for a reader beside the job.
        device: where this rank's caches and outputs live (``cuda`` with NCCL or gloo).
        process_group: the ranks sharing the tables (None: the default group).
        options: the options as one `CollectionOptions`, as `CachedEmbeddingBagCollection`
            takes it (its ``store`` may be the callable above).
    """

    def __init__(
        self,
        tables: Sequence[Any],
        is_weighted: bool = False,
        cache: CacheConfig | None = None,
        store: Store | str | Callable[[int], Store | str] | None = None,
        device: torch.device | str | None = None,
        enable_fusion: bool = True,
        fusion_k: int = FUSION_K,
        update_in_backward: bool = False,
        accumulate_grads: bool = False,
        lr: float | None = None,
        seed: int | None = None,
        optimizer_type: type | None = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        location: Any = None,
        allow_unsharded_replicas: bool = False,
        process_group: dist.ProcessGroup | None = None,
        *,
        options: CollectionOptions | None = None,
    ) -> None:
        options = CollectionOptions.given(options, locals())  # the keywords as called
        del location  # see the docstring
        super().__init__(tables, is_weighted, options, process_group)
        column, col = {}, 0
        for f, d in zip(self.output_keys, self.output_dims, strict=True):
            column[f], col = col, col + d
        self._num_columns = col
        self._feature_cols = [
            torch.tensor([column[k] for k in e.layout.keys], device=self.device)
            for e in self.engines.engines
        ]

    def forward(self, features: JaggedBatch | Any) -> Any:
        """This rank's pooled embeddings ``[B, sum of dims]`` (collective): a torchrec
        `KeyedTensor` for a KJT input, a `PooledEmbeddings` for a `JaggedBatch`."""
        (values,), _ = self._run(features)
        return pooled_output(features, self.output_keys, self.output_dims, values)

    def _outputs(self, batch_size: int, requests: list[_Request]) -> tuple[torch.Tensor, ...]:
        """One ``[B, sum of dims]`` output: every cache pools its features into their columns."""
        return (torch.empty(batch_size, self._num_columns, device=self.device),)

    def _target(
        self, gi: int, outputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        return outputs[0], self._feature_cols[gi], None


class _ShardedStep:
    """The exchanges and the reductions of one training forward, as
    `engine.lookup.CachedLookup` runs it; backward sends the gradient rows to their owners. One
    step for all caches, so that a backward makes its exchanges in one place, in cache order,
    on every rank. The anchor gets its (zero-size) gradient, so its post-accumulate hook runs
    and a torch optimizer over ``parameters()`` sees it used."""

    anchor_grad = True

    def __init__(self, exchange: ShardExchange, features: Any) -> None:
        self.exchange = exchange
        self.features = features
        self.step: _Step | None = None

    def forward(self) -> tuple[torch.Tensor, ...]:
        exchange = self.exchange
        # The step is this thread's from here (`embcache.engine.claim`): another thread's
        # forward raises before its handshake, so the peers meet this thread's collectives.
        with exchange.engines.claimed("training forward"):
            outs, self.step = exchange.lookup(self.features, training=True)
        return outs

    def backward(self, grads: tuple[torch.Tensor, ...]) -> None:
        assert self.step is not None
        self.exchange.backward(self.step, grads)
