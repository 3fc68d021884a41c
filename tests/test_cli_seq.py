"""``embcache train --model seq``: a `SequenceRecommender` on MovieLens histories (bags for the
user features, the item table unpooled for the target and the history), trained through one
`TrainPipeline`, evaluated on the held-out split, checkpointed and resumed, sharded over two
ranks; refused on data without histories."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embcache.cache.config import CacheConfig
from embcache.cli import main
from embcache.cli.job import MODELS
from embcache.data.movielens import MovieLens
from embcache.engine.inputs import JaggedBatch
from embcache.engine.tables import TableConfig
from embcache.models.sequence_model import SequenceRecommender, pad_last, target_attention
from embcache.train.loop import make_dense_optimizer, make_sparse_optimizer
from tests.data import formats

SEQ = ["--model", "seq", "--batch-size", "128", "--dim", "8", "--no-progress"]


@pytest.fixture(autouse=True)
def keep_threads():
    """`embcache train` sets torch's thread count (--threads); restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code


def _metrics(out: str) -> tuple[float, float, int]:
    """The held-out AUC, log loss and sample count of a run's summary."""
    found = re.search(r"held-out\s+AUC ([\d.]+), logloss ([\d.]+) on ([\d,]+) samples", out)
    assert found, out
    return float(found[1]), float(found[2]), int(found[3].replace(",", ""))


