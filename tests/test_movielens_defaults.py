"""benchmarks/movielens_defaults.py's plumbing on a tiny ml-100k-shaped directory (the real
MovieLens-100K is not redistributable; its figures are in benchmarks/README.md): one row per
seed with embcache's run and the baseline's epochs, the CSV and PNG where asked, and clear
refusals."""

from __future__ import annotations

import csv
import importlib
import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.data.formats import write_ml_100k

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The script imported as a module (its folder first on the path, as when it runs), torch's
    thread count restored afterwards (`embcache train` sets it)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    threads = torch.get_num_threads()
    yield importlib.import_module("movielens_defaults")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ml_100k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ml_100k(tmp_path_factory.mktemp("ml") / "ml-100k")


def test_rows_csv_and_plot(
    script: ModuleType, ml_100k: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rows = script.main(["--data", str(ml_100k), "--seeds", "0,1", "--mf-epochs", "3",
                        "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert [r.seed for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r.embcache_auc <= 1.0 and r.embcache_steps > 0 and r.embcache_epochs
        assert len(r.mf_aucs.split()) == 3 and 1 <= r.mf_best_epoch <= 3
        assert math.isclose(r.mf_best_auc, max(map(float, r.mf_aucs.split())), abs_tol=1e-4)
    assert "| seed | embcache AUC |" in printed and "| mean |" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "movielens_defaults.csv",
        "movielens_defaults.png",
    ]
    with (out / "movielens_defaults.csv").open() as f:
        written = list(csv.DictReader(f))
    assert [int(w["seed"]) for w in written] == [0, 1]
    assert float(written[0]["auc_vs_mf"]) == pytest.approx(rows[0].auc_vs_mf)
    assert (out / "movielens_defaults.png").stat().st_size > 0


def test_the_baseline_learns(script: ModuleType) -> None:
    """Labels that the user and item ids decide: the matrix factorisation ranks them."""
    gen = torch.Generator().manual_seed(0)
    users, items = torch.randint(0, 30, (4000,), generator=gen), torch.randint(0, 40, (4000,))
    labels = ((users % 2) ^ (items % 3 == 0)).float()
    aucs = script.train_mf(
        (users[:3000], items[:3000], labels[:3000]),
        (users[3000:], items[3000:], labels[3000:]),
        n_users=30,
        n_items=40,
        epochs=8,
        seed=0,
    )
    assert max(aucs) > 0.9, aucs


def test_refusals(script: ModuleType, ml_100k: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"{tmp_path}: no u\.data there"):
        script.main(["--data", str(tmp_path)])
    with pytest.raises(ValueError, match="benchmarks/results/ holds committed results"):
        script.main(["--data", str(ml_100k), "--out", str(BENCHMARKS / "results")])
    with pytest.raises(ValueError, match=r"--embcache-args: \['--seed'\] is set by this script"):
        script.main(["--data", str(ml_100k), "--embcache-args", "--seed 3"])
