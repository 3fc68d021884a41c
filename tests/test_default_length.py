"""The default training length fits the data (issue 48, item 3): on a MovieLens-format file
whose ratings follow a latent-factor model (user and item biases, 8 factors, noise; MovieLens'
star shares; heavy-tailed activity and popularity), `embcache train --data movielens:DIR` with
its defaults (a small split: batches of 256 at the learning rates times 256/1024, five passes)
does not over-train: its held-out AUC
is at least that of more passes and far above the old default's 800 steps of 1024 (which the
summary flags as over-trained), and within seed noise of a plain-torch matrix factorisation
trained to its best epoch on the same split. The real MovieLens-100K cannot be redistributed,
so no test needs it: this is its stand-in, and a partial one. Its timestamps are random, so
every held-out user has training ratings, while on the real files 71% of held-out ratings are
by users without any; there the default reaches the factorisation (benchmarks/README.md,
"MovieLens-100K"; benchmarks/movielens_defaults.py measures it). The small-split rule is also
checked at its boundary, 100 batches of 1024, with the learning rates it scales."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from embcache.cli import main
from embcache.data.movielens import MovieLens, rating_columns
from embcache.train.loop import binary_metrics

# The DLRM's default AUC moved by 0.002 over seeds 0-2 (0.7113-0.7133) on a file drawn like this
# one; the baseline's own seed noise is as large. Measured here: default 0.7057 (batches of 256
# at a quarter of the rates, five passes; two passes at the full rates gave 0.7079, one pass of
# 1024 with zip 0.7112), three passes 0.7063, MF's best 0.7077.
SEED_NOISE = 0.005


@pytest.fixture(autouse=True)
def keep_threads():
    """`embcache train` sets torch's thread count (--threads); restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def write_latent_ml_100k(
    root: Path, n_users: int = 600, n_items: int = 1000, n_ratings: int = 50_000, seed: int = 0
) -> Path:
    """An ml-100k directory whose stars come from ``bias_u + bias_i + <p_u, q_i> + noise``,
    cut at MovieLens-100K's star shares (55% rated 4 or 5), one rating per (user, item)."""
    rng = np.random.default_rng(seed)
    factors = 8
    user_bias, item_bias = rng.normal(0, 0.5, n_users + 1), rng.normal(0, 0.7, n_items + 1)
    p = rng.normal(0, factors**-0.25, (n_users + 1, factors))
    q = rng.normal(0, factors**-0.25, (n_items + 1, factors))
    activity = rng.pareto(1.5, n_users) + 1
    popularity = rng.pareto(1.2, n_items) + 1
    users = rng.choice(n_users, 2 * n_ratings, p=activity / activity.sum()) + 1
    items = rng.choice(n_items, 2 * n_ratings, p=popularity / popularity.sum()) + 1
    _, first = np.unique(users * (n_items + 1) + items, return_index=True)
    keep = np.sort(rng.permutation(first)[:n_ratings])
    users, items = users[keep], items[keep]
    score = user_bias[users] + item_bias[items] + (p[users] * q[items]).sum(1)
    score += rng.normal(0, 1.0, users.size)
    stars = 1 + np.searchsorted(np.quantile(score, [0.061, 0.175, 0.446, 0.788]), score)
    stamps = 880_000_000 + rng.permutation(users.size) * 7
    root.mkdir(parents=True, exist_ok=True)
    (root / "u.data").write_text(
        "".join(
            f"{u}\t{i}\t{s}\t{t}\n" for u, i, s, t in zip(users, items, stars, stamps, strict=True)
        )
    )
    jobs = ["artist", "doctor", "engineer", "student", "writer"]
    ages = rng.integers(7, 70, n_users + 1)
    (root / "u.user").write_text(
        "".join(
            f"{u}|{ages[u]}|{'MF'[u % 2]}|{jobs[u % 5]}|{rng.integers(10000, 99999)}\n"
            for u in range(1, n_users + 1)
        )
    )
    lines = []
    for i in range(1, n_items + 1):
        flags = ["0"] * 19
        for g in rng.choice(18, size=rng.integers(0, 4), replace=False):
            flags[g + 1] = "1"
        lines.append(f"{i}|Movie {i} (1995)|01-Jan-1995||http://x/{i}|" + "|".join(flags) + "\n")
    (root / "u.item").write_text("".join(lines), encoding="latin-1")
    return root


