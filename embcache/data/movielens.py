"""MovieLens ratings as click data: ``ml-100k`` (``u.data``, ``u.user``, ``u.item``) and ``ml-1m``
(``ratings.dat``, ``users.dat``, ``movies.dat``, fields separated by ``::``).

A rating is a sample whose label is ``rating >= 4``; its sparse features, each its own table:

* ``user``, ``item``: the ids as given (tables of ``max id + 1`` rows);
* ``age``: 7 groups (under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+; ml-1m's codes are these
  groups' lower bounds), ``gender``, ``occupation``, each numbered in sorted order of its values;
* ``genres``: the movie's genres, a multi-hot bag (mean-pooled).

The users file's zip code is no feature: its first three characters take 382 values for
ml-100k's 943 users, 53% of them one user's, so its rows act as a second user id. On a time
split most held-out ratings are by users with no training rating (71% on ml-100k), and a zip
row trained on a few other users hands their tastes to the newcomer: with it, the CLI's
default DLRM scores about 0.01 lower held-out AUC from the second pass on (benchmarks/README.md,
"MovieLens-100K").

No dense features. The ratings are ordered by time (stable for equal timestamps) and the last
``eval_fraction`` held out. The files are small (ml-1m: 24 MB): they are read once, with a
progress bar, and batches cut from arrays in memory.

`MovieLens.with_history` adds a sequence feature, ``history``: the movies the sample's user
rated strictly before the sample's timestamp, oldest first, the last ``length`` of them (ids of
the ``item`` table, without their stars; ratings of one second are not each other's history).
A held-out rating's history holds the user's earlier ratings whichever split they are in: what
was known before it.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from embcache.data.base import ClickDataset
from embcache.data.batch import Batch
from embcache.engine.inputs import JaggedBatch

FEATURES = ["user", "item", "age", "gender", "occupation", "genres"]
USER_FEATURES = FEATURES[2:5]  # per-user codes, looked up by user id
HISTORY = "history"  # the sequence feature `MovieLens.with_history` adds: ids of the item table
DEFAULT_HISTORY = 20  # the ratings a history keeps, the latest
AGE_GROUPS = np.array([18, 25, 35, 45, 50, 56])  # group k: ages in [bounds[k-1], bounds[k])
ML_1M_GENRES = (
    "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
    "War", "Western",
)  # fmt: skip
ML_100K_GENRES = 19  # flags at the end of each u.item line ("unknown" first)
_ENCODING = "latin-1"  # both releases' titles


def _records(path: Path, sep: str, fields: int) -> list[list[str]]:
    out = []
    for number, line in enumerate(path.read_text(encoding=_ENCODING).splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split(sep)
        if len(parts) < fields:
            raise ValueError(
                f"{path} line {number}: expected at least {fields} fields separated by "
                f"{sep!r}, got {len(parts)}: {line[:80]!r}"
            )
        out.append(parts)
    return out


def _ints(values: list[str], path: Path, what: str) -> np.ndarray:
    try:
        return np.array([int(v) for v in values], dtype=np.int64)
    except ValueError as err:
        raise ValueError(f"{path}: a {what} is not an integer ({err})") from None


def _codes(values: list[str]) -> tuple[np.ndarray, int]:
    """Each value's index among the sorted distinct values, and how many there are."""
    vocab = {v: k for k, v in enumerate(sorted(set(values)))}
    return np.array([vocab[v] for v in values], dtype=np.int64), len(vocab)


