"""Building a collection moves torch's generator as torchrec's does, whatever the cache size.

torchrec's ``EmbeddingBagCollection`` draws its tables' weights from torch's generator when it
is built (every table's ``normal_``, then every ``init_fn``), so the layers a model builds after
it (torchrec's DLRM: its MLPs) start from what is left. A cached collection built without a
seed makes the same draws whatever its load factor, tier or backend (`engine.row_init`): its
caches keep them as the rows when they hold every row, and otherwise drop them and draw rows per
id from a seed read without moving the generator. So after the same ``torch.manual_seed`` a DLRM
over it starts its MLPs bit for bit as torchrec's DLRM over its own collection, and an A/B of
cache sizes compares like with like.

The reference is plain torchrec in the same place: its ``EmbeddingBagCollection`` (its
``EmbeddingCollection`` for the sequence collection), built after the same seed.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.models.dlrm import DLRM

import embcache
from embcache.engine import row_init

DIM, DENSE = 6, 5
LOAD_FACTORS = (1.0, 0.5, 0.1)
TIERS = {"host": None, "bounded": 400}  # tier_capacity: rows the tier keeps per table


def _bag_tables() -> list[EmbeddingBagConfig]:
    """Non-power-of-two rows, one table with its own init_fn (a normal the hash can draw)."""
    normal = functools.partial(torch.nn.init.normal_, mean=0.1, std=0.3)
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=37, feature_names=["f0"]),
        EmbeddingBagConfig(
            name="t1", embedding_dim=DIM, num_embeddings=301, feature_names=["f1"], init_fn=normal
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=DIM, num_embeddings=1001, feature_names=["f2"]),
    ]


def _cached(load_factor: float, tier: str) -> embcache.CachedEmbeddingBagCollection:
    cache = embcache.CacheConfig(load_factor=load_factor, tier_capacity=TIERS[tier])
    return embcache.CachedEmbeddingBagCollection(_bag_tables(), cache=cache, device="cpu")


def _dlrm(ebc: torch.nn.Module) -> DLRM:
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
    )


def _dense_weights(make_ebc) -> dict[str, torch.Tensor]:
    """The initial dense weights of a DLRM built, after ``torch.manual_seed(0)``, over the
    collection ``make_ebc()`` builds."""
    torch.manual_seed(0)
    model = _dlrm(make_ebc())
    return {k: v.detach() for k, v in model.named_parameters() if not k.startswith("sparse_arch")}


def _state_after(make) -> torch.Tensor:
    torch.manual_seed(0)
    make()
    return torch.get_rng_state()


def _torchrec_ebc() -> torchrec.EmbeddingBagCollection:
    return torchrec.EmbeddingBagCollection(_bag_tables(), device=torch.device("cpu"))


@pytest.mark.parametrize("tier", list(TIERS), ids=list(TIERS))
def test_dlrm_mlps_start_as_torchrecs_at_every_cache_size(backend: str, tier: str) -> None:
    expected = _dense_weights(_torchrec_ebc)
    assert len(expected) == 8  # the bottom and top MLPs' weights and biases
    for load_factor in LOAD_FACTORS:
        got = _dense_weights(lambda lf=load_factor: _cached(lf, tier))
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            diff = float((got[name] - value).abs().max())
            assert torch.equal(got[name], value), (
                f"load factor {load_factor}, {tier} tier: {name} differs by {diff}"
            )


@pytest.mark.parametrize("tier", list(TIERS), ids=list(TIERS))
def test_the_generator_ends_where_torchrec_leaves_it(backend: str, tier: str) -> None:
    expected = _state_after(_torchrec_ebc)
    for load_factor in LOAD_FACTORS:
        state = _state_after(lambda lf=load_factor: _cached(lf, tier))
        assert torch.equal(state, expected), f"load factor {load_factor}, {tier} tier"


def test_the_sequence_collection_moves_the_generator_as_torchrecs() -> None:
    tables = [
        EmbeddingConfig(
            name=f"s{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"s{i}"]
        )
        for i, rows in enumerate((23, 257))
    ]
    expected = _state_after(
        lambda: torchrec.EmbeddingCollection(tables, device=torch.device("cpu"))
    )
    for load_factor in LOAD_FACTORS:
        cache = embcache.CacheConfig(load_factor=load_factor)
        state = _state_after(lambda c=cache: embcache.CachedEmbeddingCollection(tables, cache=c))
        assert torch.equal(state, expected), f"load factor {load_factor}"


def test_tables_too_large_to_draw_take_one_seed_at_every_cache_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torchrec's draws would not fit the device (here: a budget of no bytes), no cache
    size draws them: each takes the same one seed from the generator."""
    monkeypatch.setattr(row_init, "DRAW_MEMORY_FRACTION", 0.0)
    states = {lf: _state_after(lambda lf=lf: _cached(lf, "host")) for lf in LOAD_FACTORS}
    torch.manual_seed(0)
    torch.randint(0, 1 << 62, ())
    for load_factor, state in states.items():
        assert torch.equal(state, torch.get_rng_state()), f"load factor {load_factor}"
