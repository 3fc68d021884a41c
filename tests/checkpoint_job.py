"""A small training job run in a subprocess by test_checkpoint.py (fresh process, crash tests).

python tests/checkpoint_job.py resume CKPT STEPS OUT   load CKPT, train STEPS, save weights
python tests/checkpoint_job.py crash CKPT OUT          save A, dump A's weights, start B slowly
python tests/checkpoint_job.py race CKPT OUT           dump the states of A and B, then save A
                                                       and B in turn until killed
"""

from __future__ import annotations

import copy
import sys
import time

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import embcache
import embcache.checkpoint

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=500, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=6, num_embeddings=300, feature_names=["f1"]),
]


class Model(nn.Module):
    def __init__(self, tables: list[EmbeddingBagConfig] = TABLES) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sparse = embcache.CachedEmbeddingBagCollection(
            tables=tables, cache=embcache.CacheConfig(load_factor=0.05, ways=4)
        )
        self.head = nn.Linear(10, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.sparse(kjt).values()).square().mean()


def build(tables: list[EmbeddingBagConfig] = TABLES):
    model = Model(tables)
    sparse = embcache.SparseAdam([model.sparse], lr=0.01)
    dense = torch.optim.Adam(model.head.parameters(), lr=0.01)
    return model, sparse, dense


def batch(step: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, 4, (2 * 8,), generator=gen)
    limit = torch.tensor([500, 300]).repeat_interleave(8).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=gen) * limit).long()
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=values, lengths=lengths)


def train(model, sparse, dense, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        model(batch(step)).backward()
        dense.step()
        dense.zero_grad()
        sparse.step()


def weights(model, sparse) -> dict[str, torch.Tensor]:
    """Every row with its optimizer state, and the dense parameters."""
    out = {f"rows.{t.name}": model.sparse.table_rows(t.name) for t in model.sparse.tables}
    out.update({k: v.detach().clone() for k, v in model.head.state_dict().items()})
    return out


def full_state(model, sparse, dense) -> dict:
    """`weights` and both optimizers' state: all that a load sets."""
    return {
        "weights": weights(model, sparse),
        "dense_opt": copy.deepcopy(dense.state_dict()),
        "sparse_opt": sparse.hyper_state_dict(),
    }


def main(argv: list[str]) -> None:
    mode, ckpt = argv[0], argv[1]
    model, sparse, dense = build()
    if mode == "resume":
        steps, out = int(argv[2]), argv[3]
        embcache.load(ckpt, model, [sparse, dense])
        train(model, sparse, dense, start=5, steps=steps)
        torch.save(weights(model, sparse), out)
    elif mode == "crash":
        out = argv[2]
        train(model, sparse, dense, start=0, steps=5)
        embcache.save(ckpt, model, [sparse, dense])
        torch.save(weights(model, sparse), out)
        train(model, sparse, dense, start=5, steps=3)
        real_write = embcache.checkpoint.write_tensors

        def slow_write(*args, **kwargs):
            entry = real_write(*args, **kwargs)
            time.sleep(0.2)
            return entry

        embcache.checkpoint.write_tensors = slow_write
        print("saving B", flush=True)
        embcache.save(ckpt, model, [sparse, dense], chunk_rows=16)
        print("saved B", flush=True)
    elif mode == "race":
        out = argv[2]
        train(model, sparse, dense, start=0, steps=3)
        other = build()
        train(*other, start=0, steps=6)
        torch.save({"a": full_state(model, sparse, dense), "b": full_state(*other)}, out)
        embcache.save(ckpt, model, [sparse, dense], chunk_rows=16)
        print("ready", flush=True)
        while True:
            for job in (other, (model, sparse, dense)):
                embcache.save(ckpt, job[0], list(job[1:]), chunk_rows=16)


if __name__ == "__main__":
    main(sys.argv[1:])
