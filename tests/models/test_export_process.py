"""A ``torch.export`` program of a model holding a `CachedEmbeddingBagCollection` runs in another
process (issue 44, finding 9): its ``embcache::pooled_lookup`` op names the collection by
`export_name` (its tables, or a name set), so a serving process that builds the same model,
loads its weights and ``torch.export.load``s the program gets the training process's outputs.

The serving process is a subprocess; it prints its outputs' file once written, and the test
compares them with the exporting process's, bit for bit."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torchrec import KeyedJaggedTensor

import embcache

MODEL = textwrap.dedent(
    """
    import torch
    import embcache
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    TABLES = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=50,
                           feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=20, feature_names=["f2"]),
    ]

    class Model(torch.nn.Module):
        def __init__(self, name=None):
            super().__init__()
            self.ebc = embcache.CachedEmbeddingBagCollection(TABLES, device="cpu")
            if name is not None:
                self.ebc.export_name = name
            self.top = torch.nn.Linear(11, 2)

        def forward(self, kjt):
            return self.top(self.ebc(kjt).values())

    def batch():
        return KeyedJaggedTensor(
            keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 49, 7, 7, 0, 19]),
            lengths=torch.tensor([1, 2, 0, 2, 1, 1]))
    """
)

SERVE = textwrap.dedent(
    """
    import sys
    import torch
    from model import Model, batch

    name = sys.argv[3] if len(sys.argv) > 3 else None
    torch.manual_seed(123)  # other initial rows than the exporter's: the weights load below
    model = Model(name)
    model.load_state_dict(torch.load(sys.argv[1]))
    program = torch.export.load(sys.argv[2])
    with torch.no_grad():
        out = program.module()(batch())
    torch.save(out, sys.argv[1] + ".out")
    print("served", flush=True)
    """
)


def _export(tmp_path: Path, name: str | None) -> tuple[torch.Tensor, Path, Path]:
    gc.collect()  # an earlier test's collections of the same name are gone
    (tmp_path / "model.py").write_text(MODEL)
    sys.path.insert(0, str(tmp_path))
    try:
        ns: dict = {}
        exec(MODEL, ns)
    finally:
        sys.path.remove(str(tmp_path))
    torch.manual_seed(0)
    model = ns["Model"](name)
    opt = embcache.SparseSGD([model.ebc], lr=0.5)  # trained rows, not the initial ones
    model(ns["batch"]()).sum().backward()
    opt.step()
    weights, program = tmp_path / "weights.pt", tmp_path / "program.pt2"
    torch.save(model.state_dict(), weights)
    kjt: KeyedJaggedTensor = ns["batch"]()
    torch.export.save(torch.export.export(model, (kjt,), strict=False), program)
    with torch.no_grad():
        want = model(kjt)
    return want, weights, program


def _serve(tmp_path: Path, weights: Path, program: Path, *name: str) -> subprocess.CompletedProcess:
    (tmp_path / "serve.py").write_text(SERVE)
    return subprocess.run(
        [sys.executable, "serve.py", str(weights), str(program), *name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("name", [None, "user_tower"], ids=["tables", "set_name"])
def test_a_saved_program_runs_in_a_process_that_builds_the_same_model(tmp_path, name):
    want, weights, program = _export(tmp_path, name)
    done = _serve(tmp_path, weights, program, *([name] if name else []))
    assert "served" in done.stdout, done.stderr[-3000:]
    got = torch.load(str(weights) + ".out")
    assert torch.equal(got, want)


def test_a_process_without_the_collection_says_what_to_build(tmp_path):
    _, weights, program = _export(tmp_path, "user_tower")
    done = _serve(tmp_path, weights, program, "another_name")
    assert done.returncode != 0
    assert "looks up the embedding collection 'user_tower'" in done.stderr
    assert "build the model (the same tables)" in done.stderr


def test_two_live_collections_of_one_name_are_refused_at_export():
    tables = [{"name": "t0", "embedding_dim": 4, "num_embeddings": 10, "feature_names": ["f0"]}]
    a = embcache.CachedEmbeddingBagCollection(tables, device="cpu")
    b = embcache.CachedEmbeddingBagCollection(tables, device="cpu")
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="2 live collections are named"):
        torch.export.export(a, (kjt,), strict=False)
    b.export_name = "b"
    ep = torch.export.export(a, (kjt,), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(kjt).values(), a(kjt).values())