def test_seq_trains_on_movielens_checkpoints_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"movielens:{formats.write_ml_100k(tmp_path / 'ml-100k')}"
    ckpt = tmp_path / "ckpt"
    assert main(["train", "--data", spec, *SEQ, "--steps", "6", "--checkpoint", str(ckpt)]) == 0
    out = capsys.readouterr().out
    auc, logloss, samples = _metrics(out)
    assert 0.0 <= auc <= 1.0 and logloss > 0
    assert samples == 300  # the whole held-out 10% of 3,000 ratings
    assert "the user's last 20 rated movies" in out  # the data line
    assert re.search(r"sequences\s+--model seq: SequenceRecommender", out), out

    argv = ["train", "--data", spec, *SEQ, "--steps", "2", "--resume", str(ckpt)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"resumed\s+from \S+ at step 6 \(this run: steps 7-8\)", out), out
    argv = [a for a in argv if a not in ("--model", "seq")]  # a DLRM from a seq checkpoint
    assert _exit_code(argv) == 2
    assert "written by --model seq, this run has --model dlrm" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("data", "given"),
    [(None, "the synthetic data (no --data)"), ("criteo", "--data criteo:...")],
    ids=["synthetic", "criteo"],
)
def test_seq_needs_movielens(
    data: str | None, given: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", *SEQ, "--steps", "2"]
    if data == "criteo":
        argv += ["--data", f"criteo:{formats.write_criteo(tmp_path / 'train.txt', 300)}"]
    assert _exit_code(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--model seq reads each user's rating history, which {given} does not have" in last
    assert "it trains on movielens:PATH (an ml-100k or ml-1m directory)" in last


def test_seq_on_two_ranks_matches_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--nproc 2``: both collections sharded by row over the ranks (the MLP under
    DistributedDataParallel), each rank half of every batch; the held-out numbers are one
    process's, up to the float rounding of the split gradient."""
    spec = f"movielens:{formats.write_ml_100k(tmp_path / 'ml-100k')}"
    argv = ["train", "--data", spec, *SEQ, "--steps", "8"]
    assert main(argv) == 0
    one = _metrics(capsys.readouterr().out)
    done = subprocess.run(
        [sys.executable, "-m", "embcache.cli", *argv, "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 ranks" in done.stdout and "--model seq: SequenceRecommender" in done.stdout
    two = _metrics(done.stdout)
    assert two[2] == one[2] == 300  # every held-out sample, once
    assert abs(two[0] - one[0]) < 2e-3 and abs(two[1] - one[1]) < 2e-3, (one, two)


def test_history_sets_how_far_back_each_rating_attends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"movielens:{formats.write_ml_100k(tmp_path / 'ml-100k')}"
    assert main(["train", "--data", spec, *SEQ, "--steps", "2", "--history", "5"]) == 0
    out = capsys.readouterr().out
    assert "the user's last 5 rated movies" in out, out
    for bad, message in (
        (["--history", "0"], "--history must be >= 1, got 0"),
        (["--history", "5", "--model", "dlrm"], "--history applies to --model seq"),
    ):
        argv = ["train", "--data", spec, *SEQ, "--steps", "1", *bad]
        assert _exit_code(argv) == 2
        assert message in capsys.readouterr().err


def test_help_says_what_seq_is(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"--model {{{','.join(MODELS)}}}" in out
    assert "seq (--data movielens only): a sequence model" in out and "(default: dlrm)" in out
    assert "--history N --model seq: how many of its user's latest earlier ratings" in out


# ----------------------------------------------------------------------------------------------
# the model


def _tiny_model(seed: int = 0) -> SequenceRecommender:
    tables = [
        TableConfig(name="t_user", embedding_dim=6, num_embeddings=5, feature_names=["user"]),
        TableConfig(name="t_item", embedding_dim=6, num_embeddings=9, feature_names=["item"]),
        TableConfig(
            name="t_genres", embedding_dim=6, num_embeddings=4, feature_names=["genres"],
            pooling="mean",
        ),
    ]  # fmt: skip
    return SequenceRecommender(tables, history_length=3, cache=CacheConfig(capacity=32), seed=seed)


def _tiny_batch() -> JaggedBatch:
    """Three samples: users 1, 4, 2; target items 0, 1, 3; genres (a bag, the first empty);
    histories of 0, 4 (one more than the model keeps: item 5, the oldest, is dropped) and 2
    items; items 6, 7 and 8 are only in histories."""
    return JaggedBatch.from_lengths(
        keys=["user", "item", "genres", "history"],
        values=torch.tensor([1, 4, 2, 0, 1, 3, 2, 1, 3, 5, 6, 7, 1, 8, 1]),
        lengths=torch.tensor([1, 1, 1, 1, 1, 1, 0, 2, 1, 0, 4, 2]),
    )


def test_forward_gives_a_logit_per_sample_and_trains_both_collections() -> None:
    model = _tiny_model()
    bags, sequences = model.sparse_arch.collections()
    sparse_opt = make_sparse_optimizer("adagrad", model.sparse_arch.collections(), 0.5)
    dense_opt = make_dense_optimizer("adagrad", model.dense_parameters(), 0.1)
    user_before = bags.table_rows("t_user")[:, :6].clone()
    item_before = sequences.table_rows("t_item")[:, :6].clone()
    batch = _tiny_batch()
    logits = model(torch.zeros(3, 0), batch)
    assert logits.shape == (3,) and torch.isfinite(logits).all()
    model.loss(logits, torch.tensor([1.0, 0.0, 1.0])).backward()
    sparse_opt.step()
    dense_opt.step()
    moved = (bags.table_rows("t_user")[:, :6] != user_before).any(1)
    assert moved.tolist() == [False, True, True, False, True]  # users 1, 4, 2
    moved = (sequences.table_rows("t_item")[:, :6] != item_before).any(1)
    # The targets 0, 1, 3 and the history items kept, 6, 7, 1, 8 (not 5, which was dropped).
    assert moved.tolist() == [True, True, False, True, False, False, True, True, True]


def test_attention_over_the_latest_history_with_padding_masked() -> None:
    """`pad_last` keeps each sample's last L rows; `target_attention` is softmax attention over
    them in float64, zero without history."""
    values = torch.randn(6, 5, dtype=torch.float64)
    lengths = torch.tensor([0, 4, 2])
    padded, mask = pad_last(values, lengths, 3)
    assert mask.tolist() == [[False] * 3, [True] * 3, [True, True, False]]
    assert torch.equal(padded[1], values[1:4]) and torch.equal(padded[2, :2], values[4:6])
    assert not padded[0].any() and not padded[2, 2].any()
    target = torch.randn(3, 5, dtype=torch.float64)
    out = target_attention(target, padded, mask)
    assert not out[0].any()
    for b, rows in ((1, values[1:4]), (2, values[4:6])):
        weights = torch.softmax(rows @ target[b] / 5**0.5, dim=0)
        torch.testing.assert_close(out[b], weights @ rows)


def test_a_target_must_be_one_id_per_sample() -> None:
    model = _tiny_model()
    batch = JaggedBatch.from_lengths(
        keys=["user", "item", "genres", "history"],
        values=torch.tensor([1, 2, 3, 0]),
        lengths=torch.tensor([1, 2, 1, 0]),
    )
    with pytest.raises(ValueError, match="the target 'item' must hold one id per sample"):
        model(None, batch)
    model.sparse_arch.sequences.zero_grad()
    model.sparse_arch.bags.zero_grad()


def test_movielens_batches_feed_the_model(tmp_path: Path) -> None:
    data = MovieLens(formats.write_ml_1m(tmp_path / "ml-1m"), batch_size=64).with_history(5)
    ((history, target),) = data.sequence_features().items()
    model = SequenceRecommender(
        data.tables(8), target=target, history=history, history_length=5,
        cache=CacheConfig(load_factor=1.0),
    )  # fmt: skip
    with torch.no_grad():
        batch = next(data.eval_batches())
        assert model(batch.dense_features, batch.sparse_features).shape == (64,)
