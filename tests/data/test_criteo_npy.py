"""torchrec's preprocessed Criteo npy day files, written by torchrec's own
`BinaryCriteoUtils.tsv_to_npys`: the reader gives the same samples as the text files they came
from (ids and labels; dense as the preprocessing stored it), with torchrec's memory-mapped range
reader and without it, and holds out the last day."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from embcache.data.criteo import CriteoText
from embcache.data.criteo_npy import CriteoNpy, numpy_rows, torchrec_rows
from tests.data.formats import write_criteo_npy
from tests.data.test_criteo import assert_samples, unpack

BUCKETS = 997


@pytest.fixture(scope="module")
def npy_days(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_criteo_npy(tmp_path_factory.mktemp("npy"), days=3, n=100)


def test_same_ids_and_labels_as_the_text_it_came_from(npy_days: Path) -> None:
    npy = CriteoNpy(npy_days, batch_size=40, buckets=BUCKETS)
    text = CriteoText(npy_days / "text", batch_size=40, buckets=BUCKETS)
    got, want = unpack(npy.eval_batches()), unpack(text.eval_batches())
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    stored = np.load(npy_days / "day_2_dense.npy")
    assert torch.equal(got[0], torch.from_numpy(stored))  # dense: as preprocessed
    train = [unpack(itertools.islice(d.train_batches(), 6)) for d in (npy, text)]
    assert torch.equal(train[0][1], train[1][1]) and torch.equal(train[0][2], train[1][2])
    assert "day_2_dense.npy" in npy.describe() and "last day held out" in npy.describe()


def test_torchrec_and_numpy_readers_agree(npy_days: Path) -> None:
    reader = torchrec_rows()
    assert reader is not None, "torchrec is installed here: its reader must be used"
    assert CriteoNpy(npy_days).read is not numpy_rows
    a = CriteoNpy(npy_days, batch_size=33, buckets=BUCKETS, reader=reader)
    b = CriteoNpy(npy_days, batch_size=33, buckets=BUCKETS, reader=numpy_rows)
    pairs = zip(itertools.islice(a.train_batches(), 9), b.train_batches(), strict=False)
    for x, y in pairs:
        assert_samples(unpack([x]), unpack([y]))


def test_one_day_holds_out_its_last_rows_and_resumes(tmp_path: Path) -> None:
    root = write_criteo_npy(tmp_path, days=1, n=200)
    data = CriteoNpy(root, batch_size=30, buckets=BUCKETS, eval_fraction=0.25)
    held = unpack(data.eval_batches())
    labels = np.load(root / "day_0_labels.npy").reshape(-1)
    assert torch.equal(held[2], torch.from_numpy(labels[150:].astype(np.float32)))
    straight = list(itertools.islice(data.train_batches(), 12))  # 5 batches an epoch
    for x, y in zip(straight[7:], itertools.islice(data.train_batches(start=7), 5), strict=True):
        assert_samples(unpack([x]), unpack([y]))


def test_bad_day_files_are_named(tmp_path: Path) -> None:
    np.save(tmp_path / "day_0_dense.npy", np.zeros((5, 13), np.float32))
    with pytest.raises(ValueError, match=r"day_0_dense\.npy has no day_0_sparse\.npy"):
        CriteoNpy(tmp_path)
    np.save(tmp_path / "day_0_sparse.npy", np.zeros((5, 26), np.int64))
    np.save(tmp_path / "day_0_labels.npy", np.zeros((4, 1), np.int32))
    with pytest.raises(ValueError, match=r"day 0 should hold 5 rows .* day_0_labels.npy \(4, 1\)"):
        CriteoNpy(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        CriteoNpy(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no day_<d>_dense\.npy"):
        CriteoNpy(tmp_path / "empty")
