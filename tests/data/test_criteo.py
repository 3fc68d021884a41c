"""Criteo text: every sample parsed as the format says (checked against a plain Python reading of
each line), plain and gzip alike, split by time, streamed in order, resumable, bad lines named."""

from __future__ import annotations

import gzip
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from embcache.data.criteo import CriteoText, hex_ids, parse_lines
from tests.data.formats import criteo_lines, write_criteo, write_criteo_days

BUCKETS = 997  # a prime: ids modulo it


def expected(lines: list[str], buckets: int = BUCKETS) -> tuple[torch.Tensor, ...]:
    """(dense [n, 13], ids [n, 26], labels [n]) read the obvious way, one field at a time."""
    dense, ids, labels = [], [], []
    for line in lines:
        fields = line.rstrip("\n").split("\t")
        labels.append(float(fields[0]))
        dense.append([math.log1p(max(int(f or 0), 0)) for f in fields[1:14]])
        ids.append([int(f or "0", 16) % buckets if buckets else int(f or "0", 16)
                    for f in fields[14:]])  # fmt: skip
    return (
        torch.tensor(dense, dtype=torch.float32),
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(labels),
    )


def unpack(batches) -> tuple[torch.Tensor, ...]:
    """The batches' samples as (dense, ids [n, 26], labels), in stream order."""
    dense, ids, labels = [], [], []
    for b in batches:
        n = b.labels.numel()
        kjt = b.sparse_features
        assert kjt.keys() == [f"cat_{i}" for i in range(26)]
        assert bool((kjt.lengths() == 1).all())
        dense.append(b.dense_features)
        ids.append(kjt.values().view(26, n).T)
        labels.append(b.labels)
    return torch.cat(dense), torch.cat(ids), torch.cat(labels)


def assert_samples(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2])


def test_hex_ids_any_width_and_case() -> None:
    fields = [b"68fd1e64", b"", b"0a", b"FF", b"7fffffffffffffff"[:15], b"00000001"]
    got = hex_ids(fields, "here")
    assert got.tolist() == [int(f or b"0", 16) for f in fields]
    with pytest.raises(ValueError, match=r"here: categorical value b'12g4' is not hexadecimal"):
        hex_ids([b"12g4"], "here")


def test_parse_lines_matches_a_plain_reading() -> None:
    lines = criteo_lines(300, seed=4)
    batch = parse_lines([ln.encode() + b"\n" for ln in lines], np.full(26, BUCKETS), "f", 1)
    assert batch.dense_features.dtype == torch.float32 and batch.dense_features.shape == (300, 13)
    assert_samples(unpack([batch]), expected(lines))


def test_buckets_zero_keeps_the_raw_ids_in_unbounded_tables(tmp_path: Path) -> None:
    """buckets=0: each categorical's hex value is its id, the tables have no row count."""
    path = write_criteo(tmp_path / "raw.txt", 40, pool=500)
    data = CriteoText(path, batch_size=8, buckets=0, eval_fraction=0.2)
    assert data.rows == [None] * 26
    assert all(t.num_embeddings is None for t in data.tables(dim=4))
    assert "raw hashed ids" in data.describe()
    lines = path.read_text().splitlines()
    got = unpack(itertools.islice(data.train_batches(), 4))
    assert_samples(got, expected(lines[:32], buckets=0))
    assert int(got[1].max()) >= 2**31  # 8 hex digits: far beyond any bucket count


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_one_file_streams_every_sample_with_the_last_part_held_out(
    tmp_path: Path, gz: bool
) -> None:
    lines = criteo_lines(1000, seed=1)
    path = write_criteo(tmp_path / ("train.txt.gz" if gz else "train.txt"), 1000, seed=1, gz=gz)
    data = CriteoText(path, batch_size=64, buckets=BUCKETS, eval_fraction=0.2)
    held = unpack(data.eval_batches())
    n_eval = held[2].numel()
    assert 150 <= n_eval <= 250, n_eval  # a fifth, by bytes (plain) or by lines (gzip)
    if gz:
        assert n_eval == 200
    cut = 1000 - n_eval
    assert_samples(held, expected(lines[cut:]))
    epoch = cut // 64
    train = unpack(itertools.islice(data.train_batches(), epoch + 2))  # into the second epoch
    assert_samples(train, expected((lines[: epoch * 64] * 2)[: (epoch + 2) * 64]))
    assert "last 20% held out" in data.describe()


def test_plain_and_gzip_give_the_same_batches(tmp_path: Path) -> None:
    plain = write_criteo(tmp_path / "day", 300, seed=2)
    gz = write_criteo(tmp_path / "day.gz", 300, seed=2, gz=True)
    a, b = (CriteoText(p, batch_size=50, buckets=BUCKETS) for p in (plain, gz))
    pairs = zip(itertools.islice(a.train_batches(), 8), b.train_batches(), strict=False)
    for x, y in pairs:
        assert_samples(unpack([x]), unpack([y]))


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_day_files_hold_out_the_last_day(tmp_path: Path, gz: bool) -> None:
    root = write_criteo_days(tmp_path / "days", days=3, n=90, gz=gz)
    data = CriteoText(root, batch_size=40, buckets=BUCKETS)
    assert "day_2" in data.describe() and "last day held out" in data.describe()
    assert_samples(unpack(data.eval_batches()), expected(criteo_lines(90, seed=2)))
    # Training: days 0 and 1 in order, a batch spanning them; the last partial batch dropped.
    days01 = criteo_lines(90, seed=0) + criteo_lines(90, seed=1)
    assert_samples(unpack(itertools.islice(data.train_batches(), 4)), expected(days01[:160]))
    assert len(list(data.eval_batches(limit=2))) == 2


