"""kernels/ids: fuse (with validation), unfuse and dedup against plain-Python references.

Every test runs on both backends (the torch twins and the Triton kernels, interpreted on a
machine without a GPU) through the ``backend`` fixture.
"""

from __future__ import annotations

import collections

import pytest
import torch

from embcache.hashing import mix64
from embcache.kernels.ids import dedup, dedup_grouped, fuse_ids, unfuse_ids

# Four features over three tables: two share a large table, one has a tiny table (so its last
# row is hit often), one is unbounded (-1) and only limited by fusion_k.
FEATURES = ("f0", "f1", "f2", "f3")
TABLES = ("t0", "t0", "t1", "t2")
TABLE_IDX = (0, 0, 1, 2)
NUM_EMBEDDINGS = (10_000, 10_000, 37, -1)


def _valid_values(gen: torch.Generator, lengths: list[int], fusion_k: int) -> list[int]:
    """Valid ids for each feature, with 0 and the table's last row among them."""
    values: list[int] = []
    for rows, n in zip(NUM_EMBEDDINGS, lengths, strict=True):
        limit = rows if rows >= 0 else 1 << fusion_k
        ids = torch.randint(0, limit, (n,), generator=gen).tolist()
        if n >= 2:
            ids[0], ids[-1] = 0, limit - 1
        values += ids
    return values


def _fuse_reference(values: list[int], lengths: list[int], fusion_k: int) -> list[int]:
    fused = []
    pos = 0
    for table, n in zip(TABLE_IDX, lengths, strict=True):
        fused += [v + table * 2**fusion_k for v in values[pos : pos + n]]
        pos += n
    return fused


def _fuse(
    values: torch.Tensor,
    lengths: torch.Tensor,
    fusion_k: int = 30,
    table_idx: tuple[int, ...] = TABLE_IDX,
    num_embeddings: tuple[int, ...] = NUM_EMBEDDINGS,
) -> torch.Tensor:
    return fuse_ids(
        values,
        lengths,
        torch.tensor(table_idx, device=values.device),
        torch.tensor(num_embeddings, device=values.device),
        fusion_k,
        FEATURES,
        TABLES,
    )


