"""An unsharded collection on several ranks: refused, never silently divergent.

torchrec's ``DistributedModelParallel`` finds no sharder for a `CachedEmbeddingBagCollection`
(an empty plan) and wraps the model in ``DistributedDataParallel``, which averages only the dense
parameters: each rank would train its own copy of the tables. The collection's forward refuses
to run in a process group of more than one rank, naming
`embcache.distributed.ShardedEmbeddingBagCollection` and the opt-out
(``allow_unsharded_replicas=True``); a process group of one rank runs as before.

The ranks are spawned here (gloo on CPU): one spawn of two ranks for the refusals and the
opt-out, one of a single rank.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models import dlrm as torchrec_dlrm

import embcache
from embcache.distributed.launch import spawn

pytestmark = pytest.mark.slow  # each spawn starts fresh interpreters that import torchrec

B, DENSE, D, ROWS = 4, 5, 8, 40


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=D, num_embeddings=ROWS, feature_names=[f"f{i}"]
        )
        for i in range(3)
    ]


def _batch(rank: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 3, (3 * B,), generator=gen)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=values, lengths=lengths
    )
    return torch.rand(B, DENSE, generator=gen), kjt, torch.randint(0, 2, (B,), generator=gen)


def _torchrec_dlrm(**collection_kwargs) -> torchrec_dlrm.DLRM:
    torch.manual_seed(0)
    ebc = embcache.CachedEmbeddingBagCollection(_tables(), device="cpu", **collection_kwargs)
    return torchrec_dlrm.DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[16, D],
        over_arch_layer_sizes=[16, 1],
    )


def _step(model: torch.nn.Module, rank: int) -> float:
    dense, kjt, labels = _batch(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        model(dense, kjt).squeeze(-1), labels.float()
    )
    loss.backward()
    opt.step()
    return float(loss)


def _refusal(make) -> str:
    """The message of the RuntimeError raised building ``make()`` or at its first step."""
    try:
        _step(make(), torch.distributed.get_rank())
    except RuntimeError as e:
        return str(e)
    return "no error"


def _worker(rank: int) -> dict:
    cpu = torch.device("cpu")
    out = {
        "dmp": _refusal(lambda: DistributedModelParallel(_torchrec_dlrm(), device=cpu)),
        "ddp": _refusal(
            lambda: DistributedDataParallel(
                embcache.DLRM(_tables(), dense_in_features=DENSE, bottom_mlp=(D,))
            )
        ),
    }
    replicas = DistributedDataParallel(_torchrec_dlrm(allow_unsharded_replicas=True))
    out["replica_loss"] = _step(replicas, rank)
    return out


def _single_rank_worker(rank: int) -> float:
    return _step(DistributedModelParallel(_torchrec_dlrm(), device=torch.device("cpu")), rank)


def test_dmp_and_ddp_over_an_unsharded_collection_on_two_ranks_are_refused() -> None:
    results = spawn(_worker, 2, timeout=60)
    for rank, r in enumerate(results):
        for wrapper in ("dmp", "ddp"):
            message = r[wrapper]
            assert "embcache.distributed.ShardedEmbeddingBagCollection" in message, (
                rank,
                wrapper,
                message,
            )
            assert "embcache train --nproc" in message
            assert "allow_unsharded_replicas=True" in message
        assert r["replica_loss"] > 0  # the opt-out trains one replica per rank


def test_a_process_group_of_one_rank_trains_as_one_process() -> None:
    (loss,) = spawn(_single_rank_worker, 1, timeout=60)
    assert loss > 0
