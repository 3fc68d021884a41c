"""How fast is a whole embedding training step through the cache, against torchrec and FBGEMM?

Question: time per training step (forward + backward + sparse step) on the same batches, side
by side in one process, for four workloads (Zipf(1.05) ids):

* ``long_bags``: 8 tables x 200,000 rows x dim 64, batch 2048, 20 ids per bag;
* ``batch256``: the same tables at batch 256;
* ``criteo``: 26 tables of the Criteo Kaggle sizes x 0.01 (337,641 rows), dim 16, batch 2048,
  one id per bag (`embcache.data.synthetic`);
* ``sequence``: unpooled lookups (one row per id, for sequence models): 4 tables x 50,000 rows
  x dim 64, one history feature each, batch 256 users whose histories hold 0-50 ids (lengths
  uniform; ~26k ids a batch).

The bag workloads have two named baselines, one per optimizer family; each of their rows is a
ratio to both:

* ``torchrec`` (baseline of AdaGrad): ``torchrec.EmbeddingBagCollection`` with each of its
  ``nn.EmbeddingBag``s switched to ``sparse=True`` and ``torch.optim.Adagrad`` on the sparse
  gradients (torchrec builds them with ``sparse=False``, whose table-sized gradients are far
  slower on a CPU; flipping the flag is the one-line way to row-sparse gradients).
* ``fbgemm_rowwise`` (baseline of row-wise AdaGrad): FBGEMM's
  ``SplitTableBatchedEmbeddingBagsCodegen`` on the CPU with its EXACT_ROWWISE_ADAGRAD applied
  inside backward: the fastest CPU training step we know of.
* ``fbgemm_adagrad``: the same TBE with EXACT_ADAGRAD.
* ``embcache_100`` / ``embcache_10``: `CachedEmbeddingBagCollection` with the cache holding all
  rows / 10% of them (LRU), `SparseAdaGrad`, `HostKV` behind it; ``embcache_100_rowwise`` /
  ``embcache_10_rowwise``: the same with `SparseRowWiseAdaGrad`. Each step is the plain loop
  (forward, backward, ``opt.step()``), one thread.
* ``embcache_10_prefetch`` / ``embcache_10_rowwise_prefetch``: the 10% caches trained through
  `TrainPipeline(prefetch=True)`, whose worker thread resolves batch i+1 (victim choice, tier
  reads and write-backs) on the machine's second core while batch i trains. The baselines get
  no faster with a second thread (``--threads 2``), so they keep one. A pipeline starts again
  each round, and its first batch is resolved without overlap: rounds are 12 steps long.
* ``embcache_10_rowwise_lfu`` / ``embcache_10_rowwise_lfu_prefetch``: the row-wise 10% caches
  with LFU eviction (exact per-row counts, the compiled plan) instead of LRU, in the plain loop
  and through the pipeline: fewer misses, for a count per row read and written each step.

The ``sequence`` workload has one baseline, and its rows' ``vs_torchrec`` is the ratio to it
(``vs_fbgemm_rowwise`` stays empty):

* ``torchrec_ec``: ``torchrec.EmbeddingCollection`` with its ``nn.Embedding``s switched to
  ``sparse=True`` and ``torch.optim.Adagrad`` on the sparse gradients (as ``torchrec`` above);
  ``torchrec_ec_dense``: as torchrec builds it, table-sized dense gradients, for scale.
* ``embcache_ec_100`` / ``embcache_ec_10``: `CachedEmbeddingCollection` with every row cached
  (``cache=None``) / 10% of them (LRU), `SparseAdaGrad`; ``embcache_ec_100_fused`` /
  ``embcache_ec_10_fused``: the same with ``optimizer_type=torch.optim.Adagrad``, the update
  made inside backward (no ``step()``).

Every impl trains on the same loss: its output times a fixed random weight, summed (`loss_of`).

All start from the same weights and use lr 0.05, eps 1e-10, so after the timed steps each family
must hold the same weights: the script prints the largest relative difference of a probe batch's
output against its family's baseline, and exits with an error when one is past float32
rounding (`PROBE_TOLERANCE`); on ``sequence`` it also compares every row of the tables with
``torchrec_ec``'s (``rows_max_diff``: at most `ROWS_TOLERANCE`, 1e-5, absolute). The targets
(docs/design.md, "Targets"): whole table ``embcache_100_rowwise`` <= 1.2x ``fbgemm_rowwise``
and ``embcache_100`` <= 0.9x ``torchrec``; 10% cached ``embcache_10`` and
``embcache_10_prefetch`` <= 1.3x ``torchrec`` (``long_bags`` and ``batch256``) and the row-wise
10% caches (LRU or LFU, plain or prefetching) <= 2x ``fbgemm_rowwise``; ``sequence`` has none
yet. `bench_step_profile.py` shows where the time of embcache's step goes, per phase.

Impls take turns in rounds of steps; ``ms_per_step`` is an impl's median over the
rounds, and a ratio is the median over rounds of the two impls' times in the same round (this
shared machine's speed drifts between rounds, by up to 2x within minutes, and a ratio of two
medians would mix rounds run at different speeds). The quartiles of those per-round ratios
(``vs_*_q1``, ``vs_*_q3``) say how far the rounds spread; each target line prints them.

glibc's malloc is told to keep freed memory for the next step (`_common.keep_freed_memory`, as
a CPU training job does with jemalloc or tcmalloc), for every impl alike.

``--quick`` is a smoke test, too small for conclusions: 2 tables x 20,000 rows x dim 32 (batch
256, and 64 for ``batch256``), Criteo sizes x 0.001 at batch 256, ``sequence`` 2 x 10,000 rows
x dim 32 at batch 32; 3 rounds of 2 steps after 2 to 5 warm-up batches.

Prints a table; writes ``e2e.csv`` and ``e2e.png`` (one panel per workload, each impl's time
over its family's baseline). ``--update-results`` with a subset of ``--workloads`` replaces
those workloads' committed rows and keeps the others'.

    python benchmarks/bench_e2e.py [--quick] [--threads N] [--workloads a,b] [--out PATH]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import (
    ZipfIds,
    add_output_options,
    keep_freed_memory,
    parse_args,
    pyplot,
    quick_note,
    run_header,
    set_threads,
    write_csv,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)

import embcache
from embcache.data.synthetic import SyntheticConfig, SyntheticCriteo

LR, EPS = 0.05, 1e-10
# Largest relative difference of a probe's output from its family's baseline that is float32
# rounding (about 4e-7 here); past it an impl trained other weights, and its times are no
# comparison: the script says so and exits with an error.
PROBE_TOLERANCE = 1e-4
# Largest absolute difference of any table row from torchrec_ec's (``sequence``), likewise.
ROWS_TOLERANCE = 1e-5
ADAGRAD_BASE, ROWWISE_BASE, SEQUENCE_BASE = "torchrec", "fbgemm_rowwise", "torchrec_ec"
FAMILY = {
    "torchrec": ADAGRAD_BASE,
    "fbgemm_adagrad": ADAGRAD_BASE,
    "embcache_100": ADAGRAD_BASE,
    "embcache_10": ADAGRAD_BASE,
    "fbgemm_rowwise": ROWWISE_BASE,
    "embcache_100_rowwise": ROWWISE_BASE,
    "embcache_10_rowwise": ROWWISE_BASE,
    "embcache_10_prefetch": ADAGRAD_BASE,
    "embcache_10_rowwise_prefetch": ROWWISE_BASE,
    "embcache_10_rowwise_lfu": ROWWISE_BASE,
    "embcache_10_rowwise_lfu_prefetch": ROWWISE_BASE,
    "torchrec_ec": SEQUENCE_BASE,
    "torchrec_ec_dense": SEQUENCE_BASE,
    "embcache_ec_100": SEQUENCE_BASE,
    "embcache_ec_10": SEQUENCE_BASE,
    "embcache_ec_100_fused": SEQUENCE_BASE,
    "embcache_ec_10_fused": SEQUENCE_BASE,
}
# (impl, baseline, at most, workloads it applies to; None: all): docs/design.md, "Targets", CPU.
TARGETS = [
    ("embcache_100_rowwise", ROWWISE_BASE, 1.2, None),
    ("embcache_100", ADAGRAD_BASE, 0.9, None),
    ("embcache_10", ADAGRAD_BASE, 1.3, ("long_bags", "batch256")),
    ("embcache_10_rowwise", ROWWISE_BASE, 2.0, None),
    ("embcache_10_prefetch", ADAGRAD_BASE, 1.3, ("long_bags", "batch256")),
    ("embcache_10_rowwise_prefetch", ROWWISE_BASE, 2.0, None),
    ("embcache_10_rowwise_lfu", ROWWISE_BASE, 2.0, None),
    ("embcache_10_rowwise_lfu_prefetch", ROWWISE_BASE, 2.0, None),
]


@dataclass
class Row:
    """One impl on one workload. ``vs_torchrec`` is against the workload's torchrec baseline
    (``torchrec_ec`` on ``sequence``); ``vs_fbgemm_rowwise`` and its quartiles are None on
    ``sequence``, ``rows_max_diff`` on the bag workloads. ``ids_per_bag`` is a sequence's mean
    history length."""

    workload: str
    rows: int
    dim: int
    batch: int
    ids_per_bag: int
    impl: str
    ms_per_step: float
    samples_per_s: float
    vs_torchrec: float
    vs_fbgemm_rowwise: float | None
    hit_rate: float | None
    probe_rel_diff: float
    # The quartiles of the per-round ratios to each baseline: how far the rounds spread.
    vs_torchrec_q1: float
    vs_torchrec_q3: float
    vs_fbgemm_rowwise_q1: float | None
    vs_fbgemm_rowwise_q3: float | None
    rows_max_diff: float | None = None


@dataclass
class Workload:
    name: str
    tables: list[EmbeddingBagConfig] | list[EmbeddingConfig]
    batches: list[KeyedJaggedTensor]
    probe: KeyedJaggedTensor
    batch: int
    ids_per_bag: int
    pooled: bool = True  # False: one row per id (`sequence`)


@dataclass(frozen=True)
class Sizes:
    """The workloads' sizes and the steps each impl runs."""

    bag_tables: int  # long_bags and batch256
    bag_rows: int  # per table
    bag_dim: int
    bag_ids: int  # per bag
    long_batch: int  # long_bags
    short_batch: int  # batch256
    criteo_scale: float  # of the Criteo Kaggle cardinalities
    criteo_batch: int
    seq_tables: int
    seq_rows: int
    seq_dim: int
    seq_batch: int
    seq_longest: int  # most ids in a history
    warmup: int  # at least this many warm-up batches,
    fill: int  # up to this many more until the caches are full (`bench`)
    rounds: int
    per_round: int  # steps

    @property
    def batches(self) -> int:
        return self.warmup + self.fill + self.rounds * self.per_round