def test_resuming_skips_the_batches_done(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "train.txt", 400, seed=3)
    data = CriteoText(path, batch_size=32, buckets=BUCKETS)
    straight = list(itertools.islice(data.train_batches(), 20))  # 11 batches an epoch
    resumed = list(itertools.islice(data.train_batches(start=13), 7))
    for x, y in zip(straight[13:], resumed, strict=True):
        assert_samples(unpack([x]), unpack([y]))


def test_bad_lines_name_the_file_and_line(tmp_path: Path) -> None:
    lines = criteo_lines(30, seed=5)
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join([*lines[:20], "1\t2\t3", *lines[20:]]) + "\n")
    data = CriteoText(bad, batch_size=8, buckets=BUCKETS, eval_fraction=0.05)
    batches = data.train_batches()
    next(batches), next(batches)  # lines 1-16 parse
    with pytest.raises(ValueError, match=r"bad.txt line 21: expected a 0/1 label and 39 .* 3 f"):
        next(batches)
    hexbad = tmp_path / "hex.txt"
    hexbad.write_text(lines[0].rsplit("\t", 1)[0] + "\tzz\n")
    with pytest.raises(ValueError, match=r"hex.txt line 1: categorical feature C26 is b'zz', not"):
        next(CriteoText(hexbad, batch_size=1, eval_fraction=0.5).train_batches())


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        CriteoText(tmp_path / "missing.txt")
    path = write_criteo(tmp_path / "t.txt", 10)
    with pytest.raises(ValueError, match="buckets must be"):
        CriteoText(path, buckets=[5] * 3)
    with pytest.raises(ValueError, match="eval_fraction"):
        CriteoText(path, eval_fraction=1.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no Criteo day files"):
        CriteoText(tmp_path / "empty")
    tiny = CriteoText(path, batch_size=64)
    with pytest.raises(ValueError, match="fewer than one batch of 64"):
        next(tiny.train_batches())


def test_a_gzip_file_counts_its_lines_once_with_a_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(criteo_lines(50, seed=6)))  # no newline after the last line
    data = CriteoText(path, batch_size=10, eval_fraction=0.2, progress=True)
    assert sum(b.labels.numel() for b in data.eval_batches()) == 10
    assert "counting lines of x.gz" in capsys.readouterr().err


@pytest.mark.parametrize("n", [1, 2, 5, 200, 1000])
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_train_samples_counts_the_split_lines(
    tmp_path: Path, n: int, gz: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train_samples`: the lines the training split reads, counted in chunks (a byte range
    of a plain file, a line range of a gzip one); None for a large file unless asked."""
    from embcache.data import criteo

    path = write_criteo(tmp_path / "x.txt", n, gz=gz)
    for fraction in (0.1, 0.5):
        data = CriteoText(path, 1024, 500, fraction)
        for segment in data._train + data._eval:
            assert segment.count() == sum(1 for _ in segment.lines())
        assert data.train_samples() == sum(1 for s in data._train for _ in s.lines())
    monkeypatch.setattr(criteo, "_SMALL", 0)
    assert data.train_samples() is None
    assert data.train_samples(count=True) == sum(1 for s in data._train for _ in s.lines())


@pytest.mark.parametrize(
    ("column", "value"),
    [(0, "260.0"), (6, "x7"), (12, str(2**63))],
    ids=["I1-float", "I7-text", "I13-too-wide"],
)
def test_a_bad_integer_names_its_line_column_and_value(column: int, value: str) -> None:
    lines = criteo_lines(180, seed=3)
    fields = lines[41].split("\t")
    fields[1 + column] = value
    lines[41] = "\t".join(fields)
    buckets = np.full(26, BUCKETS, dtype=np.int64)
    with pytest.raises(ValueError) as info:
        parse_lines([line.encode() for line in lines], buckets, "day_0", first_line=1)
    assert str(info.value).startswith(
        f"day_0 line 42: integer feature I{column + 1} is {value.encode()!r}, not an integer"
    ), info.value


def test_a_bad_categorical_names_its_line_column_and_value() -> None:
    lines = criteo_lines(40, seed=4)
    fields = lines[17].split("\t")
    fields[1 + 13 + 4] = "0x1f"
    lines[17] = "\t".join(fields)
    buckets = np.full(26, BUCKETS, dtype=np.int64)
    said = r"^day_3 line 118: categorical feature C5 is b'0x1f', not"
    with pytest.raises(ValueError, match=said):
        parse_lines([line.encode() for line in lines], buckets, "day_3", first_line=101)
