"""`CollectionOptions`: every collection takes its options as keywords or as one object, with the
same result bit for bit; the options are checked once, in the dataclass; and no signature but
the public constructors restates them.

* each kind of collection (local, sequence, RecStore's two, sharded's two on one in-process
  rank) built from keywords and from ``options=`` trains to the same rows and optimizer state;
* a keyword given beside ``options=`` is refused, naming it; a bad option is refused naming
  it, by the dataclass and by every constructor, before anything is built;
* the option names are parameters of the dataclass and the public constructors only (read
  from the package's source with ``ast``), with the dataclass's defaults.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import embcache
from embcache import CacheConfig, CollectionOptions, HostKV, JaggedBatch, TableConfig
from embcache.distributed import ShardedEmbeddingBagCollection, ShardedEmbeddingCollection
from embcache.engine.options import option_names
from embcache.recstore.collection import RECSTORE_DEFAULTS

PACKAGE = Path(__file__).resolve().parents[2] / "embcache"

ROWS = {"f0": 97, "f1": 97, "f2": 41}
STEPS = 3


def _tables(pooled: bool) -> list[TableConfig]:
    """t0 (dim 5, 97 rows, features f0 and f1) and t1 (dim 3, 41 rows, f2): two caches."""
    bag = "sum" if pooled else "none"
    return [
        TableConfig(name="t0", embedding_dim=5, num_embeddings=97, feature_names=["f0", "f1"],
                    pooling=bag),
        TableConfig(name="t1", embedding_dim=3, num_embeddings=41, feature_names=["f2"],
                    pooling="mean" if pooled else "none"),
    ]  # fmt: skip


def _batch(step: int, k: int) -> JaggedBatch:
    """B=5 bags a feature, some empty, duplicates, the tables' last rows."""
    gen = torch.Generator().manual_seed(1000 * step + k)
    lengths, values = [], []
    for rows in ROWS.values():
        ln = torch.randint(0, 4, (5,), generator=gen)
        v = torch.randint(0, rows, (int(ln.sum()),), generator=gen)
        if v.numel() >= 3:
            v[1], v[2] = v[0], rows - 1
        lengths.append(ln)
        values.append(v)
    return JaggedBatch.from_lengths(list(ROWS), torch.cat(values), torch.cat(lengths))


def _loss(out: Any) -> torch.Tensor:
    if isinstance(out, dict):  # a sequence collection's {key: JaggedRows}
        return sum((o.values().square().sum() for o in out.values()), torch.zeros(()))
    return out.values().square().sum()


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A gloo process group of one rank in this process, for the sharded collections."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# Each kind: (whether it pools, its constructor, whether it needs a process group).
KINDS: dict[str, tuple[bool, Callable[..., Any], bool]] = {
    "bags": (True, embcache.CachedEmbeddingBagCollection, False),
    "sequence": (False, embcache.CachedEmbeddingCollection, False),
    "recstore-bags": (True, embcache.RecStoreEmbeddingBagCollection, False),
    "recstore-sequence": (False, embcache.RecStoreEmbeddingCollection, False),
    "sharded-bags": (True, ShardedEmbeddingBagCollection, True),
    "sharded-sequence": (False, ShardedEmbeddingCollection, True),
}

# Option sets, each with how a step trains: (options but the store, passes per step, whether
# a SparseAdaGrad is attached and stepped).
OPTION_SETS: dict[str, tuple[dict[str, Any], int, bool]] = {
    "in-backward": (
        dict(cache=CacheConfig(capacity=16, ways=4, policy="lfu"), seed=11, fusion_k=12,
             device="cpu", lr=0.05, update_in_backward=True),
        1,
        True,
    ),
    "accumulate": (
        dict(cache=CacheConfig(load_factor=0.5), seed=3, lr=0.04, accumulate_grads=True,
             enable_fusion=False),
        2,
        True,
    ),
    "fused-adagrad": (
        dict(cache=CacheConfig(capacity=24, ways=8), seed=5,
             optimizer_type=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1}),
        1,
        False,
    ),
}  # fmt: skip

CASES = [(kind, name) for kind in KINDS for name in OPTION_SETS]


