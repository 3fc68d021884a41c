"""The collection as a drop-in for torchrec's EmbeddingBagCollection: torchrec's model classes
take it and train it, inputs are read as leniently as torchrec reads them, the initial rows
are torchrec's, and the module-level conventions (configs, meta device, data types, fx,
export) hold. Training the torchrec way (torch optimizers, fused optimizers) is in
test_torch_optim.py."""

from __future__ import annotations

import functools

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType
from torchrec.datasets.utils import Batch
from torchrec.fx import symbolic_trace
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

import embcache
from embcache import CachedEmbeddingBagCollection

B, D, DENSE = 3, 8, 13


def _tables(rows: int = 40, **extra) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="t1", embedding_dim=D, num_embeddings=rows, feature_names=["f1", "f3"], **extra
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=D, num_embeddings=rows, feature_names=["f2"]),
    ]


def _kjt(gen: torch.Generator, keys=("f1", "f2", "f3"), rows: int = 40, weighted=False):
    lengths = torch.randint(0, 4, (len(keys) * B,), generator=gen)
    lengths[0] = 0  # an empty bag
    n = int(lengths.sum())
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys),
        values=torch.randint(0, rows, (n,), generator=gen),
        lengths=lengths,
        weights=torch.rand(n, generator=gen) if weighted else None,
    )


def _rows_changed(before: dict, after: dict) -> int:
    return sum(int((before[k] != after[k]).any(dim=1).sum()) for k in before)


# -- torchrec's model classes ------------------------------------------------------------------


def _dlrm(ebc):
    return DLRM(ebc, DENSE, [16, D], [8, 1])


def _dcn(ebc):
    return DLRM_DCN(ebc, DENSE, [16, D], [8, 1], dcn_num_layers=2, dcn_low_rank_dim=4)


def _projection(ebc):
    return DLRM_Projection(ebc, DENSE, [16, D], [8, 1], [12, 2 * D], [12, D])


def _deepfm(ebc):
    return SimpleDeepFMNN(DENSE, ebc, hidden_layer_size=16, deep_fm_dimension=4)


MODELS = {"DLRM": _dlrm, "DLRM_DCN": _dcn, "DLRM_Projection": _projection, "DeepFM": _deepfm}