FULL = Sizes(8, 200_000, 64, 20, 2048, 256, 0.01, 2048, 4, 50_000, 64, 256, 50, 5, 30, 8, 12)
# --quick: a smoke test of the script (every impl, workload, check and plot), too small for
# conclusions; the full sizes took 9 GB.
QUICK = Sizes(2, 20_000, 32, 20, 256, 64, 0.001, 256, 2, 10_000, 32, 32, 50, 2, 3, 3, 2)


def long_bags(name: str, batch: int, n: int, sizes: Sizes) -> Workload:
    """``n`` batches (and a probe) of bags of Zipf(1.05) ids (20 ids, 8 tables of 200k rows)."""
    tables_n, rows, dim, bag = sizes.bag_tables, sizes.bag_rows, sizes.bag_dim, sizes.bag_ids
    gen = torch.Generator().manual_seed(0)
    zipf = [ZipfIds(rows, 1.05, gen) for _ in range(tables_n)]
    keys = [f"f{i}" for i in range(tables_n)]
    lengths = torch.full((tables_n * batch,), bag, dtype=torch.int64)

    def one() -> KeyedJaggedTensor:
        values = torch.cat([z.sample(batch * bag, gen) for z in zipf])
        return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                           feature_names=[k])
        for i, k in enumerate(keys)
    ]  # fmt: skip
    return Workload(name, tables, [one() for _ in range(n)], one(), batch, bag)


