"""The sparse optimizers' classes come from the rules' registry (issue 47: a new optimizer
touches <= 3 package files, `ops/update/rules.py` and its two kernel branches): `embcache.optim`
and `embcache` export each spec's ``sparse_class`` with no list of their own, and a rule with
no class written by hand gets one made from its spec that trains as a written one does."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import embcache
import embcache.optim
from embcache.kernels.optim_rules import RULES, OptimRule
from embcache.optim.sparse import RULE_CLASSES, RuleOptimizer, rule_class

PACKAGE = Path(embcache.__file__).parent
ROWS, DIM = 40, 5


def test_the_exports_are_the_rules_classes() -> None:
    names = [spec.sparse_class for spec in RULES.values()]
    assert list(RULE_CLASSES) == names
    assert set(embcache.optim.__all__) == {*names, "SparseOptimizer", "SparseRowWiseAdagrad"}
    assert set(names) <= set(embcache.__all__)
    for name, cls in RULE_CLASSES.items():
        assert getattr(embcache.optim, name) is cls and getattr(embcache, name) is cls


@pytest.mark.parametrize("path", ["__init__.py", "optim/__init__.py"])
def test_no_export_list_names_a_rules_class(path: str) -> None:
    """A name written out here is one more file a new rule would have to touch."""
    tree = ast.parse((PACKAGE / path).read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert not strings & {spec.sparse_class for spec in RULES.values()}


def _collection() -> embcache.CachedEmbeddingBagCollection:
    tables = [embcache.TableConfig(name="t", embedding_dim=DIM, num_embeddings=ROWS,
                                   feature_names=["f"])]  # fmt: skip
    cache = embcache.CacheConfig(capacity=8, ways=4)  # fewer slots than rows: evictions too
    return embcache.CachedEmbeddingBagCollection(tables, cache=cache, device="cpu", seed=3)


def _train(make) -> torch.Tensor:
    model = _collection()
    opt = make(model)
    gen = torch.Generator().manual_seed(7)
    for _ in range(6):
        ids = torch.randint(0, ROWS, (12,), generator=gen)
        batch = embcache.JaggedBatch.from_lengths(["f"], ids, torch.full((4,), 3))
        out = model(batch).values()
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        opt.step()
    model.flush()
    return model.table_rows("t")


@pytest.mark.parametrize("spec", RULES.values(), ids=lambda s: s.cli)
def test_each_class_applies_its_rule(spec) -> None:
    opt = RULE_CLASSES[spec.sparse_class]([_collection()], lr=0.1)
    assert opt.rule is spec.rule


def test_a_class_made_from_a_spec_trains_as_the_written_one() -> None:
    """AdaGrad's spec has every kind of parameter (hyper-parameters and ``state_init``)."""
    spec = RULES[OptimRule.ADAGRAD]
    made = rule_class(spec)
    assert made.__name__ == "SparseAdaGrad" and issubclass(made, RuleOptimizer)
    params = inspect.signature(made.__init__).parameters
    assert {k: params[k].default for k in spec.hyper} == dict(spec.hyper)
    assert params["initial_accumulator_value"].default == 0.0
    hyper = {"lr": 0.1, "eps": 1e-6, "lr_decay": 0.01, "weight_decay": 0.02,
             "initial_accumulator_value": 0.3}  # fmt: skip
    got = _train(lambda m: made([m], **hyper))
    want = _train(lambda m: embcache.SparseAdaGrad([m], **hyper))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="betas"):
        made([_collection()], lr=0.1, betas=(0.9, 0.99))