@pytest.mark.parametrize("name", list(MODELS))
def test_torchrec_models_take_the_collection_and_train_it(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    ebc = CachedEmbeddingBagCollection(tables=_tables(), cache=embcache.CacheConfig(capacity=16))
    assert isinstance(ebc, EmbeddingBagCollectionInterface)
    model = MODELS[name](ebc)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    before = ebc.state_dict()
    for _ in range(3):
        dense = torch.rand(B, DENSE, generator=gen)
        loss = model(dense, _kjt(gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert _rows_changed(before, ebc.state_dict()) > 0


def test_dlrm_train_wrapper_runs_a_step() -> None:
    gen = torch.Generator().manual_seed(1)
    ebc = CachedEmbeddingBagCollection(tables=_tables())
    train = DLRMTrain(_dlrm(ebc))
    batch = Batch(torch.rand(B, DENSE, generator=gen), _kjt(gen), torch.randint(0, 2, (B,)))
    loss, (_, logits, _) = train(batch)
    assert logits.shape == (B,) and torch.isfinite(loss)


def test_feature_processed_collection_weights_the_bags_by_position() -> None:
    tables = [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=16, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=16, feature_names=["f2"]),
    ]
    torch.manual_seed(3)
    ref = torchrec.EmbeddingBagCollection(tables=tables, is_weighted=True)
    ours = CachedEmbeddingBagCollection(tables=tables, is_weighted=True)
    ours.load_state_dict(ref.state_dict())
    processors = PositionWeightedModuleCollection({"f1": 5, "f2": 5})
    fp_ref = FeatureProcessedEmbeddingBagCollection(ref, processors)
    fp_ours = FeatureProcessedEmbeddingBagCollection(ours, processors)
    with torch.no_grad():
        for p in processors.parameters():
            p.copy_(torch.linspace(0.5, 2.0, p.numel()))
    kjt = _kjt(torch.Generator().manual_seed(2), keys=("f1", "f2", "f9"), rows=16)
    got, want = fp_ours(kjt), fp_ref(kjt)
    assert got.keys() == want.keys() == ["f1", "f2"]
    torch.testing.assert_close(got.values(), want.values())


def test_managed_collision_collection_remaps_into_the_collection() -> None:
    tables = [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=20, feature_names=["f1"])
    ]
    mc = MCHManagedCollisionModule(
        zch_size=20, device=torch.device("cpu"), eviction_interval=2,
        eviction_policy=DistanceLFU_EvictionPolicy(),
    )  # fmt: skip
    ebc = CachedEmbeddingBagCollection(tables=tables)
    mc_ebc = ManagedCollisionEmbeddingBagCollection(
        ebc, ManagedCollisionCollection({"t1": mc}, tables), return_remapped_features=True
    )
    raw = KeyedJaggedTensor.from_lengths_sync(
        keys=["f1"], values=torch.arange(1000, 1010), lengths=torch.ones(10, dtype=torch.int64)
    )
    for _ in range(2):
        out, remapped = mc_ebc(raw)
    assert int(remapped.values().max()) < 20  # raw ids past num_embeddings were remapped
    torch.testing.assert_close(out.values(), ebc(remapped).values())


# -- the interface -------------------------------------------------------------------------------


def test_interface_accessors_answer_as_torchrec_does() -> None:
    tables = _tables()
    ebc = CachedEmbeddingBagCollection(tables=tables, is_weighted=True)
    assert ebc.embedding_bag_configs() == tables
    assert all(a is b for a, b in zip(ebc.embedding_bag_configs(), tables, strict=True))
    assert ebc.is_weighted() is True and bool(ebc.is_weighted) and ebc.is_weighted == True  # noqa: E712
    assert ebc.device == torch.device("cpu")
    unweighted = CachedEmbeddingBagCollection(tables=tables)
    assert unweighted.is_weighted() is False and not unweighted.is_weighted
    dicts = CachedEmbeddingBagCollection(
        tables=[dict(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    )
    (cfg,) = dicts.embedding_bag_configs()
    assert (cfg.name, cfg.embedding_dim, cfg.num_embeddings, cfg.feature_names) == (
        "t", 4, 10, ["f"],
    )  # fmt: skip


def test_a_table_without_features_looks_up_its_own_name() -> None:
    cfg = EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10)
    ebc = CachedEmbeddingBagCollection(tables=[cfg])
    assert cfg.feature_names == ["t1"]  # filled in, as torchrec's collection does
    assert ebc(_kjt(torch.Generator().manual_seed(0), keys=("t1",), rows=10)).keys() == ["t1"]


def test_no_tables_is_a_collection_of_no_outputs() -> None:
    ebc = CachedEmbeddingBagCollection(tables=[])
    out = ebc(_kjt(torch.Generator().manual_seed(0)))
    assert out.keys() == [] and out.values().shape == (B, 0)
    assert ebc.state_dict() == {}
    with pytest.raises(AssertionError):  # torchrec's own check, reached as with its collection
        _dlrm(ebc)


# -- inputs ------------------------------------------------------------------------------------


def _pair(tables, weighted=False, **kwargs):
    torch.manual_seed(5)
    ref = torchrec.EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    ours = CachedEmbeddingBagCollection(tables=tables, is_weighted=weighted, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def test_keys_the_collection_does_not_look_up_are_ignored() -> None:
    ours, ref = _pair(_tables())
    kjt = _kjt(torch.Generator().manual_seed(1), keys=("f9", "f2", "f1", "f3", "f0"))
    got, want = ours(kjt), ref(kjt)
    assert got.keys() == want.keys() == ["f1", "f3", "f2"]
    torch.testing.assert_close(got.values(), want.values())


def test_weights_given_to_an_unweighted_collection_are_ignored() -> None:
    ours, ref = _pair(_tables())
    kjt = _kjt(torch.Generator().manual_seed(2), weighted=True)
    torch.testing.assert_close(ours(kjt).values(), ref(kjt).values())


def test_a_missing_feature_is_named() -> None:
    ours, _ = _pair(_tables())
    with pytest.raises(ValueError, match=r"lacks features \['f3'\]"):
        ours(_kjt(torch.Generator().manual_seed(0), keys=("f1", "f2")))


def test_variable_batch_per_feature_is_refused_with_what_to_do() -> None:
    ours, _ = _pair(_tables())
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2", "f3"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([1, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [2], [1]],
    )
    before = ours.state_dict()
    with pytest.raises(ValueError, match=r"variable batch size per feature.*pad"):
        ours(kjt)
    assert _rows_changed(before, ours.state_dict()) == 0


@pytest.mark.parametrize(
    "cache", [None, embcache.CacheConfig(capacity=4, ways=2)], ids=["all", "4"]
)
def test_one_feature_in_several_tables_gives_feature_at_table_keys(cache) -> None:
    tables = [
        EmbeddingBagConfig(
            name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1", "s"]
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=5, num_embeddings=10, feature_names=["s"]),
        EmbeddingBagConfig(
            name="t3", embedding_dim=3, num_embeddings=10, feature_names=["s"],
            pooling=PoolingType.MEAN,
        ),
    ]  # fmt: skip
    ours, ref = _pair(tables, cache=cache)
    gen = torch.Generator().manual_seed(4)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    for _ in range(3):
        kjt = _kjt(gen, keys=("s", "f1"), rows=10)
        got, want = ours(kjt), ref(kjt)
        assert got.keys() == want.keys() == ["f1", "s@t1", "s@t2", "s@t3"]
        torch.testing.assert_close(got.values(), want.values())
        for out, o in ((got, opt), (want, opt_ref)):
            o.zero_grad()
            out.values().sin().sum().backward()
            o.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v)


# -- initialisation ----------------------------------------------------------------------------


INIT_FNS = {
    "default": None,
    "normal": functools.partial(torch.nn.init.normal_, mean=0.0, std=1.5),
    "uniform": functools.partial(torch.nn.init.uniform_, a=-0.036, b=0.036),
    "constant": functools.partial(torch.nn.init.constant_, val=0.25),
}


@pytest.mark.parametrize("init", list(INIT_FNS))
def test_initial_rows_equal_torchrec_after_the_same_manual_seed(init: str) -> None:
    extra = {} if INIT_FNS[init] is None else {"init_fn": INIT_FNS[init]}
    tables = [
        EmbeddingBagConfig(
            name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"], **extra
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=5, num_embeddings=7, feature_names=["f2"]),
    ]  # fmt: skip
    torch.manual_seed(11)
    ref = torchrec.EmbeddingBagCollection(tables=tables)
    after_ref = torch.rand(4)
    torch.manual_seed(11)
    ours = CachedEmbeddingBagCollection(tables=tables)
    after_ours = torch.rand(4)
    assert torch.equal(after_ours, after_ref)  # the generator is left where torchrec leaves it
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
        assert torch.equal(ours.embedding_bags[k.split(".")[1]].weight, v), k


def test_fp16_tables_start_as_torchrec_and_save_in_half_precision() -> None:
    tables = [
        EmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=9, feature_names=["f1"],
            data_type=torchrec.DataType.FP16,
        )
    ]  # fmt: skip
    torch.manual_seed(2)
    ref = torchrec.EmbeddingBagCollection(tables=tables)
    torch.manual_seed(2)
    ours = CachedEmbeddingBagCollection(tables=tables)
    got = ours.state_dict()["embedding_bags.t1.weight"]
    assert got.dtype == torch.float16
    assert torch.equal(got, ref.state_dict()["embedding_bags.t1.weight"])
    kjt = _kjt(torch.Generator().manual_seed(0), keys=("f1",), rows=9)
    assert ours(kjt).values().dtype == torch.float32  # pooled in float32, as torchrec returns


