"""The README's RecStore example runs as it is written there, with RecStore's numbers."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    """The first python block of the README's "RecStore's API" section."""
    section = README.read_text().split("## RecStore's API", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found, "the README's RecStore section has no python example"
    return found[1]


def test_the_readme_example_runs_unchanged(capsys) -> None:
    ns: dict = {}
    exec(compile(_example(), str(README), "exec"), ns)
    module, emb, kv = ns["module"], ns["emb"], ns["kv"]
    assert ns["handle"].used, "the forward did not use the prefetched handle"
    assert ns["out"].values().shape == (2, 64)
    assert ns["table_name"] == "item" and torch.equal(ns["ids"], torch.tensor([7, 42, 99999]))
    assert torch.equal(ns["emb_ids"], torch.tensor([3]))
    assert module._trace == [] and emb._trace == []
    # update_async on the collection's table is its optimizer's step (SGD, lr 0.01) in the cache
    torch.testing.assert_close(kv.pull("item", ns["ids"]), ns["rows"] - 0.01 * ns["grads"])
    torch.testing.assert_close(
        kv.pull("kv", [1, 4]), torch.tensor([[-0.02, -0.04], [-0.03, -0.03]])
    )
    assert "-0.0200, -0.0400" in capsys.readouterr().out