@pytest.mark.parametrize("fusion_k", [30, 20], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize(
    "lengths",
    [[3, 0, 5, 2], [0, 0, 0, 0], [1, 1, 1, 1], [700, 1, 300, 1200]],
    ids=["small", "all-empty", "one-each", "multi-block"],
)
def test_fuse_ids_matches_reference(
    backend: str, device: torch.device, lengths: list[int], dtype: torch.dtype, fusion_k: int
) -> None:
    gen = torch.Generator().manual_seed(sum(lengths) + fusion_k)
    values = _valid_values(gen, lengths, fusion_k)
    t_values = torch.tensor(values, dtype=dtype, device=device)
    t_lengths = torch.tensor(lengths, device=device)
    fused = _fuse(t_values, t_lengths, fusion_k)
    assert fused.dtype == torch.int64
    assert fused.tolist() == _fuse_reference(values, lengths, fusion_k)
    assert t_values.tolist() == values


def test_fuse_ids_uses_the_top_bits(backend: str, device: torch.device) -> None:
    values = torch.tensor([0, (1 << 40) - 1], device=device)
    fused = fuse_ids(
        values,
        torch.tensor([1, 1], device=device),
        torch.tensor([0, (1 << 23) - 1], device=device),
        torch.tensor([-1, -1], device=device),
        40,
        ("a", "b"),
        ("ta", "tb"),
    )
    assert fused.tolist() == [0, 2**63 - 1]
    table_idx, ids = unfuse_ids(fused, 40)
    assert table_idx.tolist() == [0, (1 << 23) - 1]
    assert ids.tolist() == [0, (1 << 40) - 1]


@pytest.mark.parametrize("fusion_k", [30, 12, 63], ids=lambda k: f"k{k}")
def test_unfuse_ids_inverts_fuse(backend: str, device: torch.device, fusion_k: int) -> None:
    gen = torch.Generator().manual_seed(fusion_k)
    n = 1500
    table_limit = 1 << min(63 - fusion_k, 20)
    ids = torch.randint(0, 1 << min(fusion_k, 62), (n,), generator=gen)
    tables = torch.randint(0, table_limit, (n,), generator=gen)
    fused = (ids | (tables << fusion_k)).to(device)
    got_tables, got_ids = unfuse_ids(fused, fusion_k)
    assert got_tables.dtype == got_ids.dtype == torch.int64
    assert got_tables.cpu().tolist() == tables.tolist()
    assert got_ids.cpu().tolist() == ids.tolist()


# (id, values for f0[1], f2 and f3, fusion_k, message): f2 is table t1 with 37 rows, f3 the
# unbounded table t2.
BAD_IDS = [
    ("negative", [5, -1, 7], 30, r"feature 'f2' \(table 't1'\): id -1 is negative"),
    ("last-row+1", [5, 37, 7], 30, r"feature 'f2' \(table 't1'\): id 37 out of range \[0, 37\)"),
    ("far-out-of-range", [5, 10**6, 7], 30, r"id 1000000 out of range \[0, 37\)"),
    (
        "overflow-k5",
        [5, 33, 1 << 40],
        5,
        r"feature 'f2' \(table 't1'\): id 33 needs more than fusion_k=5 bits",
    ),
    ("first-of-several", [-3, 99, 1 << 40], 30, r"feature 'f0' \(table 't0'\): id -3 is negative"),
]


def _bad_id_params() -> list:
    params = []
    for case_id, bad_values, fusion_k, message in BAD_IDS:
        for dtype, name in ((torch.int64, "int64"), (torch.int32, "int32")):
            if dtype == torch.int32 and any(abs(v) >= 2**31 for v in bad_values):
                continue  # the value itself cannot be written in int32
            params.append(
                pytest.param(bad_values, fusion_k, message, dtype, id=f"{case_id}-{name}")
            )
    return params


@pytest.mark.parametrize(("bad_values", "fusion_k", "message", "dtype"), _bad_id_params())
def test_fuse_ids_rejects_bad_ids(
    backend: str,
    device: torch.device,
    bad_values: list[int],
    fusion_k: int,
    message: str,
    dtype: torch.dtype,
) -> None:
    # f0: [1, bad_values[0]], f1: [2], f2: [bad_values[1]], f3: [bad_values[2]].
    values = torch.tensor([1, bad_values[0], 2, bad_values[1], bad_values[2]], dtype=dtype)
    values = values.to(device)
    lengths = torch.tensor([2, 1, 1, 1], device=device)
    before = (values.clone(), lengths.clone())
    with pytest.raises(ValueError, match=message):
        _fuse(values, lengths, fusion_k)
    assert torch.equal(values, before[0])
    assert torch.equal(lengths, before[1])


@pytest.mark.parametrize("fusion_k", [30, 12, 48], ids=lambda k: f"k{k}")
def test_fuse_ids_folds_wide_ids_of_unbounded_tables(
    backend: str, device: torch.device, fusion_k: int
) -> None:
    """An unbounded table (f3) keeps ids below 2**fusion_k and folds any other int64 (wider,
    negative: raw 64-bit hashes) into the id bits with mix64; bounded tables are untouched."""
    gen = torch.Generator().manual_seed(fusion_k)
    wide = torch.cat([
        torch.randint(-(2**62), 2**62, (300,), generator=gen),
        torch.tensor([-1, -(2**63), 2**63 - 1, 1 << fusion_k, (1 << fusion_k) - 1, 0]),
    ])  # fmt: skip
    values = torch.cat([torch.tensor([1, 2, 3, 36]), wide]).to(device)
    lengths = torch.tensor([2, 1, 1, wide.numel()], device=device)
    fused = _fuse(values, lengths, fusion_k).cpu()
    mask = (1 << fusion_k) - 1
    fits = (wide >= 0) & (wide <= mask)
    expected_ids = torch.where(fits, wide, mix64(wide) & mask)
    assert fused[:4].tolist() == _fuse_reference([1, 2, 3, 36], [2, 1, 1, 0], fusion_k)
    assert torch.equal(fused[4:], expected_ids | (TABLE_IDX[3] << fusion_k))
    assert bool((expected_ids >= 0).all()) and bool((expected_ids <= mask).all())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_fuse_ids_of_long_features_matches_reference(
    device: torch.device, dtype: torch.dtype
) -> None:
    """Features of thousands of values each, the size at which the CPU twin checks and fuses
    one feature at a time (a path the short cases above never take)."""
    lengths = [9000, 0, 300, 12000]
    gen = torch.Generator().manual_seed(7)
    values = _valid_values(gen, lengths, 30)
    t_values = torch.tensor(values, dtype=dtype, device=device)
    fused = _fuse(t_values, torch.tensor(lengths, device=device), 30)
    assert fused.dtype == torch.int64
    assert fused.tolist() == _fuse_reference(values, lengths, 30)


@pytest.mark.parametrize(
    ("where", "bad", "message"),
    [
        (5000, 10_000, r"'f0' \(table 't0'\): id 10000 out of range \[0, 10000\)"),
        (9000 + 17, 37, r"'f2' \(table 't1'\): id 37 out of range \[0, 37\)"),
        (100, -4, r"'f0' \(table 't0'\): id -4 is negative"),
    ],
    ids=["f0-over", "f2-over", "f0-negative"],
)
def test_fuse_ids_of_long_features_names_a_bad_id(
    device: torch.device, where: int, bad: int, message: str
) -> None:
    lengths = [9000, 0, 300, 12000]
    values = torch.tensor(_valid_values(torch.Generator().manual_seed(8), lengths, 30))
    values[where] = bad
    values = values.to(device)
    before = values.clone()
    with pytest.raises(ValueError, match=message):
        _fuse(values, torch.tensor(lengths, device=device), 30)
    assert torch.equal(values, before)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_fuse_ids_of_equal_features_matches_reference(
    device: torch.device, dtype: torch.dtype
) -> None:
    """Every feature with as many values (one id per bag, fixed-size bags): the CPU twin checks
    and fuses them all in one pass; a wide id of the unbounded table is still folded, and a bad
    id still named."""
    lengths = [64] * 4
    values = _valid_values(torch.Generator().manual_seed(9), lengths, 30)
    t_lengths = torch.tensor(lengths, device=device)
    fused = _fuse(torch.tensor(values, dtype=dtype, device=device), t_lengths, 30)
    assert fused.dtype == torch.int64
    assert fused.tolist() == _fuse_reference(values, lengths, 30)

    wide = torch.tensor(values)
    wide[-1] = 1 << 40  # f3's table is unbounded: folded into the id bits
    fused = _fuse(wide.to(device), t_lengths, 30)
    assert int(fused[-1]) == int(mix64(wide[-1:]) & ((1 << 30) - 1)) | (TABLE_IDX[3] << 30)
    assert fused[:-1].tolist() == _fuse_reference(values, lengths, 30)[:-1]

    bad = torch.tensor(values, dtype=dtype)
    bad[64 * 2 + 5] = 37
    with pytest.raises(ValueError, match=r"'f2' \(table 't1'\): id 37 out of range \[0, 37\)"):
        _fuse(bad.to(device), t_lengths, 30)


@pytest.mark.parametrize("features", [1, 3, 1500], ids=lambda f: f"F{f}")
def test_fuse_ids_of_many_features_matches_reference(
    backend: str, device: torch.device, features: int
) -> None:
    """Each value's feature found from the lengths (the Triton kernel searches their running
    sums; several blocks of features when F passes 1,024), many features empty, against a
    per-feature Python loop; a bad length, table index or id in a feature of the last block
    is named."""
    gen = torch.Generator().manual_seed(features)
    lengths = torch.randint(0, 4, (features,), generator=gen)
    lengths[torch.rand(features, generator=gen) < 0.3] = 0  # runs of empty features
    rows = torch.randint(5, 50, (features,), generator=gen)
    tables = torch.randint(0, 7, (features,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, int(r), (int(n),), generator=gen)
            for r, n in zip(rows, lengths, strict=True)
        ]
    )
    want, at = [], 0
    for n, t in zip(lengths.tolist(), tables.tolist(), strict=True):
        want += [v | (t << 20) for v in values[at : at + n].tolist()]
        at += n
    names = [f"f{i}" for i in range(features)]

    def fuse(v, lens, tabs):
        return fuse_ids(
            v.to(device), lens.to(device), tabs.to(device), rows.to(device), 20, names, names
        )

    assert fuse(values, lengths, tables).tolist() == want
    last = features - 1
    if int(lengths[last]) == 0:  # a bad id of the last feature needs a value there
        lengths[last] = 1
        values = torch.cat([values, torch.zeros(1, dtype=values.dtype)])
    bad_values = values.clone()
    bad_values[-1] = int(rows[last])
    with pytest.raises(ValueError, match=rf"'f{last}' \(table 'f{last}'\): id {int(rows[last])}"):
        fuse(bad_values, lengths, tables)
    bad_tables = tables.clone()
    bad_tables[last] = 1 << 43
    with pytest.raises(ValueError, match=rf"'f{last}' .*table index {1 << 43} out of range"):
        fuse(values, lengths, bad_tables)
    if features > 1:
        bad_lengths = lengths.clone()
        bad_lengths[last] = -1
        bad_lengths[0] += 2  # the same total
        with pytest.raises(ValueError, match=rf"'f{last}': negative length -1"):
            fuse(values, bad_lengths, tables)
    with pytest.raises(ValueError, match="sum to"):
        fuse(values, lengths + 1, tables)