def criteo(n: int, sizes: Sizes) -> Workload:
    batch = sizes.criteo_batch
    data = SyntheticCriteo(
        SyntheticConfig(scale=sizes.criteo_scale, batch_size=batch, zipf=1.05, seed=0)
    )
    batches = [data.batch(i).sparse_features.to_kjt() for i in range(n)]
    probe = data.batch(0, split="eval").sparse_features.to_kjt()
    tables = [
        EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim,
                           num_embeddings=t.num_embeddings, feature_names=t.feature_names)
        for t in data.tables(16)
    ]  # fmt: skip
    return Workload("criteo", tables, batches, probe, batch, 1)


def sequence(n: int, sizes: Sizes) -> Workload:
    """``n`` batches (and a probe) of user histories, 0-50 Zipf(1.05) ids each (uniform
    lengths), one feature per table."""
    tables_n, rows, dim = sizes.seq_tables, sizes.seq_rows, sizes.seq_dim
    batch, longest = sizes.seq_batch, sizes.seq_longest
    gen = torch.Generator().manual_seed(0)
    zipf = [ZipfIds(rows, 1.05, gen) for _ in range(tables_n)]
    keys = [f"f{i}" for i in range(tables_n)]

    def one() -> KeyedJaggedTensor:
        lengths = torch.randint(0, longest + 1, (tables_n * batch,), generator=gen)
        counts = lengths.view(tables_n, batch).sum(1).tolist()
        values = torch.cat([z.sample(c, gen) for z, c in zip(zipf, counts, strict=True)])
        return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)

    tables = [
        EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[k])
        for i, k in enumerate(keys)
    ]
    batches = [one() for _ in range(n)]
    mean = sum(b.values().numel() for b in batches) / (n * tables_n * batch)
    return Workload("sequence", tables, batches, one(), batch, round(mean), pooled=False)


