"""`ShardedEmbeddingBagCollection` takes the unsharded collection's arguments and trains the
torchrec ways (issue 44, finding 8), on 2 gloo ranks against torchrec on one process.

* every argument of `CachedEmbeddingBagCollection` is accepted (``optimizer_type``,
  ``optimizer_kwargs``, ``location``, ``allow_unsharded_replicas``);
* built without a seed after ``torch.manual_seed(7)`` on every rank, its rows equal
  torchrec's ``EmbeddingBagCollection``'s (and the unsharded collection's) bit for bit;
* ``torch.optim.Adagrad(sharded.parameters())`` updates the rows as torch's Adagrad updates
  torchrec's weights on the concatenated batch; ``optimizer_type=torch.optim.Adagrad`` does the
  same inside backward; ``torch.optim.Adam`` (no row-wise equivalent) is refused at its first
  step, rows unchanged.

Each rank's loss is ``sum(pooled ** 2)`` of its own batch; the reference's is the same sum
over the concatenated batch, so both see the same gradients (summed per rank first: float32
tolerance).
"""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import embcache
from embcache.distributed.launch import spawn
from embcache.distributed.sharded import ShardedEmbeddingBagCollection

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=37, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(
        name="t1", embedding_dim=6, num_embeddings=23, feature_names=["f2"],
        pooling=PoolingType.MEAN,
    ),
]  # fmt: skip
FEATURES = {"f0": 37, "f1": 37, "f2": 23}
STEPS, LR, EPS, SEED = 3, 0.1, 1e-10, 7
KEYS = ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]


def _parts(step: int, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    B = 3 + rank
    parts = {}
    for f, rows in FEATURES.items():
        lengths = torch.randint(0, 4, (B,), generator=gen)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        if values.numel() >= 2:
            values[1] = values[0]  # a duplicate id
        parts[f] = (lengths, values)
    return parts


def _kjt(ranks: list[int], step: int) -> KeyedJaggedTensor:
    lengths, values = [], []
    for f in FEATURES:
        for r in ranks:
            ln, v = _parts(step, r)[f]
            lengths.append(ln)
            values.append(v)
    return KeyedJaggedTensor(
        keys=list(FEATURES), values=torch.cat(values), lengths=torch.cat(lengths)
    )


def _train(module: torch.nn.Module, opt: torch.optim.Optimizer | None, ranks: list[int]) -> None:
    for step in range(STEPS):
        module(_kjt(ranks, step)).values().square().sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()


def _worker(rank: int) -> dict:
    out: dict = {}
    torch.manual_seed(SEED)
    ebc = ShardedEmbeddingBagCollection(TABLES, device="cpu")  # no seed: torch's generator
    out["initial"] = ebc.state_dict()

    adam = torch.optim.Adam(ebc.parameters(), lr=LR)
    ebc(_kjt([rank], 0)).values().sum().backward()
    try:
        adam.step()
    except TypeError as e:
        out["adam"] = str(e)
    adam.zero_grad()
    out["after_adam"] = ebc.state_dict()

    opt = torch.optim.Adagrad(ebc.parameters(), lr=LR, eps=EPS)
    _train(ebc, opt, [rank])
    out["torch_adagrad"] = ebc.state_dict()

    torch.manual_seed(SEED)
    fused = ShardedEmbeddingBagCollection(
        TABLES,
        device="cpu",
        optimizer_type=torch.optim.Adagrad,
        optimizer_kwargs={"lr": LR, "eps": EPS},
        location=None,
        allow_unsharded_replicas=False,
    )
    _train(fused, None, [rank])
    out["fused"] = fused.state_dict()
    out["fused_type"] = fused.optimizer_type()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return spawn(_worker, 2, timeout=60)


def _reference() -> tuple[dict, dict]:
    torch.manual_seed(SEED)
    ebc = EmbeddingBagCollection(TABLES)
    initial = {k: v.clone() for k, v in ebc.state_dict().items()}
    _train(ebc, torch.optim.Adagrad(ebc.parameters(), lr=LR, eps=EPS), [0, 1])
    return initial, ebc.state_dict()


def test_initial_rows_are_torchrecs_and_the_unsharded_collections(runs):
    initial, _ = _reference()
    torch.manual_seed(SEED)
    local = embcache.CachedEmbeddingBagCollection(TABLES, device="cpu").state_dict()
    for run in runs:
        for k in KEYS:
            assert torch.equal(run["initial"][k], initial[k]), k
            assert torch.equal(run["initial"][k], local[k]), k


def test_torch_optimizer_over_parameters_updates_the_rows(runs):
    _, trained = _reference()
    for rank, run in enumerate(runs):
        for k in KEYS:
            assert not torch.equal(run["torch_adagrad"][k], run["initial"][k]), (rank, k)
            torch.testing.assert_close(run["torch_adagrad"][k], trained[k], rtol=1e-5, atol=1e-6)


def test_optimizer_type_is_accepted_and_applied_in_backward(runs):
    _, trained = _reference()
    for run in runs:
        assert run["fused_type"] is torch.optim.Adagrad
        for k in KEYS:
            torch.testing.assert_close(run["fused"][k], trained[k], rtol=1e-5, atol=1e-6)


def test_an_optimizer_without_a_row_rule_is_refused_and_changes_nothing(runs):
    for run in runs:
        assert "Adam" in run["adam"] and "moves every row" in run["adam"], run["adam"]
        for k in KEYS:
            assert torch.equal(run["after_adam"][k], run["initial"][k]), k
