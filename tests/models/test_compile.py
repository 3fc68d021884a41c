"""``torch.compile`` of a model holding a `CachedEmbeddingBagCollection`.

The collection's forward is opaque to dynamo (``torch.compiler.disable``): its input checks and
cache resolve read host values, so compiling it would break the graph at each of them (33 graphs
for torchrec's DLRM). Now the model breaks once, at the lookup: torchrec's DLRM compiles to three
graphs (the dense arch, the rest of the sparse arch, the interaction and over arch), embcache's
DLRM, which looks up first, to one. Training through AOTAutograd (``aot_eager``: inductor needs a
C++ toolchain and minutes on a small CPU) gives the eager losses and tables bit for bit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn import functional
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models import dlrm as torchrec_dlrm

import embcache

B, DENSE, D, ROWS, STEPS = 4, 5, 8, 50, 4


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=D, num_embeddings=ROWS, feature_names=[f"f{i}"]
        )
        for i in range(3)
    ]


def _batches() -> list[tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    """Batches with varying bag lengths (the id count changes every step), empty bags and
    duplicate ids."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (3 * B,), generator=gen)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1", "f2"], values=values, lengths=lengths
        )
        labels = torch.randint(0, 2, (B,), generator=gen).float()
        out.append((torch.randn(B, DENSE, generator=gen), kjt, labels))
    return out


def _torchrec_dlrm() -> torchrec_dlrm.DLRM:
    torch.manual_seed(0)
    return torchrec_dlrm.DLRM(
        embedding_bag_collection=embcache.CachedEmbeddingBagCollection(_tables(), device="cpu"),
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[16, D],
        over_arch_layer_sizes=[16, 1],
    )


def _embcache_dlrm() -> embcache.DLRM:
    torch.manual_seed(0)
    return embcache.DLRM(_tables(), dense_in_features=DENSE, bottom_mlp=(16, D), top_mlp=(16,))


def _train(model: torch.nn.Module, forward) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of STEPS steps of Adagrad over ``model.parameters()`` (the collection's anchor
    included, so its tables train too), and the tables after them."""
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    losses = []
    for dense, kjt, labels in _batches():
        logits = forward(dense, kjt).reshape(-1)
        loss = functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _collection(model).state_dict()


def _collection(model: torch.nn.Module) -> embcache.CachedEmbeddingBagCollection:
    return next(m for m in model.modules() if isinstance(m, embcache.CachedEmbeddingBagCollection))


@pytest.mark.parametrize(
    ("build", "max_graphs"), [(_torchrec_dlrm, 3), (_embcache_dlrm, 1)], ids=["torchrec", "ours"]
)
def test_compiled_dlrm_breaks_once_and_trains_as_eager(build, max_graphs: int) -> None:
    torch._dynamo.reset()
    eager = build()
    eager_losses, eager_tables = _train(eager, eager)
    counter = CompileCounterWithBackend("aot_eager")
    model = build()
    compiled_losses, compiled_tables = _train(model, torch.compile(model, backend=counter))
    # Counted over every step: new id counts per batch recompile nothing.
    assert 1 <= counter.frame_count <= max_graphs
    assert compiled_losses == eager_losses
    assert compiled_tables.keys() == eager_tables.keys()
    for key, table in eager_tables.items():
        assert torch.equal(compiled_tables[key], table), key
    initial = _collection(build()).state_dict()
    assert not torch.equal(
        compiled_tables["embedding_bags.t0.weight"], initial["embedding_bags.t0.weight"]
    )  # the tables did train


def test_dynamo_explain_counts_one_break_at_the_lookup() -> None:
    torch._dynamo.reset()
    dense, kjt, _ = _batches()[0]
    explained = torch._dynamo.explain(_torchrec_dlrm())(dense, kjt)
    assert explained.graph_count <= 3
    reasons = {r.reason.splitlines()[0] for r in explained.break_reasons}
    assert reasons == {"Skip inlining `torch.compiler.disable()`d function"}, reasons


# Without torchrec, nothing loads torch._dynamo before torch.compile does: the collection's
# forward is made opaque then (`embcache.models.local.opaque_to_compile`), after the model was
# built, and the trace breaks at it exactly as when dynamo was loaded first.
LATE_DYNAMO = """
import sys, torch, embcache
assert "torch._dynamo" not in sys.modules, "embcache loaded torch._dynamo at import"
torch.manual_seed(0)
tables = [embcache.TableConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50,
                               feature_names=[f"f{i}"]) for i in range(3)]
model = embcache.DLRM(tables, dense_in_features=5, bottom_mlp=(16, 8), top_mlp=(16,))
ebc = next(m for m in model.modules() if isinstance(m, embcache.CachedEmbeddingBagCollection))
assert "torch._dynamo" not in sys.modules, "building the model loaded torch._dynamo"
from torch._dynamo.testing import CompileCounterWithBackend
assert type(ebc).forward._torchdynamo_disable
counter = CompileCounterWithBackend("aot_eager")
compiled = torch.compile(model, backend=counter)
gen = torch.Generator().manual_seed(1)
for _ in range(2):
    lengths = torch.randint(0, 4, (3 * 4,), generator=gen)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    batch = embcache.JaggedBatch.from_lengths(["f0", "f1", "f2"], values, lengths)
    dense = torch.randn(4, 5, generator=gen)
    with torch.no_grad():
        assert torch.equal(compiled(dense, batch), model(dense, batch))
print("graphs", counter.frame_count)
"""


def test_a_model_built_before_dynamo_loads_still_breaks_once() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LATE_DYNAMO], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["graphs", "1"], done.stdout