def loss_of(out: Any, coeff: torch.Tensor) -> torch.Tensor:
    """The output times ``coeff``, summed. A bag collection's ``[B, width]`` output takes all
    of ``coeff``; each key's ``[n, dim]`` rows of a sequence collection's output the first
    ``n`` rows (not concatenated first, which would add a copy to every impl's step)."""
    if isinstance(out, dict):
        return sum((jt.values() * coeff[: jt.values().shape[0]]).sum() for jt in out.values())
    return (out.values() * coeff).sum()


def output_of(out: Any) -> torch.Tensor:
    """The output as one tensor, for the probe: pooled ``[B, width]`` or every key's rows."""
    if isinstance(out, dict):
        return torch.cat([jt.values() for jt in out.values()])
    return out.values()


class Impl:
    """One way of training the tables: ``step(kjt, coeff)`` runs forward, backward and the
    update; ``run(kjts, coeff)`` a round of steps (``step`` on each, or ``run_steps``: a
    pipeline over them); ``probe(kjt)`` returns the output without training (`output_of`);
    ``weights()`` the tables' weights by state_dict key (compared on ``sequence``)."""

    def __init__(
        self,
        name: str,
        step: Callable[[KeyedJaggedTensor, torch.Tensor], None],
        probe: Callable[[KeyedJaggedTensor], torch.Tensor],
        hit_rate: Callable[[], float] | None = None,
        filled: Callable[[], bool] | None = None,
        run_steps: Callable[[list[KeyedJaggedTensor], torch.Tensor], None] | None = None,
        weights: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.name, self.step, self.probe, self.hit_rate = name, step, probe, hit_rate
        self.weights = weights
        self.filled = filled  # whether its caches hold as many rows as they can (steady state)
        self._run_steps = run_steps

    def run(self, kjts: list[KeyedJaggedTensor], coeff: torch.Tensor) -> None:
        if self._run_steps is not None:
            self._run_steps(kjts, coeff)
            return
        for kjt in kjts:
            self.step(kjt, coeff)


def initial_weights(collection: type, tables: list) -> dict[str, torch.Tensor]:
    """The state_dict of a torchrec ``collection`` of ``tables`` built after seed 0, which
    every impl of the workload loads."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(0)  # torchrec draws its initial weights from the global generator
    reference = collection(tables=tables, device=torch.device("cpu"))
    torch.random.set_rng_state(gen_state)
    return {k: v.detach().clone() for k, v in reference.state_dict().items()}


def build_impls(w: Workload) -> list[Impl]:
    if not w.pooled:
        return build_sequence_impls(w.tables)
    tables = w.tables
    initial = initial_weights(EmbeddingBagCollection, tables)
    impls: list[Impl] = [_torchrec_impl(tables, initial)]
    for name, optim in (
        ("fbgemm_rowwise", EmbOptimType.EXACT_ROWWISE_ADAGRAD),
        ("fbgemm_adagrad", EmbOptimType.EXACT_ADAGRAD),
    ):
        impls.append(_tbe_impl(name, optim, tables, initial))

    for name, load_factor, optim in (
        ("embcache_100", 1.0, embcache.SparseAdaGrad),
        ("embcache_10", 0.1, embcache.SparseAdaGrad),
        ("embcache_100_rowwise", 1.0, embcache.SparseRowWiseAdaGrad),
        ("embcache_10_rowwise", 0.1, embcache.SparseRowWiseAdaGrad),
        ("embcache_10_prefetch", 0.1, embcache.SparseAdaGrad),
        ("embcache_10_rowwise_prefetch", 0.1, embcache.SparseRowWiseAdaGrad),
        ("embcache_10_rowwise_lfu", 0.1, embcache.SparseRowWiseAdaGrad),
        ("embcache_10_rowwise_lfu_prefetch", 0.1, embcache.SparseRowWiseAdaGrad),
    ):
        policy = "lfu" if "_lfu" in name else "lru"
        cached = embcache.CachedEmbeddingBagCollection(
            tables, cache=embcache.CacheConfig(load_factor=load_factor, policy=policy), seed=0
        )
        cached.load_state_dict(initial)
        opt = optim([cached], lr=LR, eps=EPS)
        impls.append(_embcache_impl(name, cached, opt, pipelined=name.endswith("_prefetch")))
    return impls


def build_sequence_impls(tables: list[EmbeddingConfig]) -> list[Impl]:
    initial = initial_weights(EmbeddingCollection, tables)
    impls = [_torchrec_ec_impl(name, tables, initial, sparse=name == SEQUENCE_BASE)
             for name in (SEQUENCE_BASE, "torchrec_ec_dense")]  # fmt: skip
    fused = {"optimizer_type": torch.optim.Adagrad, "optimizer_kwargs": {"lr": LR, "eps": EPS}}
    for name, cache in (
        ("embcache_ec_100", None),
        ("embcache_ec_10", embcache.CacheConfig(load_factor=0.1)),
        ("embcache_ec_100_fused", None),
        ("embcache_ec_10_fused", embcache.CacheConfig(load_factor=0.1)),
    ):
        kwargs = fused if name.endswith("_fused") else {}
        ec = embcache.CachedEmbeddingCollection(tables, cache=cache, seed=0, **kwargs)
        ec.load_state_dict(initial)
        opt = None if kwargs else embcache.SparseAdaGrad([ec], lr=LR, eps=EPS)
        impls.append(_embcache_impl(name, ec, opt))
    return impls


def _torchrec_ec_impl(name: str, tables: list[EmbeddingConfig], initial, sparse: bool) -> Impl:
    ec = EmbeddingCollection(tables=tables, device=torch.device("cpu"))
    ec.load_state_dict(initial)
    for table in ec.embeddings.values():
        table.sparse = sparse
    opt = torch.optim.Adagrad(ec.parameters(), lr=LR, eps=EPS)

    def step(kjt: KeyedJaggedTensor, coeff: torch.Tensor) -> None:
        loss_of(ec(kjt), coeff).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def probe(kjt: KeyedJaggedTensor) -> torch.Tensor:
        with torch.no_grad():
            return output_of(ec(kjt))

    return Impl(name, step, probe, weights=ec.state_dict)


def _torchrec_impl(tables: list[EmbeddingBagConfig], initial) -> Impl:
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    ebc.load_state_dict(initial)
    for bag in ebc.embedding_bags.values():
        bag.sparse = True
    opt = torch.optim.Adagrad(ebc.parameters(), lr=LR, eps=EPS)

    def step(kjt: KeyedJaggedTensor, coeff: torch.Tensor) -> None:
        (ebc(kjt).values() * coeff).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def probe(kjt: KeyedJaggedTensor) -> torch.Tensor:
        with torch.no_grad():
            return ebc(kjt).values()

    return Impl("torchrec", step, probe)


def _tbe_impl(name: str, optim: EmbOptimType, tables, initial) -> Impl:
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [
            (t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
            for t in tables
        ],
        optimizer=optim,
        learning_rate=LR,
        eps=EPS,
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        for t, w in zip(tables, tbe.split_embedding_weights(), strict=True):
            w.copy_(initial[f"embedding_bags.{t.name}.weight"])

    def step(kjt: KeyedJaggedTensor, coeff: torch.Tensor) -> None:
        (tbe(kjt.values(), kjt.offsets()) * coeff).sum().backward()

    def probe(kjt: KeyedJaggedTensor) -> torch.Tensor:
        with torch.no_grad():
            return tbe(kjt.values(), kjt.offsets())

    return Impl(name, step, probe)


def _embcache_impl(name: str, ebc, opt, pipelined: bool = False) -> Impl:
    """A cached collection (bags or sequences) and its sparse optimizer (None: fused into
    backward)."""

    def step(kjt: KeyedJaggedTensor, coeff: torch.Tensor) -> None:
        loss_of(ebc(kjt), coeff).backward()
        if opt is not None:
            opt.step()

    run_steps = None
    if pipelined:
        weighting: list[torch.Tensor] = []  # the round's coeff, for the pipeline's loss
        pipe = embcache.TrainPipeline(
            ebc, opt, None, features=lambda kjt: kjt, prefetch=True,
            loss=lambda model, kjt: loss_of(model(kjt), weighting[0]),
        )  # fmt: skip

        def run_steps(kjts: list[KeyedJaggedTensor], coeff: torch.Tensor) -> None:
            weighting[:] = [coeff]
            pipe.run(kjts)
            # The last prefetch's write-back may still be queued on the worker: made here, in
            # this impl's time, not in the next impl's.
            for cache in ebc.caches():
                cache.write_deferred()

    def probe(kjt: KeyedJaggedTensor) -> torch.Tensor:
        with torch.no_grad():
            return output_of(ebc(kjt))

    def filled() -> bool:
        # Every slot holds a row: each miss now evicts (and writes back) one.
        return all(bool((c.slot_keys[: c.num_slots] >= 0).all()) for c in ebc.caches())

    def hit_rate() -> float:
        return ebc.cache_stats()["hit_rate"]

    return Impl(name, step, probe, hit_rate, filled, run_steps, ebc.state_dict)


def bench(w: Workload, warmup: int, rounds: int, per_round: int) -> list[Row]:
    """Time every impl on the same batches, after a warm-up of at least ``warmup`` batches
    that lasts until every cache is full (a cache still filling evicts and writes back less
    than it will: its steps would look faster than they are), at most all the batches the
    rounds leave."""
    for kjt in [*w.batches, w.probe]:
        kjt.offsets()  # computed once here, not inside anyone's timed step
    if w.pooled:
        shape = (w.batch, sum(t.embedding_dim * len(t.feature_names) for t in w.tables))
    else:  # as many rows as the most values of a key in a batch (`loss_of`)
        most_values = max(n for kjt in [*w.batches, w.probe] for n in kjt.length_per_key())
        shape = (most_values, w.tables[0].embedding_dim)
    coeff = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) / w.batch
    impls = build_impls(w)
    for impl in impls:  # warm-up: caches fill, allocators settle
        for kjt in w.batches[:warmup]:
            impl.step(kjt, coeff)
    most = len(w.batches) - rounds * per_round
    while warmup < most and not all(impl.filled() for impl in impls if impl.filled):
        for impl in impls:
            impl.step(w.batches[warmup], coeff)
        warmup += 1
    print(f"# {w.name}: timed after {warmup} warm-up batches"
          + ("" if all(impl.filled() for impl in impls if impl.filled)
             else " (some caches are still not full)"))  # fmt: skip
    times: dict[str, list[float]] = {impl.name: [] for impl in impls}
    # Rounds take turns, so load from neighbours on a shared machine hits every impl alike.
    for r in range(rounds):
        chunk = w.batches[warmup + r * per_round : warmup + (r + 1) * per_round]
        for impl in impls:
            t0 = time.perf_counter()
            impl.run(chunk, coeff)
            times[impl.name].append((time.perf_counter() - t0) / len(chunk))

    probes = {impl.name: impl.probe(w.probe) for impl in impls}
    median = {name: statistics.median(t) for name, t in times.items()}

    def ratio(name: str, base: str) -> tuple[float, float, float] | tuple[None, None, None]:
        # Each round's ratio (the two ran within a second of each other, on the machine as it
        # was then; this machine's speed drifts between rounds): their median and quartiles.
        if base not in times:
            return None, None, None
        found = [t / b for t, b in zip(times[name], times[base], strict=True)]
        if len(found) < 2:
            return found[0], found[0], found[0]
        q1, mid, q3 = statistics.quantiles(found, n=4, method="inclusive")
        return mid, q1, q3

    # A sequence's every row against the baseline's (its tables are small).
    base_weights = {} if w.pooled else next(i for i in impls if i.name == SEQUENCE_BASE).weights()

    def rows_max_diff(impl: Impl) -> float | None:
        if w.pooled or impl.weights is None:
            return None
        ours = impl.weights()
        return max(float((ours[k] - v).abs().max()) for k, v in base_weights.items())

    rows = []
    for impl in impls:
        s, ref = median[impl.name], probes[FAMILY[impl.name]]
        rel = (probes[impl.name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
        base = ADAGRAD_BASE if w.pooled else SEQUENCE_BASE
        vs_torchrec, torchrec_q1, torchrec_q3 = ratio(impl.name, base)
        vs_fbgemm, fbgemm_q1, fbgemm_q3 = ratio(impl.name, ROWWISE_BASE)
        rows.append(
            Row(
                workload=w.name,
                rows=sum(t.num_embeddings for t in w.tables),
                dim=w.tables[0].embedding_dim,
                batch=w.batch,
                ids_per_bag=w.ids_per_bag,
                impl=impl.name,
                ms_per_step=s * 1e3,
                samples_per_s=w.batch / s,
                vs_torchrec=vs_torchrec,
                vs_fbgemm_rowwise=vs_fbgemm,
                hit_rate=impl.hit_rate() if impl.hit_rate else None,
                probe_rel_diff=float(rel),
                vs_torchrec_q1=torchrec_q1,
                vs_torchrec_q3=torchrec_q3,
                vs_fbgemm_rowwise_q1=fbgemm_q1,
                vs_fbgemm_rowwise_q3=fbgemm_q3,
                rows_max_diff=rows_max_diff(impl),
            )
        )
    return rows


def differs(r: Row) -> bool:
    """Whether the impl trained other weights than its family's baseline."""
    return r.probe_rel_diff > PROBE_TOLERANCE or (r.rows_max_diff or 0.0) > ROWS_TOLERANCE


def print_table(rows: list[Row]) -> None:
    """One line per impl; "vs torchrec" is against ``torchrec_ec`` on ``sequence``, with the
    quartiles of the rounds' ratios beside it."""
    head = (
        f"{'workload':<10} {'impl':<32} {'ms/step':>9} {'samples/s':>11} {'vs torchrec':>12} "
        f"{'(rounds)':>11} {'vs fbgemm_rw':>13} {'hit rate':>8} {'probe diff':>10} "
        f"{'rows diff':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        hit = "" if r.hit_rate is None else f"{r.hit_rate:.3f}"
        spread = f"{r.vs_torchrec_q1:.2f}-{r.vs_torchrec_q3:.2f}"
        fbgemm = "" if r.vs_fbgemm_rowwise is None else f"{r.vs_fbgemm_rowwise:.2f}x"
        diff = "" if r.rows_max_diff is None else f"{r.rows_max_diff:.1e}"
        print(
            f"{r.workload:<10} {r.impl:<32} {r.ms_per_step:>9.2f} {r.samples_per_s:>11,.0f} "
            f"{r.vs_torchrec:>11.2f}x {spread:>11} {fbgemm:>13} {hit:>8} "
            f"{r.probe_rel_diff:>10.1e} {diff:>9}"
        )
    for r in filter(differs, rows):
        rows_diff = "" if r.rows_max_diff is None else f", rows {r.rows_max_diff:.1e} (absolute)"
        print(
            f"RESULTS DIFFER: {r.impl} on {r.workload}, after the same steps as {FAMILY[r.impl]}: "
            f"probe output {r.probe_rel_diff:.1e} (relative) away{rows_diff}"
        )
    for impl, base, limit, where in TARGETS:
        for r in rows:
            if r.impl != impl or (where is not None and r.workload not in where):
                continue
            if base == ADAGRAD_BASE:
                ratio, q1, q3 = r.vs_torchrec, r.vs_torchrec_q1, r.vs_torchrec_q3
            else:
                ratio, q1, q3 = r.vs_fbgemm_rowwise, r.vs_fbgemm_rowwise_q1, r.vs_fbgemm_rowwise_q3
            verdict = "meets" if ratio <= limit else "MISSES"
            print(f"target {impl} <= {limit:.1f}x {base} on {r.workload}: {ratio:.2f}x, {verdict} "
                  f"(rounds' quartiles {q1:.2f}-{q3:.2f}x)")  # fmt: skip


def read_rows(path: Path) -> list[Row]:
    """The rows of an e2e CSV written by `write_csv` (empty cells: None)."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(Row)}

    def value(name: str, text: str) -> object:
        if text == "":
            return None
        if kinds[name] == "str":
            return text
        return int(text) if kinds[name] == "int" else float(text)

    with path.open(newline="") as f:
        return [Row(**{k: value(k, v) for k, v in line.items()}) for line in csv.DictReader(f)]


def merged_rows(old: list[Row], new: list[Row]) -> list[Row]:
    """``old`` with the workloads ``new`` measured replaced by its rows (in ``old``'s order of
    workloads, new ones last): ``--update-results`` of a subset of ``--workloads`` keeps the
    committed rows of the others."""
    fresh = {r.workload for r in new}
    order = list(dict.fromkeys([r.workload for r in old] + [r.workload for r in new]))
    by_workload = {w: [r for r in (new if w in fresh else old) if r.workload == w] for w in order}
    return [r for w in order for r in by_workload[w]]


FAMILY_COLORS = {ADAGRAD_BASE: "tab:blue", ROWWISE_BASE: "tab:orange", SEQUENCE_BASE: "tab:green"}
FAMILY_NAMES = {
    ADAGRAD_BASE: f"AdaGrad, against {ADAGRAD_BASE}",
    ROWWISE_BASE: f"row-wise AdaGrad, against {ROWWISE_BASE}",
    SEQUENCE_BASE: f"sequence (unpooled), against {SEQUENCE_BASE}",
}


def family_ratio(r: Row) -> tuple[float, float, float] | None:
    """``r``'s time over its family's baseline's, with the rounds' quartiles."""
    if FAMILY[r.impl] == ROWWISE_BASE:
        if r.vs_fbgemm_rowwise is None:
            return None
        return r.vs_fbgemm_rowwise, r.vs_fbgemm_rowwise_q1 or 0.0, r.vs_fbgemm_rowwise_q3 or 0.0
    return r.vs_torchrec, r.vs_torchrec_q1, r.vs_torchrec_q3


def write_plot(rows: list[Row], path: Path, note: str = "") -> None:
    """One panel per workload (small multiples): a horizontal bar per impl, its time per step
    over its family's baseline (colour: the family), whiskers at the rounds' quartiles, a
    black tick at the impl's target where it has one. Impl names and ratios label the bars, so
    the legend holds only the families and the target mark."""
    plt = pyplot()
    workloads = list(dict.fromkeys(r.workload for r in rows))
    ncols = min(2, len(workloads))
    nrows = -(-len(workloads) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 0.5 + 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(workloads) :]:
        ax.set_visible(False)
    families: set[str] = set()
    for ax, w in zip(axes.flat, workloads, strict=False):
        found = [(r, ratio) for r in rows if r.workload == w and (ratio := family_ratio(r))]
        top = 1.0
        for y, (r, (mid, q1, q3)) in enumerate(found):
            family = FAMILY[r.impl]
            families.add(family)
            ax.barh(y, mid, color=FAMILY_COLORS[family], height=0.7)
            ax.errorbar(mid, y, xerr=[[max(mid - q1, 0)], [max(q3 - mid, 0)]], color="black",
                        linewidth=0.8, capsize=2)  # fmt: skip
            top = max(top, mid, q3)
            for impl, _base, limit, where in TARGETS:
                if impl == r.impl and (where is None or w in where):
                    ax.plot([limit, limit], [y - 0.35, y + 0.35], color="black", linewidth=2)
                    top = max(top, limit)
        ax.axvline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set_yticks(range(len(found)))
        # The value beside the name: clear of the bars, whiskers and targets at any scale.
        ax.set_yticklabels([f"{r.impl}  {mid:.2f}x" for r, (mid, _, _) in found], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.05)
        ax.set_xlabel("time per step / the family's baseline (< 1: faster)", fontsize=8)
        ax.set_title(w, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=FAMILY_COLORS[f]) for f in FAMILY_COLORS
               if f in families]  # fmt: skip
    labels = [FAMILY_NAMES[f] for f in FAMILY_COLORS if f in families]
    handles.append(plt.Line2D([], [], color="black", linewidth=2))
    labels.append("target (docs/design.md)")
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels))
    title = "training step (forward + backward + sparse step), CPU, 1 thread; whiskers: rounds' "
    title += "quartiles" + (f"\n{note}" if note else "")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 / nrows, 1, 1))  # the legend below the panels
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, few steps: a smoke test (see the doc)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default 1: stable numbers)"
    )
    parser.add_argument(
        "--workloads",
        default="long_bags,batch256,criteo,sequence",
        help="comma-separated subset (with --update-results, the other workloads' committed "
        "rows are kept)",
    )
    add_output_options(parser, "e2e.csv")
    args = parse_args(parser, argv)
    set_threads(args.threads)
    # torch.optim.Adagrad builds its sparse updates without invariant checks and says so once.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    # At least `warmup` warm-up batches, more until the caches are full (`bench`): up to
    # `fill` more.
    sizes = QUICK if args.quick else FULL
    warmup, rounds, per_round, n = sizes.warmup, sizes.rounds, sizes.per_round, sizes.batches
    makers = {
        "long_bags": lambda: long_bags("long_bags", sizes.long_batch, n, sizes),
        "batch256": lambda: long_bags("batch256", sizes.short_batch, n, sizes),
        "criteo": lambda: criteo(n, sizes),
        "sequence": lambda: sequence(n, sizes),
    }
    chosen = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in makers]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {sorted(makers)}")
    allocator = keep_freed_memory()
    print(run_header(torch.device("cpu")) + f"; {allocator}")
    note = quick_note(args.quick)
    rows = [row for name in chosen for row in bench(makers[name](), warmup, rounds, per_round)]
    print_table(rows)
    if args.update_results and args.out.exists():
        rows = merged_rows(read_rows(args.out), rows)  # the other workloads' rows kept
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out)
    write_plot(rows, args.out.with_suffix(".png"), note)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    differ = [f"{r.impl} ({r.workload})" for r in rows if differs(r)]
    if differ:
        raise SystemExit(f"bench_e2e: impls trained other weights than their baseline: {differ}")


if __name__ == "__main__":
    main()