def _build(kind: str, request: pytest.FixtureRequest, **arguments: Any) -> Any:
    pooled, cls, sharded = KINDS[kind]
    if sharded:
        request.getfixturevalue("one_rank")
    return cls(_tables(pooled), **arguments)


def _train(collection: Any, passes: int, sparse: bool) -> dict[str, torch.Tensor]:
    opt = embcache.SparseAdaGrad([collection]) if sparse else None  # at the options' lr
    for step in range(STEPS):
        for k in range(passes):
            _loss(collection(_batch(step, k))).backward()
        if opt is not None:
            opt.step()
    rows = {t.name: collection.table_rows(t.name) for t in collection.tables}
    collection.close()
    return rows


@pytest.mark.parametrize(("kind", "option_set"), CASES, ids=[f"{k}-{o}" for k, o in CASES])
def test_keywords_and_options_train_the_same_rows(
    kind: str, option_set: str, request: pytest.FixtureRequest
) -> None:
    given, passes, sparse = OPTION_SETS[option_set]
    by_keywords = _build(kind, request, store=HostKV(), **given)
    by_options = _build(kind, request, options=CollectionOptions(store=HostKV(), **given))
    assert dataclasses.replace(by_keywords.options, store=None) == dataclasses.replace(
        by_options.options, store=None
    )
    want = _train(by_keywords, passes, sparse)
    got = _train(by_options, passes, sparse)
    for name, rows in want.items():
        assert rows.abs().sum() > 0
        assert torch.equal(got[name], rows), f"table {name}: rows differ"


def test_one_options_object_serves_several_collections() -> None:
    """Options hold no per-collection state: two collections of one options object (its
    store None: each opens a tier of its own) train alike."""
    options = CollectionOptions(cache=CacheConfig(capacity=16, ways=4), seed=2, lr=0.05)
    rows = [
        _train(embcache.CachedEmbeddingBagCollection(_tables(True), options=options), 1, True)
        for _ in range(2)
    ]
    assert all(torch.equal(rows[0][t], rows[1][t]) for t in rows[0])


def test_the_sharded_sequence_collection_takes_a_fused_optimizer_in_options(
    one_rank: None,
) -> None:
    given, passes, sparse = OPTION_SETS["fused-adagrad"]
    ec = ShardedEmbeddingCollection(_tables(False), options=CollectionOptions(**given))
    before = {t.name: ec.table_rows(t.name) for t in ec.tables}
    after = _train(ec, passes, sparse)
    assert all(not torch.equal(before[t], after[t]) for t in before)


def test_recstore_collections_keep_their_default_lr_under_options() -> None:
    ebc = embcache.RecStoreEmbeddingBagCollection(
        _tables(True), options=CollectionOptions(store=HostKV())
    )
    assert ebc.lr == RECSTORE_DEFAULTS["lr"]
    ebc = embcache.RecStoreEmbeddingBagCollection(
        _tables(True), options=CollectionOptions(store=HostKV(), lr=0.2)
    )
    assert ebc.lr == 0.2


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("keyword", "value"),
    [("fusion_k", 20), ("accumulate_grads", True), ("lr", 0.3), ("cache", CacheConfig())],
    ids=["fusion_k", "accumulate_grads", "lr", "cache"],
)
def test_a_keyword_beside_options_is_refused_naming_it(kind: str, keyword: str, value: Any) -> None:
    pooled, cls, _ = KINDS[kind]
    store = HostKV()
    with pytest.raises(TypeError, match=rf"^{keyword} given both as a keyword argument and in "):
        cls(_tables(pooled), options=CollectionOptions(store=store), **{keyword: value})
    assert store.tables() == []  # nothing was built


def test_a_keyword_left_at_its_default_defers_to_options() -> None:
    ebc = embcache.CachedEmbeddingBagCollection(
        _tables(True), fusion_k=30, options=CollectionOptions(fusion_k=20)
    )
    assert ebc.fusion_k == 20


def test_options_must_be_collection_options() -> None:
    with pytest.raises(TypeError, match="options must be a CollectionOptions, got dict"):
        embcache.CachedEmbeddingBagCollection(_tables(True), options={"fusion_k": 20})


