"""Small files in each real format the readers take, with labels that depend on the features
(so that training can be seen to learn): Criteo text (plain, gzip, day files), torchrec's
preprocessed Criteo npy day files, MovieLens ml-100k and ml-1m."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

NUM_INT, NUM_CAT = 13, 26
POOL = 40  # distinct hex values per categorical feature


def criteo_lines(n: int, seed: int, pool: int = POOL) -> list[str]:
    """``n`` Criteo text lines: label, 13 counts, 26 hex categoricals (some fields empty),
    each drawn Zipf(1.3) from ``pool`` values. Labels follow one logistic model (of cat_0,
    cat_3 and the first count) for every seed; the seed draws the samples."""
    model = np.random.default_rng(1234)
    values = model.integers(0, 2**32, size=(NUM_CAT, pool), dtype=np.uint64)  # feature pools
    effect = model.normal(0.0, 1.5, size=(NUM_CAT, pool))
    rng = np.random.default_rng(seed)
    picks = np.minimum(rng.zipf(1.3, size=(n, NUM_CAT)) - 1, pool - 1)
    counts = rng.poisson(3.0, size=(n, NUM_INT)) - (rng.random((n, NUM_INT)) < 0.05)  # some -1
    logit = (
        effect[0, picks[:, 0]]
        + effect[3, picks[:, 3]]
        + 0.4 * np.log1p(np.maximum(counts[:, 0], 0))
        - 1.0
    )
    labels = rng.random(n) < 1.0 / (1.0 + np.exp(-logit))
    lines = []
    for i in range(n):
        dense = ["" if rng.random() < 0.08 else str(c) for c in counts[i]]
        cats = [
            "" if rng.random() < 0.05 else f"{int(values[t, picks[i, t]]):08x}"
            for t in range(NUM_CAT)
        ]
        lines.append("\t".join([str(int(labels[i])), *dense, *cats]))
    return lines


def write_criteo(path: Path, n: int, seed: int = 0, gz: bool = False, pool: int = POOL) -> Path:
    text = "\n".join(criteo_lines(n, seed, pool)) + "\n"
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def write_criteo_days(root: Path, days: int, n: int, gz: bool = False) -> Path:
    """``root/day_0 .. day_<days-1>`` (``.gz`` when ``gz``), ``n`` lines each."""
    root.mkdir(parents=True, exist_ok=True)
    for d in range(days):
        write_criteo(root / (f"day_{d}.gz" if gz else f"day_{d}"), n, seed=d, gz=gz)
    return root


def write_criteo_npy(root: Path, days: int, n: int) -> Path:
    """torchrec's preprocessing of Criteo text day files: ``day_<d>_{dense,sparse,labels}.npy``
    written by ``BinaryCriteoUtils.tsv_to_npys`` itself."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    text = write_criteo_days(root / "text", days, n)
    for d in range(days):
        BinaryCriteoUtils.tsv_to_npys(
            str(text / f"day_{d}"),
            str(root / f"day_{d}_dense.npy"),
            str(root / f"day_{d}_sparse.npy"),
            str(root / f"day_{d}_labels.npy"),
        )
    return root


def _movielens(n_users: int, n_items: int, n_ratings: int, seed: int) -> tuple:
    """Users, items with genres, and ratings whose stars follow user and item effects."""
    rng = np.random.default_rng(seed)
    user_bias = rng.normal(0, 1.0, n_users + 1)
    item_bias = rng.normal(0, 1.0, n_items + 1)
    users = rng.integers(1, n_users + 1, n_ratings)
    items = np.minimum(rng.zipf(1.2, n_ratings), n_items)
    noise = rng.normal(0, 0.5, n_ratings)
    stars = np.clip(np.round(3.3 + user_bias[users] + item_bias[items] + noise), 1, 5)
    stamps = 880_000_000 + rng.permutation(n_ratings) * 7  # shuffled times: the reader sorts
    ages = rng.integers(7, 70, n_users + 1)
    genres = [rng.choice(18, size=rng.integers(0, 4), replace=False) for _ in range(n_items + 1)]
    return rng, users, items, stars.astype(int), stamps, ages, genres


def write_ml_100k(root: Path, n_users: int = 60, n_items: int = 80, n_ratings: int = 3000) -> Path:
    rng, users, items, stars, stamps, ages, genres = _movielens(n_users, n_items, n_ratings, 1)
    root.mkdir(parents=True, exist_ok=True)
    (root / "u.data").write_text(
        "".join(
            f"{u}\t{i}\t{s}\t{t}\n" for u, i, s, t in zip(users, items, stars, stamps, strict=True)
        )
    )
    jobs = ["artist", "doctor", "engineer", "student", "writer"]
    (root / "u.user").write_text(
        "".join(
            f"{u}|{ages[u]}|{'MF'[u % 2]}|{jobs[u % 5]}|{rng.integers(10000, 99999)}\n"
            for u in range(1, n_users + 1)
        )
    )
    rows = []
    for i in range(1, n_items + 1):
        flags = ["0"] * 19
        for g in genres[i]:
            flags[g + 1] = "1"
        rows.append(f"{i}|Movie {i} (1995)|01-Jan-1995||http://x/{i}|" + "|".join(flags) + "\n")
    (root / "u.item").write_text("".join(rows), encoding="latin-1")
    return root


def write_ml_1m(root: Path, n_users: int = 60, n_items: int = 80, n_ratings: int = 3000) -> Path:
    from embcache.data.movielens import ML_1M_GENRES

    rng, users, items, stars, stamps, _, genres = _movielens(n_users, n_items, n_ratings, 2)
    root.mkdir(parents=True, exist_ok=True)
    (root / "ratings.dat").write_text(
        "".join(
            f"{u}::{i}::{s}::{t}\n" for u, i, s, t in zip(users, items, stars, stamps, strict=True)
        )
    )
    codes = [1, 18, 25, 35, 45, 50, 56]
    (root / "users.dat").write_text(
        "".join(
            f"{u}::{'MF'[u % 2]}::{codes[u % 7]}::{u % 21}::{rng.integers(10000, 99999)}\n"
            for u in range(1, n_users + 1)
        )
    )
    (root / "movies.dat").write_text(
        "".join(
            f"{i}::Movie {i} (1995)::{'|'.join(ML_1M_GENRES[g] for g in genres[i])}\n"
            for i in range(1, n_items + 1)
        ),
        encoding="latin-1",
    )
    return root
