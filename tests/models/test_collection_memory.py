"""The collection in bounded memory: unbounded tables (raw 64-bit ids), admission, half-precision
rows, and checkpoints of all of it that resume bit for bit."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagConfig

import embcache
from embcache import CacheConfig, CachedEmbeddingBagCollection, JaggedBatch, TableConfig
from embcache.hashing import mix64

INIT = functools.partial(torch.nn.init.uniform_, a=-0.1, b=0.1)
K = 30  # the default fusion_k


def tables(rows: int | None, kind: str = "config") -> list:
    """Two tables of dim 4 sharing a cache, one of dim 3: as TableConfig, torchrec config or
    dicts."""
    fields = [
        {"name": "a", "embedding_dim": 4, "num_embeddings": rows, "feature_names": ["fa"],
         "init_fn": INIT},
        {"name": "b", "embedding_dim": 4, "num_embeddings": rows, "feature_names": ["fb"],
         "init_fn": INIT, "pooling": "mean"},
        {"name": "c", "embedding_dim": 3, "num_embeddings": rows, "feature_names": ["fc"],
         "init_fn": INIT},
    ]  # fmt: skip
    if kind == "dict":
        return fields
    if kind == "torchrec":
        from torchrec import PoolingType

        return [
            EmbeddingBagConfig(**{**f, "pooling": PoolingType[f.get("pooling", "sum").upper()]})
            for f in fields
        ]
    return [TableConfig(**f) for f in fields]


def batch(gen: torch.Generator, high: int, size: int = 16) -> JaggedBatch:
    lengths = torch.randint(0, 4, (3 * size,), generator=gen)
    values = torch.randint(0, high, (int(lengths.sum()),), generator=gen)
    return JaggedBatch.from_lengths(["fa", "fb", "fc"], values, lengths)


def train_with(ebc, opt, batches) -> list[torch.Tensor]:
    outs = []
    for b in batches:
        out = ebc(b).values()
        outs.append(out.detach().clone())
        (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
        opt.step()
    return outs


def train(ebc, batches: list[JaggedBatch], lr: float = 0.2) -> list[torch.Tensor]:
    return train_with(ebc, embcache.SparseAdaGrad([ebc], lr=lr), batches)


@pytest.mark.parametrize("kind", ["config", "torchrec", "dict"])
def test_unbounded_tables_train_like_bounded_ones(kind: str) -> None:
    """Tables with num_embeddings=None (any config kind) give the same outputs and rows as the
    same tables bounded, on ids both accept; a state_dict leaves them out."""
    gen = torch.Generator().manual_seed(0)
    batches = [batch(gen, 500) for _ in range(6)]
    bounded = CachedEmbeddingBagCollection(tables(500), cache=CacheConfig(capacity=64), seed=3)
    unbounded = CachedEmbeddingBagCollection(
        tables(None, kind), cache=CacheConfig(capacity=64), seed=3
    )
    for got, want in zip(train(unbounded, batches), train(bounded, batches), strict=True):
        assert torch.equal(got, want)
    ids = torch.arange(500)
    for name in "abc":
        for ebc in (bounded, unbounded):
            ebc.flush()
        assert torch.equal(unbounded.store.read(name, ids), bounded.store.read(name, ids))
    assert list(unbounded.state_dict()) == []
    with pytest.raises(ValueError, match="unbounded"):
        unbounded.table_rows("a")


def test_raw_64_bit_ids_fold_into_the_id_bits() -> None:
    """Ids at or beyond 2**fusion_k, negative ones (a uint64 hash seen as int64) included, are
    folded by mix64 into the fusion_k bits: such an id reads the row of its folded value."""
    ebc = CachedEmbeddingBagCollection(tables(None), cache=CacheConfig(capacity=64), seed=1)
    raw = torch.tensor([2**62 + 5, -(2**63), -12345, 1 << K])
    folded = mix64(raw) & ((1 << K) - 1)
    lengths = torch.tensor([1] * 4 + [0] * 8)
    with torch.no_grad():
        wide = ebc(JaggedBatch.from_lengths(["fa", "fb", "fc"], raw, lengths)).values()
        narrow = ebc(JaggedBatch.from_lengths(["fa", "fb", "fc"], folded, lengths)).values()
    assert torch.equal(wide, narrow) and bool((wide[:, :4] != 0).all())


def test_a_checkpoint_of_unbounded_tables_loads_only_at_its_fusion_k(tmp_path: Path) -> None:
    """Rows of raw ids are keyed by the ids folded to the saving model's fusion_k: a model that
    folds to other bits would read them under other ids, so loading refuses it (and changes
    nothing); bounded tables (ids in range whatever fusion_k) load either way."""

    def model(rows: int | None, k: int) -> CachedEmbeddingBagCollection:
        ebc = CachedEmbeddingBagCollection(
            tables(rows), cache=CacheConfig(capacity=64), fusion_k=k, seed=1
        )
        embcache.SparseAdaGrad([ebc], lr=0.2)  # the state layout a checkpoint of train() has
        return ebc

    gen = torch.Generator().manual_seed(3)
    batches = [batch(gen, 1 << 40) for _ in range(3)]
    saved = model(None, K)
    train(saved, batches)
    embcache.save(tmp_path / "raw", saved)
    other = model(None, 40)
    probe = batch(gen, 1 << 28)
    with torch.no_grad():
        before = other(probe).values()
    with pytest.raises(ValueError, match=r"'a'.*fusion_k=30 bits, the model folds them to 40"):
        embcache.load(tmp_path / "raw", other)
    with torch.no_grad():
        assert torch.equal(other(probe).values(), before)
    same = model(None, K)
    embcache.load(tmp_path / "raw", same)
    with torch.no_grad():
        assert torch.equal(same(probe).values(), saved(probe).values())

    bounded = model(1000, K)
    train(bounded, [batch(gen, 1000) for _ in range(3)])
    embcache.save(tmp_path / "bounded", bounded)
    wider = model(1000, 40)
    embcache.load(tmp_path / "bounded", wider)
    for name in ("a", "b", "c"):
        assert torch.equal(wider.table_rows(name), bounded.table_rows(name))


def test_unbounded_tables_need_an_explicit_cache_capacity() -> None:
    with pytest.raises(ValueError, match="needs an explicit capacity"):
        CachedEmbeddingBagCollection(tables(None), cache=CacheConfig(load_factor=0.1))
    with pytest.raises(ValueError, match="needs an explicit capacity"):
        CachedEmbeddingBagCollection(tables(None))


def test_admission_reads_zeros_and_drops_gradients_until_the_nth_batch() -> None:
    """admit_after=2 on table a: an id of a reads zeros and is not trained in the first batch
    it appears in; from the second it has its own row, starting from its initial value, as in
    a collection without admission whose first batch trained only the other tables."""
    config = CacheConfig(capacity=64, admit_after={"a": 2})
    ebc = CachedEmbeddingBagCollection(tables(None), cache=config, seed=5)
    plain = CachedEmbeddingBagCollection(tables(None), cache=CacheConfig(capacity=64), seed=5)
    only_a = JaggedBatch.from_lengths(
        ["fa", "fb", "fc"], torch.tensor([7, 8, 9]), torch.tensor([3, 0, 0])
    )
    first = train(ebc, [only_a])[0]
    assert torch.equal(first, torch.zeros_like(first))
    assert ebc.store.row_count("a") == 0
    stats = ebc.cache_stats()
    assert stats["admissions_refused"] == 3 and stats["gradients_dropped"] == 3
    second = train(ebc, [only_a])[0]
    with torch.no_grad():
        want = plain(only_a).values()
    assert torch.equal(second, want) and bool((second != 0).any())
    assert ebc.store.row_count("a") == 3


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_rows_train_close_to_float32(dtype: str) -> None:
    """weight_dtype stores rows in half precision in the cache and the tier (state float32):
    after training the weights stay within a few half-precision steps of float32 training's,
    state_dict gives the table's data_type, and the bytes moved per row shrink."""
    gen = torch.Generator().manual_seed(2)
    batches = [batch(gen, 300) for _ in range(12)]
    runs = {}
    for name, cfg in (("fp32", CacheConfig(capacity=64)),
                      (dtype, CacheConfig(capacity=64, weight_dtype=dtype))):  # fmt: skip
        ebc = CachedEmbeddingBagCollection(tables(300), cache=cfg, seed=4)
        train(ebc, batches)
        ebc.flush()
        runs[name] = ebc
    half, full = runs[dtype], runs["fp32"]
    assert half.caches()[0].weights.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    for name in "abc":
        w_half, w_full = half.table_rows(name), full.table_rows(name)
        dim = half.store.table_spec(name).dim
        tol = {"fp16": 2e-3, "bf16": 1.5e-2}[dtype] * w_full[:, :dim].abs().max()
        assert (w_half[:, :dim] - w_full[:, :dim]).abs().max() <= tol
        assert half.state_dict()[f"embedding_bags.{name}.weight"].dtype == torch.float32
    row_bytes = {n: r.store.table_spec("a").row_bytes for n, r in runs.items()}
    assert row_bytes[dtype] == 4 * 2 + 4 * 4 and row_bytes["fp32"] == 8 * 4