BAD = [
    ("cache", "lru", TypeError, "cache must be an embcache.CacheConfig or None, got str"),
    ("device", "gpu0", ValueError, "device: not a device: 'gpu0'"),
    ("device", True, TypeError, "device must be a torch.device"),
    ("device", -1, ValueError, "device: not a device: -1"),
    ("enable_fusion", "no", TypeError, "enable_fusion must be a bool, got 'no'"),
    ("update_in_backward", None, TypeError, "update_in_backward must be a bool, got None"),
    ("accumulate_grads", 2, TypeError, "accumulate_grads must be a bool, got 2"),
    ("allow_unsharded_replicas", "yes", TypeError, "allow_unsharded_replicas must be a bool"),
    ("fusion_k", 0, ValueError, r"fusion_k must be an int in \[1, 56\], got 0"),
    ("fusion_k", 57, ValueError, r"fusion_k must be an int in \[1, 56\], got 57"),
    ("fusion_k", 12.0, ValueError, r"fusion_k must be an int in \[1, 56\], got 12.0"),
    ("lr", -0.1, ValueError, "lr must be finite and >= 0, got -0.1"),
    ("lr", float("nan"), ValueError, "lr must be finite and >= 0, got nan"),
    ("lr", "0.1", TypeError, "lr must be a number or None, got '0.1'"),
    ("seed", -1, ValueError, "seed must be an int >= 0 or None, got -1"),
    ("seed", True, ValueError, "seed must be an int >= 0 or None, got True"),
    ("optimizer_type", "sgd", TypeError, "optimizer_type must be an optimizer class"),
    ("optimizer_kwargs", [("lr", 1)], TypeError, "optimizer_kwargs must be a mapping, got list"),
    ("optimizer_kwargs", {"lr": 0.1}, ValueError, "optimizer_kwargs needs an optimizer_type"),
]


@pytest.mark.parametrize(
    ("option", "value", "error", "message"), BAD, ids=[f"{o}={v!r}" for o, v, _, _ in BAD]
)
def test_a_bad_option_is_refused_naming_it(
    option: str, value: Any, error: type[Exception], message: str
) -> None:
    assert message.startswith(option)
    with pytest.raises(error, match=f"^{message}"):
        CollectionOptions(**{option: value})
    store = HostKV()
    with pytest.raises(error, match=f"^{message}"):
        embcache.CachedEmbeddingBagCollection(_tables(True), store=store, **{option: value})
    assert store.tables() == []  # refused before anything was built


@pytest.mark.parametrize("kind", KINDS)
def test_every_constructor_refuses_a_bad_option_before_building(kind: str) -> None:
    pooled, cls, _ = KINDS[kind]
    store = HostKV()
    with pytest.raises(ValueError, match=r"^fusion_k must be an int in \[1, 56\], got 99"):
        cls(_tables(pooled), store=store, fusion_k=99)
    assert store.tables() == []


