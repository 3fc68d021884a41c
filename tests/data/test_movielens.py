"""MovieLens ml-100k and ml-1m: every rating a sample in time order, its label 4 or 5 stars, its
user's features and its movie's genres as the files say, the latest ratings held out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embcache.data.movielens import AGE_GROUPS, FEATURES, ML_1M_GENRES, MovieLens
from tests.data.formats import write_ml_1m, write_ml_100k


def _samples(data: MovieLens, batches) -> dict[str, list]:
    out: dict[str, list] = {f: [] for f in FEATURES} | {"label": []}
    for b in batches:
        assert b.dense_features.shape == (b.labels.numel(), 0)
        for f in FEATURES:
            bags = b.sparse_features[f]
            vals, lens = bags.values().tolist(), bags.lengths().tolist()
            starts = np.cumsum([0, *lens])
            out[f] += [vals[s : s + n] for s, n in zip(starts, lens, strict=False)]
        out["label"] += b.labels.tolist()
    return out


def _reference(root: Path, release: str) -> list[dict]:
    """Each rating with its features, read field by field, in time order."""
    if release == "ml-100k":
        ratings = [line.split("\t") for line in (root / "u.data").read_text().splitlines()]
        users = {
            int(x[0]): x
            for x in (ln.split("|") for ln in (root / "u.user").read_text().splitlines())
        }
        items = {
            int(x[0]): x
            for x in (
                ln.split("|") for ln in (root / "u.item").read_text(encoding="latin-1").splitlines()
            )
        }
        age = {u: int(x[1]) for u, x in users.items()}
        gender, job = ({u: x[k] for u, x in users.items()} for k in (2, 3))
        genres = {i: [g for g, flag in enumerate(x[-19:]) if flag == "1"] for i, x in items.items()}
    else:
        ratings = [line.split("::") for line in (root / "ratings.dat").read_text().splitlines()]
        users = {
            int(x[0]): x
            for x in (ln.split("::") for ln in (root / "users.dat").read_text().splitlines())
        }
        movies = [
            ln.split("::")
            for ln in (root / "movies.dat").read_text(encoding="latin-1").splitlines()
        ]
        age = {u: int(x[2]) for u, x in users.items()}
        gender, job = ({u: x[k] for u, x in users.items()} for k in (1, 3))
        genres = {int(x[0]): [ML_1M_GENRES.index(g) for g in x[2].split("|") if g] for x in movies}

    def code(values: dict) -> dict:
        order = sorted(set(values.values()))
        return {k: order.index(v) for k, v in values.items()}

    g_code, j_code = code(gender), code(job)
    rows = sorted(
        ((int(r[3]), k, int(r[0]), int(r[1]), int(r[2])) for k, r in enumerate(ratings)),
    )  # by time, then file order
    return [
        {"user": [u], "item": [i], "age": [int(np.searchsorted(AGE_GROUPS, age[u], "right"))],
         "gender": [g_code[u]], "occupation": [j_code[u]],
         "genres": genres[i], "label": float(stars >= 4)}
        for _, _, u, i, stars in rows
    ]  # fmt: skip


@pytest.mark.parametrize("release", ["ml-100k", "ml-1m"])
def test_every_rating_is_a_sample_with_its_features(tmp_path: Path, release: str) -> None:
    root = (write_ml_100k if release == "ml-100k" else write_ml_1m)(tmp_path / release)
    data = MovieLens(root, batch_size=128, eval_fraction=0.2)
    assert data.release == release and data.num_dense == 0
    reference = _reference(root, release)
    cut = round(len(reference) * 0.8)
    held = _samples(data, data.eval_batches())
    epoch = cut // 128
    train = _samples(data, (b for _, b in zip(range(epoch), data.train_batches(), strict=False)))
    for name, got, rows in (("held-out", held, reference[cut:]),
                            ("train", train, reference[: epoch * 128])):  # fmt: skip
        for key in [*FEATURES, "label"]:
            assert got[key] == [r[key] for r in rows], (name, key)
    assert any(len(g) > 1 for g in held["genres"]) and any(not g for g in train["genres"])
    tables = {t.name: t for t in data.tables(8)}
    # No zip table: its 3-character prefix acts as a second user id (the module docstring).
    assert sorted(tables) == sorted(f"t_{key}" for key in reference[0] if key != "label")
    assert str(tables["t_genres"].pooling).lower().endswith("mean")
    assert tables["t_user"].num_embeddings == max(r["user"][0] for r in reference) + 1
    assert tables["t_age"].num_embeddings == 7
    assert release in data.describe()
    resumed = next(data.train_batches(start=epoch + 1))  # the second epoch's second batch
    first = list(zip(range(2), data.train_batches(), strict=False))[1][1]
    assert torch.equal(resumed.sparse_features.values(), first.sparse_features.values())


def test_missing_files_and_users_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"neither u\.data"):
        MovieLens(tmp_path)
    root = write_ml_100k(tmp_path / "ml", n_users=10, n_ratings=200)
    lines = (root / "u.user").read_text().splitlines()
    (root / "u.user").write_text("\n".join(lines[:-1]) + "\n")  # user 10 gone
    with pytest.raises(ValueError, match="a rating's user is missing from the users file"):
        MovieLens(root)
    (root / "u.data").write_text("1\t2\tfive\t3\n")
    with pytest.raises(ValueError, match=r"u.data: a field is not an integer"):
        MovieLens(root)


def _ratings(root: Path) -> list[tuple[int, int, int, int]]:
    """``(time, file line, user, item)`` of every rating, in time order (then file order)."""
    if (root / "u.data").is_file():
        lines = [x.split("\t") for x in (root / "u.data").read_text().splitlines()]
    else:
        lines = [x.split("::") for x in (root / "ratings.dat").read_text().splitlines()]
    return sorted((int(x[3]), k, int(x[0]), int(x[1])) for k, x in enumerate(lines))


@pytest.mark.parametrize(
    ("release", "coarse"),
    [("ml-100k", False), ("ml-1m", False), ("ml-100k", True)],
    ids=["ml-100k", "ml-1m", "ml-100k-same-second"],
)
def test_history_is_the_users_ratings_strictly_before(
    tmp_path: Path, release: str, coarse: bool
) -> None:
    """`MovieLens.with_history`: each sample's history is its user's last N movies rated at an
    earlier timestamp, oldest first, in both splits; no movie of the sample's own second or
    later is in it (leak-free), and the bags are those of the data without it."""
    root = (write_ml_100k if release == "ml-100k" else write_ml_1m)(tmp_path / release)
    if coarse:  # 30 distinct seconds: many ratings of one user share a second
        lines = [x.split("\t") for x in (root / "u.data").read_text().splitlines()]
        (root / "u.data").write_text(
            "".join(f"{u}\t{i}\t{s}\t{int(t) // 700}\n" for u, i, s, t in lines)
        )
    length = 4
    plain = MovieLens(root, batch_size=128, eval_fraction=0.2)
    data = plain.with_history(length)
    assert plain.sequence_features() == {} and data.sequence_features() == {"history": "item"}
    assert "last 4 rated movies" in data.describe()
    epoch = data.cut // 128
    batches = [b for _, b in zip(range(epoch), data.train_batches(), strict=False)]
    batches += list(data.eval_batches())
    got = []
    for b in batches:
        bags = b.sparse_features["history"]
        vals, lens = bags.values().tolist(), bags.lengths().tolist()
        starts = np.cumsum([0, *lens])
        got += [vals[s : s + n] for s, n in zip(starts, lens, strict=False)]
    ratings = _ratings(root)
    samples = ratings[: epoch * 128] + ratings[data.cut :]
    stamp_of = {}  # (user, item) -> the times the user rated it
    for t, _, u, i in ratings:
        stamp_of.setdefault((u, i), []).append(t)
    for (t, _, u, _), history in zip(samples, got, strict=True):
        before = [i for t2, _, u2, i in ratings if u2 == u and t2 < t]
        assert history == before[-length:]
        assert all(min(stamp_of[u, i]) < t for i in history)  # rated before this sample
    assert any(len(h) == length for h in got) and any(not h for h in got)
    if coarse:  # a same-second neighbour is never history (checked above); the case occurs
        assert len({(t, u) for t, _, u, _ in ratings}) < len(ratings)
    first = next(plain.train_batches())
    with_history = next(data.train_batches())
    for f in FEATURES:
        assert torch.equal(
            first.sparse_features[f].values(), with_history.sparse_features[f].values()
        )
    with pytest.raises(ValueError, match="history length must be an int >= 1"):
        plain.with_history(0)