def matrix_factorisation_best_auc(path: Path, epochs: int = 4, dim: int = 16) -> list[float]:
    """Held-out AUC after each epoch of a plain-torch matrix factorisation with biases
    (Adam, shuffled batches of 512, BCE) on the CLI's split of ``path`` (its training
    batches, its held-out samples)."""
    data = MovieLens(path, batch_size=1024)
    train = rating_columns(itertools.islice(data.train_batches(), data.cut // 1024))
    held = rating_columns(data.eval_batches())
    torch.manual_seed(0)
    n_users, n_items = data.rows[0], data.rows[1]
    p, q = torch.nn.Embedding(n_users, dim), torch.nn.Embedding(n_items, dim)
    for table in (p, q):
        torch.nn.init.normal_(table.weight, 0, 0.1)
    bu, bi = torch.nn.Embedding(n_users, 1), torch.nn.Embedding(n_items, 1)
    for table in (bu, bi):
        torch.nn.init.zeros_(table.weight)
    mean = torch.nn.Parameter(torch.zeros(()))
    params = [p.weight, q.weight, bu.weight, bi.weight, mean]
    opt = torch.optim.Adam(params, lr=0.01)

    def logits(u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return (p(u) * q(i)).sum(1) + bu(u)[:, 0] + bi(i)[:, 0] + mean

    aucs = []
    for _ in range(epochs):
        order = torch.randperm(train[0].numel())
        for lo in range(0, order.numel(), 512):
            k = order[lo : lo + 512]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits(train[0][k], train[1][k]), train[2][k]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            aucs.append(binary_metrics(logits(held[0], held[1]), held[2])["auc"])
    return aucs


def _held_out_auc(out: str) -> float:
    found = re.search(r"^  held-out\s+AUC ([\d.]+)", out, re.MULTILINE)
    assert found, out
    return float(found[1])


@pytest.mark.slow
def test_the_default_length_does_not_over_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_latent_ml_100k(tmp_path / "ml-100k")
    argv = ["train", "--data", f"movielens:{path}", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    default = _held_out_auc(out)
    assert re.search(r"^  training\s+875 steps \(5 epochs of 175 batches\)", out, re.MULTILINE), out
    assert "over-trained" not in out
    assert main([*argv, "--epochs", "3"]) == 0
    three = _held_out_auc(capsys.readouterr().out)
    assert (
        main([*argv, "--batch-size", "1024", "--steps", "800"]) == 0
    )  # an old default: 18.6 passes
    out = capsys.readouterr().out
    old = _held_out_auc(out)
    assert "over-trained: training loss" in out, out
    baseline = matrix_factorisation_best_auc(path)
    print(f"default {default:.4f}, 3 epochs {three:.4f}, 800 steps {old:.4f}, MF by epoch "
          f"{[round(a, 4) for a in baseline]}")  # fmt: skip
    assert default >= three - 0.002
    assert default >= old + 0.03
    assert default >= max(baseline) - SEED_NOISE


class _Split:
    """A stand-in `ClickDataset` whose training split holds ``samples``: what `open_data` and
    `resolve_steps` read of one."""

    def __init__(self, samples: int, batch_size: int) -> None:
        self.samples, self.batch_size = samples, batch_size

    def train_samples(self, count: bool = False) -> int:
        return self.samples


@pytest.mark.parametrize(
    ("samples", "batch_size", "batch", "epochs", "scale"),
    [
        (102_399, None, 256, 5, 0.25),  # a small split: fewer than 100 batches of 1024
        (102_400, None, 1024, 1, 1.0),  # 100 batches: one pass of 1024, as on large data
        (102_399, 1024, 1024, 2, 1.0),  # --batch-size as given: two passes, the rates unscaled
        (102_399, 256, 256, 2, 1.0),  # the small batch, but asked for: as given
        (102_400, 256, 256, 1, 1.0),
        (2_700, None, 256, 5, 0.25),  # examples/criteo_sample.txt.gz's training split: 10 batches
        (2_700, 1024, 1024, 5, 1.0),  # 2 batches: the passes that make 20 steps, at most 5
    ],
)
def test_the_small_split_rule_at_its_boundary(
    samples: int,
    batch_size: int | None,
    batch: int,
    epochs: int,
    scale: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from embcache.cli import build_parser, settings

    monkeypatch.setattr(settings, "open_dataset", lambda spec, size, *rest: _Split(samples, size))
    argv = ["train", "--data", "movielens:x", "--no-progress"]
    args = build_parser().parse_args(
        argv if batch_size is None else [*argv, "--batch-size", str(batch_size)]
    )
    data = settings.open_data(args)
    assert data.batch_size == batch
    assert settings.resolve_steps(args, data) == epochs * (samples // batch)
    lr, dense_lr, _ = settings.run_settings(args)
    assert (lr, dense_lr) == (
        settings.DEFAULT_LR["adagrad"] * scale,
        settings.DEFAULT_DENSE_LR["adagrad"] * scale,
    )


@pytest.mark.parametrize("given", ["--lr", "--dense-lr"])
def test_a_given_learning_rate_is_not_scaled(given: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a small split's default batch, a rate given is used as given; the other default is
    still scaled (by 256/1024)."""
    from embcache.cli import build_parser, settings

    monkeypatch.setattr(settings, "open_dataset", lambda spec, size, *rest: _Split(90_000, size))
    args = build_parser().parse_args(
        ["train", "--data", "movielens:x", "--no-progress", given, "0.07"]
    )
    data = settings.open_data(args)
    assert data.batch_size == settings.SMALL_BATCH
    lr, dense_lr, _ = settings.run_settings(args)
    if given == "--lr":
        assert (lr, dense_lr) == (0.07, settings.DEFAULT_DENSE_LR["adagrad"] / 4)
    else:
        assert (lr, dense_lr) == (settings.DEFAULT_LR["adagrad"] / 4, 0.07)