BAD_ARGUMENTS = {
    "float-values": ({"values": [1.0, 2.0]}, TypeError, "values must be int64 or int32"),
    "sum-short": ({"lengths": [1, 0, 0, 0]}, ValueError, "sum to 1 but values has 2"),
    "sum-long": ({"lengths": [1, 1, 1, 0]}, ValueError, "sum to 3 but values has 2"),
    "negative-length": ({"lengths": [3, -1, 0, 0]}, ValueError, "'f1': negative length -1"),
    "F-mismatch": ({"lengths": [2, 0, 0]}, ValueError, "table_idx has 4 entries but .* has 3"),
    "table-idx": (
        {"table_idx": (0, 0, 1 << 33, 2)},
        ValueError,
        r"table index 8589934592 out of range \[0, 2\*\*33\)",
    ),
    "fusion-k": ({"fusion_k": 64}, ValueError, r"fusion_k=64 must be in \[0, 63\]"),
}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"), BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys()
)
def test_fuse_ids_rejects_bad_arguments(
    backend: str, device: torch.device, kwargs: dict, error: type, message: str
) -> None:
    values = torch.tensor(kwargs.get("values", [1, 2]), device=device)
    lengths = torch.tensor(kwargs.get("lengths", [2, 0, 0, 0]), device=device)
    with pytest.raises(error, match=message):
        _fuse(
            values,
            lengths,
            kwargs.get("fusion_k", 30),
            table_idx=kwargs.get("table_idx", TABLE_IDX),
        )