def test_integer_data_types_are_refused() -> None:
    cfg = EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=9, feature_names=["f"],
        data_type=torchrec.DataType.INT8,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"FP32, FP16 or BF16.*INT8"):
        CachedEmbeddingBagCollection(tables=[cfg])


PARTLY = embcache.CacheConfig(capacity=64, ways=8)


def _big(init_fn=None) -> list[EmbeddingBagConfig]:
    extra = {} if init_fn is None else {"init_fn": init_fn}
    return [
        EmbeddingBagConfig(
            name="big", embedding_dim=8, num_embeddings=20_000, feature_names=["f"], **extra
        )
    ]  # fmt: skip


def test_partly_cached_tables_draw_rows_per_id_seeded_by_torch() -> None:
    torch.manual_seed(7)
    a = CachedEmbeddingBagCollection(tables=_big(INIT_FNS["normal"]), cache=PARTLY)
    torch.manual_seed(7)
    b = CachedEmbeddingBagCollection(tables=_big(INIT_FNS["normal"]), cache=PARTLY)
    c = CachedEmbeddingBagCollection(tables=_big(INIT_FNS["normal"]), cache=PARTLY)
    ids = torch.tensor([19_999, 3, 12_345])
    rows_a = a.store.get("big", ids)
    rows_b = b.store.get("big", ids.flip(0)).flip(0)  # another order of first touch
    assert torch.equal(rows_a, rows_b)
    assert not torch.equal(rows_a, c.store.get("big", ids))  # the generator moved on
    weights = a.table_rows("big")[:, :8]
    assert abs(float(weights.mean())) < 0.03 and abs(float(weights.std()) - 1.5) < 0.03