def test_options_are_frozen() -> None:
    options = CollectionOptions(optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.optimizer_kwargs["lr"] = 0.2  # type: ignore[index]
    assert options.applies_in_backward
    assert dataclasses.replace(options, seed=3).seed == 3


# -- one declaration ---------------------------------------------------------------------------

# The public constructors: they keep every keyword torchrec's, RecStore's and our users call.
PUBLIC = {
    ("models/collection.py", "CachedEmbeddingBagCollection.__init__"),
    ("models/sequence.py", "CachedEmbeddingCollection.__init__"),
    ("distributed/sharded.py", "ShardedEmbeddingBagCollection.__init__"),
    ("distributed/sharded_sequence.py", "ShardedEmbeddingCollection.__init__"),
    ("recstore/collection.py", "RecStoreEmbeddingBagCollection.__init__"),
    ("recstore/collection.py", "RecStoreEmbeddingCollection.__init__"),
}
# Options only a collection has (``cache``, ``store``, ``device``, ``lr``, ``seed``,
# ``fusion_k`` and the fused optimizer's pair are also a cache's, a tier's, a model's or an
# optimizer's own parameters; ``allow_unsharded_replicas`` also `DistEmbedding`'s).
COLLECTION_ONLY = {"enable_fusion", "update_in_backward", "accumulate_grads"}


def _signatures() -> Iterator[tuple[str, str, set[str]]]:
    """``(file under embcache/, qualified function name, its parameter names)``."""

    def walk(node: ast.AST, rel: str, prefix: str) -> Iterator[tuple[str, str, set[str]]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, rel, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a = child.args
                yield (
                    rel,
                    prefix + child.name,
                    {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs},
                )
                yield from walk(child, rel, f"{prefix}{child.name}.")

    for path in sorted(PACKAGE.rglob("*.py")):
        yield from walk(ast.parse(path.read_text()), path.relative_to(PACKAGE).as_posix(), "")


def test_no_signature_but_the_public_constructors_restates_the_options() -> None:
    """Inside the package the options travel as one `CollectionOptions`: a function that
    takes five or more of them, or any option only a collection has, is a public
    constructor."""
    names = set(option_names())
    restating = {
        (rel, qualified)
        for rel, qualified, params in _signatures()
        if len(params & names) >= 5 or params & COLLECTION_ONLY
    }
    assert restating == PUBLIC, "take a CollectionOptions instead of the options one by one"


@pytest.mark.parametrize("kind", KINDS)
def test_public_constructors_keep_the_dataclass_defaults(kind: str) -> None:
    _, cls, _ = KINDS[kind]
    params = inspect.signature(cls.__init__).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(CollectionOptions)}
    if cls.__name__.startswith("RecStore"):  # ``options=`` reaches it through **kwargs
        defaults |= RECSTORE_DEFAULTS
    else:
        assert params["options"].kind is inspect.Parameter.KEYWORD_ONLY
    for name in set(option_names()) & set(params):
        assert params[name].default == defaults[name], f"{cls.__name__}({name}=...)"


# -- the models that build collections: DLRM and SequenceRecommender -------------------------


def _dlrm_tables() -> list[TableConfig]:
    return [
        TableConfig(name=f"t{i}", embedding_dim=4, num_embeddings=50, feature_names=[f"f{i}"])
        for i in range(2)
    ]


def _seq_tables() -> list[TableConfig]:
    return [
        TableConfig(name="t_user", embedding_dim=6, num_embeddings=5, feature_names=["user"]),
        TableConfig(name="t_item", embedding_dim=6, num_embeddings=9, feature_names=["item"]),
    ]


def _seq_batch() -> JaggedBatch:
    return JaggedBatch.from_lengths(
        keys=["user", "item", "history"],
        values=torch.tensor([1, 4, 0, 1, 5, 6, 7]),
        lengths=torch.tensor([1, 1, 1, 1, 0, 3]),
    )


@pytest.mark.parametrize("model", ["dlrm", "sequence"])
def test_models_build_their_collections_from_options(model: str) -> None:
    """`DLRM` and `SequenceRecommender` take ``options=`` (through their collection keywords):
    the collections get those options (cache, lr, seed) and train to the same rows as when
    the same options are given as the models' keywords; a model keyword that repeats one
    (``cache``) is refused, naming it."""
    from embcache.models.dlrm import DLRM
    from embcache.models.sequence_model import SequenceRecommender

    cache = CacheConfig(capacity=64)

    def build(**kw: Any) -> Any:
        if model == "dlrm":
            return DLRM(_dlrm_tables(), dense_in_features=0, bottom_mlp=(), **kw)
        return SequenceRecommender(_seq_tables(), target="item", history_length=2, **kw)

    def rows(m: Any) -> list[torch.Tensor]:
        if model == "dlrm":
            batch = JaggedBatch.from_lengths(
                ["f0", "f1"], torch.tensor([3, 7, 7, 1]), torch.ones(4, dtype=torch.int64)
            )
            dense = torch.zeros(2, 0)
        else:
            batch, dense = _seq_batch(), None
        arch = m.sparse_arch
        parts = [arch] if model == "dlrm" else arch.collections()
        opt = embcache.SparseAdaGrad(parts, lr=0.1)
        m(dense, batch).sum().backward()
        opt.step()
        return [p.table_rows(t.name) for p in parts for t in p.tables]

    with_keywords = build(cache=cache, seed=3)
    with_options = build(options=CollectionOptions(cache=cache, seed=3), seed=3)
    arch = with_options.sparse_arch
    collections = [arch] if model == "dlrm" else arch.collections()
    for c in collections:
        assert c.options.cache is cache and c.options.seed == 3
    for a, b in zip(rows(with_keywords), rows(with_options), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="cache given both"):
        build(cache=cache, options=CollectionOptions(cache=cache))