def test_torchrec_data_type_is_the_stored_precision() -> None:
    import torchrec

    cfg = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=50, feature_names=["f"],
                             data_type=torchrec.DataType.BF16)  # fmt: skip
    ebc = CachedEmbeddingBagCollection([cfg], cache=CacheConfig(capacity=16))
    assert ebc.store.table_spec("t").dtype == torch.bfloat16
    assert ebc.caches()[0].weights.dtype == torch.bfloat16


def _model(kind: str, store) -> CachedEmbeddingBagCollection:
    config = {
        "bounded-tier": CacheConfig(capacity=32, ways=8, tier_capacity=128, policy="lfu",
                                    lfu_counters="sketch", sketch_width=512,
                                    admit_after={"b": 2}, admission_window=50,
                                    weight_dtype="bf16"),
        "tiered": CacheConfig(capacity=32, ways=8, tier_capacity=128, tier_policy="lfu"),
        "plain": CacheConfig(capacity=32, ways=8),
    }[kind]  # fmt: skip
    return CachedEmbeddingBagCollection(tables(None), cache=config, store=store, seed=9)


@pytest.mark.parametrize("kind", ["bounded-tier", "tiered", "plain"])
def test_resume_after_a_checkpoint_is_bit_exact(kind: str, tmp_path: Path) -> None:
    """Unbounded tables, a tier bounded well below the ids seen (with evictions), admission
    whose sketch is halved every 50 sightings (saved in the middle of a window, halved several
    times after), bf16 rows, LFU in a sketch: training 10 batches, saving, and training 10 more
    gives the same outputs, rows and scores as a new model loaded from the checkpoint training
    those 10."""
    gen = torch.Generator().manual_seed(11)
    # Raw 64-bit ids from 300 per feature: they come back (admitted), more than the tier keeps.
    batches = [batch(gen, 300, size=24) for _ in range(20)]
    batches = [JaggedBatch.from_lengths(b.keys(), mix64(b.values()), b.lengths()) for b in batches]

    def store():
        return embcache.kv.TieredKV(embcache.HostKV(), 50) if kind == "tiered" else None

    first = _model(kind, store())
    opt = embcache.SparseAdaGrad([first], lr=0.2)
    train_with(first, opt, batches[:10])
    embcache.save(tmp_path / "ckpt", first, [opt])
    if kind == "bounded-tier":
        metas = [cache.policy_state()[1] for cache in first.caches()]
        sightings = [m["admission_sightings"] for m in metas if "admission_sightings" in m]
        assert len(sightings) == 1 and 0 < sightings[0] < 50
        after = sum(b["fb"].values().unique().numel() for b in batches[10:])
        assert after > 3 * 50  # halvings after the save
    went_on = train_with(first, opt, batches[10:])
    assert kind == "plain" or first.store.io_stats()["tier_evictions"] > 0

    second = _model(kind, store())
    opt2 = embcache.SparseAdaGrad([second], lr=0.2)
    embcache.load(tmp_path / "ckpt", second, [opt2])
    resumed = train_with(second, opt2, batches[10:])
    for a, b in zip(resumed, went_on, strict=True):
        assert torch.equal(a, b)
    for ebc in (first, second):
        ebc.flush()
    for name in "abc":
        scores = first.store.keeps_scores(name)
        chunks = [list(ebc.store.export_rows(name, scores=scores)) for ebc in (first, second)]
        for part in range(3 if scores else 2):
            a, b = (torch.cat([c[part] for c in chunks_of]) for chunks_of in chunks)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, part)


