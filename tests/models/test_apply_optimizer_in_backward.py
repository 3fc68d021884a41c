"""torchrec's ``apply_optimizer_in_backward`` on an unsharded cached collection (one process, no
DMP): the torch optimizer it attaches to the collection's parameter steps the rows inside
backward, as it steps torchrec's table weights, with the torch class's own defaults (Adagrad's
eps 1e-10). Against torchrec's ``EmbeddingBagCollection`` / ``EmbeddingCollection`` given the
same optimizer on the same rows and batches: outputs, tables and optimizer state agree to 1e-6,
and a reference at another lr does not. A class with no row-wise rule raises at the first
backward, naming the ones there are, with the tables unchanged.

(Under ``DistributedModelParallel`` torchrec moves the optimizer into its fused kernels, and
embcache's sharders into the cache: `tests/dmp/test_apply_optimizer_in_backward.py`.)
"""

from __future__ import annotations

import pytest
import torch
import torchrec
from torchrec import EmbeddingConfig, KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

import embcache

from .conftest import assert_close, feature_rows, random_kjt, table_configs

LR, WRONG_LR, STEPS = 0.2, 0.18, 4
CACHE = embcache.CacheConfig(capacity=8, ways=4)  # rows come and go between the steps
OPTIMIZERS = {
    "Adagrad": torch.optim.Adagrad,
    "RowWiseAdagrad": RowWiseAdagrad,
    "SGD": torch.optim.SGD,
}
SEQUENCE_TABLES = [
    EmbeddingConfig(name="s0", embedding_dim=6, num_embeddings=60, feature_names=["h0", "h1"]),
    EmbeddingConfig(name="s1", embedding_dim=6, num_embeddings=40, feature_names=["h2"]),
]


def _pair(kind: str, lr: float, cls: type) -> tuple[torch.nn.Module, torch.nn.Module]:
    """torchrec's collection and a cached one with its rows, each given ``cls`` at ``lr`` by
    ``apply_optimizer_in_backward``."""
    torch.manual_seed(0)
    ours: torch.nn.Module
    if kind == "bags":
        ref: torch.nn.Module = torchrec.EmbeddingBagCollection(tables=table_configs())
        ours = embcache.CachedEmbeddingBagCollection(table_configs(), cache=CACHE)
    else:
        ref = torchrec.EmbeddingCollection(tables=SEQUENCE_TABLES)
        ours = embcache.CachedEmbeddingCollection(SEQUENCE_TABLES, cache=CACHE)
    ours.load_state_dict(ref.state_dict())
    for m in (ref, ours):
        apply_optimizer_in_backward(cls, m.parameters(), {"lr": lr})
    return ref, ours


def _batches(kind: str) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(5)
    rows = (
        feature_rows(table_configs())
        if kind == "bags"
        else {f: t.num_embeddings for t in SEQUENCE_TABLES for f in t.feature_names}
    )
    return [random_kjt(gen, rows, batch_size=5, id_pool=20) for _ in range(STEPS)]


def _values(module: torch.nn.Module, kjt: KeyedJaggedTensor) -> torch.Tensor:
    out = module(kjt)
    if isinstance(out, dict):
        features = kjt.keys()
        return torch.cat([out[f].values() for f in features])
    return out.values()


def _train(module: torch.nn.Module, batches: list[KeyedJaggedTensor]) -> list[torch.Tensor]:
    """``loss.backward()`` only: the optimizer steps inside it."""
    outputs = []
    for kjt in batches:
        values = _values(module, kjt)
        outputs.append(values.detach().clone())
        ((values * values).sum() + values[:, ::2].sum()).backward()
    return outputs


def _torch_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The torch optimizer's sums of each torchrec table (Adagrad ``[rows, dim]``, row-wise
    ``[rows, 1]``)."""
    out = {}
    for name, p in module.named_parameters():
        (opt,) = p._in_backward_optimizers
        out[name.split(".")[-2]] = opt.state[p]["sum"]
    return out


def _max_difference(ours, ref, ours_out, ref_out) -> float:
    worst = 0.0
    for a, b in zip(ours_out, ref_out, strict=True):
        worst = max(worst, float((a - b).abs().max()))
    mine, theirs = ours.state_dict(), ref.state_dict()
    for key, value in theirs.items():
        worst = max(worst, float((mine[key] - value).abs().max()))
    return worst


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["bags", "sequence"])
def test_the_optimizer_steps_the_rows_inside_backward_as_torchs(kind: str, name: str) -> None:
    cls = OPTIMIZERS[name]
    ref, ours = _pair(kind, LR, cls)
    batches = _batches(kind)
    ref_out, ours_out = _train(ref, batches), _train(ours, batches)
    for step, (a, b) in enumerate(zip(ours_out, ref_out, strict=True)):
        assert_close(a, b, f"{kind}/{name}: output of step {step}")
    untrained = _pair(kind, LR, cls)[1].state_dict()
    for key, want in ref.state_dict().items():
        got = ours.state_dict()[key]
        assert_close(got, want, f"{kind}/{name}: {key}")
        assert not torch.equal(got, untrained[key]), f"{key}: nothing trained"
    if cls is not torch.optim.SGD:  # the sums beside each row, as torch's state holds them
        for table, want in _torch_state(ref).items():
            dim = ours.table_rows(table).shape[1] - want.shape[1]
            assert_close(ours.table_rows(table)[:, dim:], want, f"{kind}/{name}: {table} sums")
    # The comparison tells the lr apart: torchrec's collection at another lr fails it.
    wrong, _ = _pair(kind, WRONG_LR, cls)
    assert _max_difference(ours, wrong, ours_out, _train(wrong, batches)) > 1e-3


def test_the_dense_optimizer_leaves_the_collection_to_its_own() -> None:
    """torchrec's ``in_backward_optimizer_filter`` leaves the collection's parameter out of the
    dense optimizer, as it leaves torchrec's table weights."""
    ebc = embcache.CachedEmbeddingBagCollection(table_configs())
    model = torch.nn.ModuleDict({"ebc": ebc, "dense": torch.nn.Linear(3, 1)})
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": LR})
    assert sorted(dict(in_backward_optimizer_filter(model.named_parameters()))) == [
        "dense.bias",
        "dense.weight",
    ]


@pytest.mark.parametrize("kind", ["bags", "sequence"])
def test_a_class_without_a_row_rule_raises_at_the_first_backward(kind: str) -> None:
    _, ours = _pair(kind, LR, torch.optim.RMSprop)
    before = ours.state_dict()
    kjt = _batches(kind)[0]
    values = _values(ours, kjt)
    with pytest.raises(
        TypeError, match=r"RMSprop\(lr=0\.2.*no row-wise rule.*torch\.optim\.SGD"
    ) as e:
        values.sum().backward()
    assert "\n" not in str(e.value)
    for key, value in ours.state_dict().items():
        assert torch.equal(value, before[key]), key