def _dedup_reference(ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    counts = collections.Counter(ids)
    unique = sorted(counts)
    position = {v: i for i, v in enumerate(unique)}
    return unique, [position[v] for v in ids], [counts[v] for v in unique]


@pytest.mark.parametrize(
    ("n", "low", "high"),
    [
        (0, 0, 10),
        (1, 0, 10),
        (9, 0, 3),
        (2000, 0, 50),
        (2000, -(2**62), 2**62),
        (3000, 0, 5000),
    ],
    ids=["empty", "single", "tiny-range", "many-duplicates", "wide-64bit", "multi-block"],
)
def test_dedup_matches_reference(
    backend: str, device: torch.device, n: int, low: int, high: int
) -> None:
    gen = torch.Generator().manual_seed(n + high)
    ids = torch.randint(low, high, (n,), generator=gen)
    if n > 2:
        ids[0] = ids[-1]  # a duplicate at both ends
    t_ids = ids.to(device)
    unique_ids, inverse, counts = dedup(t_ids)
    for t in (unique_ids, inverse, counts):
        assert t.dtype == torch.int64
    expected = _dedup_reference(ids.tolist())
    assert unique_ids.tolist() == expected[0]
    assert inverse.tolist() == expected[1]
    assert counts.tolist() == expected[2]
    assert torch.equal(t_ids.cpu(), ids)
    # Without counts: the same unique ids and inverse.
    unique_only, inverse_only, _ = dedup(t_ids, with_counts=False)
    assert unique_only.tolist() == expected[0]
    assert inverse_only.tolist() == expected[1]


def test_dedup_accepts_int32(backend: str, device: torch.device) -> None:
    ids = torch.tensor([2**31 - 1, -5, 7, -5, 2**31 - 1], dtype=torch.int32, device=device)
    unique_ids, inverse, counts = dedup(ids)
    assert unique_ids.dtype == inverse.dtype == counts.dtype == torch.int64
    assert unique_ids.tolist() == [-5, 7, 2**31 - 1]
    assert inverse.tolist() == [2, 0, 1, 0, 2]
    assert counts.tolist() == [2, 1, 2]


@pytest.mark.parametrize("n", [0, 1, 50, 400], ids=lambda n: f"n{n}")
def test_dedup_grouped_orders_positions_by_id(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(-(2**40), 2**40, (n,), generator=gen)
    if n > 10:
        ids[5:9] = ids[0]  # repeats
    unique_ids, inverse, order, segments = dedup_grouped(ids)
    expected = _dedup_reference(ids.tolist())
    assert unique_ids.tolist() == expected[0]
    assert inverse.tolist() == expected[1]
    assert segments.tolist()[0] == 0 and segments.tolist()[-1] == n
    assert (segments[1:] - segments[:-1]).tolist() == expected[2]
    for u in range(unique_ids.numel()):
        positions = order[segments[u] : segments[u + 1]].tolist()
        assert positions == [j for j, v in enumerate(ids.tolist()) if v == unique_ids[u]]