class MovieLens(ClickDataset):
    """MovieLens ml-100k or ml-1m (see the module docstring), from its directory.

    Args:
        path: the directory holding ``u.data`` (ml-100k) or ``ratings.dat`` (ml-1m).
        batch_size: samples per batch.
        eval_fraction: the share of ratings held out, the latest ones.
        progress: show a bar while the files are read.
    """

    num_dense = 0

    def __init__(
        self,
        path: str | Path,
        batch_size: int = 1024,
        eval_fraction: float = 0.1,
        progress: bool = False,
    ) -> None:
        from tqdm import tqdm

        self.path = Path(path)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        if (self.path / "u.data").is_file():
            self.release, load = "ml-100k", self._load_100k
        elif (self.path / "ratings.dat").is_file():
            self.release, load = "ml-1m", self._load_1m
        else:
            raise FileNotFoundError(
                f"{self.path}: neither u.data (ml-100k) nor ratings.dat (ml-1m) is there"
            )
        with tqdm(
            total=3, desc=f"reading {self.release}", disable=not progress, leave=False
        ) as bar:
            ratings, users, items = load(bar)
        self.batch_size = batch_size
        self.feature_names = list(FEATURES)
        self.poolings = {"genres": "mean"}
        user, item, rating, stamp = ratings
        known_users = users["age"] >= 0
        if int(user.max()) >= known_users.size or not bool(known_users[user].all()):
            raise ValueError(f"{self.path}: a rating's user is missing from the users file")
        offsets, _ = items
        if int(item.max()) + 1 >= offsets.size or not bool(self._known_items[item].all()):
            raise ValueError(f"{self.path}: a rating's movie is missing from the movies file")
        order = np.argsort(stamp, kind="stable")
        self._user, self._item, self._label = user[order], item[order], rating[order] >= 4
        self._stamp = stamp[order]
        self._users, self._genres = users, items
        n = user.size
        self.cut = round(n * (1 - eval_fraction))
        self.rows = [
            int(user.max()) + 1,
            int(item.max()) + 1,
            len(AGE_GROUPS) + 1,
            int(users["gender"].max()) + 1,
            int(users["occupation"].max()) + 1,
            self._genre_rows,
        ]
        self.eval_fraction = eval_fraction
        self.history_length = 0
        self._history: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def with_history(self, length: int = DEFAULT_HISTORY) -> MovieLens:
        """The same data whose batches also carry `HISTORY` (see the module docstring): each
        sample's user's last ``length`` movies rated strictly before it, oldest first. The
        arrays are shared with ``self``, which is left as it is."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"history length must be an int >= 1, got {length!r}")
        out = copy.copy(self)
        out.history_length = length
        out._history = _histories(self._user, self._stamp, self._item, length)
        return out

    def sequence_features(self) -> dict[str, str]:
        return {HISTORY: "item"} if self._history is not None else {}

    # -- the two releases ----------------------------------------------------------------------

    @staticmethod
    def _user_table(ids, ages, genders, occupations) -> dict[str, np.ndarray]:
        """Per-user feature codes, indexed by user id (-1 where a user id is unused)."""
        size = int(ids.max()) + 1
        table = {k: np.full(size, -1, dtype=np.int64) for k in USER_FEATURES}
        table["age"][ids] = np.searchsorted(AGE_GROUPS, ages, side="right")
        for key, values in (("gender", genders), ("occupation", occupations)):
            table[key][ids] = _codes(values)[0]
        return table

    def _load_100k(self, bar) -> tuple:
        path = self.path
        r = _records(path / "u.data", "\t", 4)
        ratings = tuple(_ints([x[k] for x in r], path / "u.data", "field") for k in range(4))
        bar.update(1)
        u = _records(path / "u.user", "|", 5)
        users = self._user_table(
            _ints([x[0] for x in u], path / "u.user", "user id"),
            _ints([x[1] for x in u], path / "u.user", "age"),
            [x[2] for x in u],
            [x[3] for x in u],
        )
        bar.update(1)
        items = _records(path / "u.item", "|", 5 + ML_100K_GENRES)
        flags = np.array([[v == "1" for v in x[-ML_100K_GENRES:]] for x in items], dtype=bool)
        item_ids = _ints([x[0] for x in items], path / "u.item", "movie id")
        self._genre_rows = ML_100K_GENRES
        bar.update(1)
        return ratings, users, self._genre_lists(item_ids, [np.nonzero(f)[0] for f in flags])

    def _load_1m(self, bar) -> tuple:
        path = self.path
        r = _records(path / "ratings.dat", "::", 4)
        ratings = tuple(_ints([x[k] for x in r], path / "ratings.dat", "field") for k in range(4))
        bar.update(1)
        u = _records(path / "users.dat", "::", 5)
        users = self._user_table(
            _ints([x[0] for x in u], path / "users.dat", "user id"),
            _ints([x[2] for x in u], path / "users.dat", "age"),
            [x[1] for x in u],
            [x[3] for x in u],
        )
        bar.update(1)
        movies = _records(path / "movies.dat", "::", 3)
        index = {g: k for k, g in enumerate(ML_1M_GENRES)}
        lists = []
        for x in movies:
            unknown = [g for g in x[-1].split("|") if g and g not in index]
            if unknown:
                raise ValueError(f"{path / 'movies.dat'}: movie {x[0]} has unknown {unknown}")
            lists.append(np.array([index[g] for g in x[-1].split("|") if g], dtype=np.int64))
        self._genre_rows = len(ML_1M_GENRES)
        bar.update(1)
        return ratings, users, self._genre_lists(_ints([x[0] for x in movies], path, "id"), lists)

    def _genre_lists(self, item_ids: np.ndarray, lists: list[np.ndarray]) -> tuple:
        """CSR of each item id's genres: ``(offsets [max id + 2], values)``."""
        self._known_items = np.zeros(int(item_ids.max()) + 1, dtype=bool)
        self._known_items[item_ids] = True
        lengths = np.zeros(int(item_ids.max()) + 2, dtype=np.int64)
        lengths[item_ids + 1] = [g.size for g in lists]
        order = np.argsort(item_ids, kind="stable")
        values = np.concatenate([lists[k] for k in order]) if lists else np.zeros(0, np.int64)
        return np.cumsum(lengths), values

    # -- batches -------------------------------------------------------------------------------

    def describe(self) -> str:
        history = (
            f" and the user's last {self.history_length} rated movies"
            if self._history is not None
            else ""
        )
        return (
            f"MovieLens {self.release} {self.path}: {self._user.size:,} ratings (label: 4 or "
            f"5 stars), {len(FEATURES)} sparse features{history}, last "
            f"{self.eval_fraction:.0%} by time held out, batch {self.batch_size}"
        )

    def _batch(self, lo: int, hi: int) -> Batch:
        user, item = self._user[lo:hi], self._item[lo:hi]
        offsets, values = self._genres
        lengths = offsets[item + 1] - offsets[item]
        genres = values[_ranges(offsets[item], lengths)]
        singles = [user, item, *(self._users[k][user] for k in USER_FEATURES)]
        b = hi - lo
        keys, bags = list(FEATURES), [*singles, genres]
        sizes = [np.ones(len(singles) * b, np.int64), lengths]
        if self._history is not None:
            items, starts, counts = self._history
            keys.append(HISTORY)
            bags.append(items[_ranges(starts[lo:hi], counts[lo:hi])])
            sizes.append(counts[lo:hi])
        sparse = JaggedBatch.from_lengths(
            keys=keys,
            values=torch.from_numpy(np.concatenate(bags)),
            lengths=torch.from_numpy(np.concatenate(sizes)),
        )
        labels = torch.from_numpy(self._label[lo:hi].astype(np.float32))
        return Batch(torch.zeros(b, 0), sparse, labels)

    def train_samples(self, count: bool = False) -> int | None:
        return self.cut

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        full = self.cut // self.batch_size
        if not full:
            raise ValueError(
                f"{self.path}: the training split holds {self.cut} ratings, fewer than one "
                f"batch of {self.batch_size}"
            )
        for i in itertools.count(start):
            lo = (i % full) * self.batch_size
            yield self._batch(lo, lo + self.batch_size)

    def eval_batches(self, limit: int | None = None) -> Iterator[Batch]:
        starts = range(self.cut, self._user.size, self.batch_size)
        for lo in itertools.islice(starts, limit):
            yield self._batch(lo, min(lo + self.batch_size, self._user.size))


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices ``starts[k], ..., starts[k] + lengths[k] - 1`` of every k, one after another."""
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within


def _histories(
    user: np.ndarray, stamp: np.ndarray, item: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each rating's history, for ratings in time order (``user``, ``stamp``, ``item`` ``[n]``):
    the items of its user's ratings with an earlier timestamp, the last ``length``.

    Returns:
        ``(items, starts, counts)``: ``items`` ``[n]`` the items grouped by user, each user's in
        time order; rating ``i``'s history is ``items[starts[i] : starts[i] + counts[i]]``.
    """
    by_user = np.argsort(user, kind="stable")  # [n]: each user's ratings, in time order
    u, t = user[by_user], stamp[by_user]
    position = np.arange(u.size)
    new_user = np.ones(u.size, dtype=bool)
    new_user[1:] = u[1:] != u[:-1]
    new_second = new_user.copy()
    new_second[1:] |= t[1:] != t[:-1]
    first_of_user = np.maximum.accumulate(np.where(new_user, position, 0))
    # Ratings of the same user and second: none is before another, so each one's history ends
    # where the first of them is.
    end = np.maximum.accumulate(np.where(new_second, position, 0))
    start = np.maximum(first_of_user, end - length)
    starts, counts = np.empty_like(start), np.empty_like(start)
    starts[by_user], counts[by_user] = start, end - start
    return item[by_user], starts, counts


def rating_columns(batches: Iterable[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``(user, item, label)`` columns of MovieLens batches, each ``[N]``, joined: what a
    plain matrix factorisation over the same samples trains on (`benchmarks/
    movielens_defaults.py`, the default-length tests)."""
    users, items, labels = [], [], []
    for batch in batches:
        users.append(batch.sparse_features["user"].values())
        items.append(batch.sparse_features["item"].values())
        labels.append(batch.labels)
    return torch.cat(users), torch.cat(items), torch.cat(labels)