def test_partly_cached_tables_keep_the_init_distribution() -> None:
    uniform = CachedEmbeddingBagCollection(tables=_big(INIT_FNS["uniform"]), cache=PARTLY)
    w = uniform.table_rows("big")[:, :8]
    assert float(w.min()) >= -0.036 and float(w.max()) < 0.036 and float(w.std()) > 0.019
    default = CachedEmbeddingBagCollection(tables=_big(), cache=PARTLY)
    bound = (1 / 20_000) ** 0.5
    assert float(default.table_rows("big")[:, :8].abs().max()) <= bound


def test_an_unrecognised_init_fn_on_a_partly_cached_table_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'big'.*cannot be drawn row by row"):
        CachedEmbeddingBagCollection(tables=_big(torch.nn.init.xavier_uniform_), cache=PARTLY)


def test_an_explicit_seed_leaves_torchs_generator_alone() -> None:
    torch.manual_seed(0)
    a = CachedEmbeddingBagCollection(tables=_tables(), seed=3)
    after = torch.rand(2)
    torch.manual_seed(0)
    b = CachedEmbeddingBagCollection(tables=_tables(), seed=3)
    assert torch.equal(torch.rand(2), after)
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v)


# -- meta device, fx, export ------------------------------------------------------------------


def test_meta_collection_allocates_nothing_and_gives_shapes() -> None:
    store = embcache.HostKV(pin_memory=False)
    with torch.device("meta"):
        ebc = CachedEmbeddingBagCollection(
            tables=_tables(rows=10**9), store=store, is_weighted=True
        )
    assert ebc.device == torch.device("meta")
    assert ebc.embedding_bags["t1"].weight.device == torch.device("meta")
    assert ebc.embedding_bags["t1"].weight.shape == (10**9, D)
    assert store.io_stats()["rows_created"] == 0
    kjt = _kjt(torch.Generator().manual_seed(0), weighted=True).to(torch.device("meta"))
    out = ebc(kjt)
    assert out.values().shape == (B, 3 * D) and out.values().device == torch.device("meta")


def test_fx_traces_the_collection_as_one_leaf() -> None:
    ebc = CachedEmbeddingBagCollection(tables=_tables())
    model = _dlrm(ebc)
    gm = symbolic_trace(model)
    leaves = [
        n for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("bag_collection")
    ]
    assert len(leaves) == 1
    gen = torch.Generator().manual_seed(0)
    dense, kjt = torch.rand(B, DENSE, generator=gen), _kjt(gen)
    with torch.no_grad():
        torch.testing.assert_close(gm(dense, kjt), model(dense, kjt))
    with pytest.raises(TypeError, match="trace the model that holds it"):
        symbolic_trace(ebc)


def test_torch_export_records_one_lookup_op_that_calls_the_collection() -> None:
    ebc = CachedEmbeddingBagCollection(tables=_tables())
    model = _dlrm(ebc)
    gen = torch.Generator().manual_seed(0)
    dense, kjt = torch.rand(B, DENSE, generator=gen), _kjt(gen)
    ep = torch.export.export(model, (dense, kjt), strict=False)
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.embcache.pooled_lookup.default in ops
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(dense, kjt), model(dense, kjt))


def test_kjt_output_is_a_keyed_tensor() -> None:
    ours, _ = _pair(_tables())
    assert isinstance(ours(_kjt(torch.Generator().manual_seed(0))), KeyedTensor)