def test_the_memory_guide_example_runs_as_written() -> None:
    """The first python block of docs/memory.md (the guide to memory at scale) builds what it
    says: an unbounded table of raw 64-bit ids, a bounded tier of bf16 rows, admission at the
    second batch; two steps on the same raw ids read zeros, then rows of their own."""
    readme = Path(__file__).resolve().parents[2] / "docs" / "memory.md"
    code = readme.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    ns: dict = {}
    exec(compile(code, str(readme), "exec"), ns)
    ebc, opt = ns["ebc"], ns["opt"]
    spec = ebc.store.table_spec("user")
    assert spec.num_embeddings is None and spec.capacity == 1_000_000
    assert spec.dtype == torch.bfloat16 and spec.row_bytes == 2 * 16 + 4
    raw = torch.tensor([2**62 + 3, -(2**40), 17, 2**33])  # hashed ids, one per sample
    features = JaggedBatch.from_lengths(["user_id"], raw, torch.ones(4, dtype=torch.int64))
    outs = []
    for _ in range(2):
        out = ebc(features).values()
        outs.append(out.detach().clone())
        out.square().sum().backward()
        opt.step()
    assert torch.equal(outs[0], torch.zeros(4, 16))  # not admitted yet: zeros, no row
    assert bool((outs[1] != 0).all()) and ebc.store.row_count("user") == 4
    assert ebc.cache_stats()["admissions_refused"] == 4
