"""DistTensor: rows of a KV tensor by index (RecStore/DGL style).

Get/set round trip, declarations by name (same shape attaches, another shape or dtype is
refused), ids checked, DGL-style ``init_func(shape, dtype)``, and a default initialiser that
does not depend on the order rows are first read.
"""

from __future__ import annotations

import pytest
import torch

import embcache


def _client() -> embcache.KVClient:
    return embcache.get_kv_client()


@pytest.mark.parametrize("ids_shape", [(7,), (2, 3)], ids=["1d", "2d"])
def test_dist_tensor_set_then_get(ids_shape: tuple[int, ...]) -> None:
    t = embcache.DistTensor((40, 5), torch.float32, name="rt")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(40, generator=gen)[: torch.Size(ids_shape).numel()].reshape(ids_shape)
    rows = torch.randn(*ids_shape, 5, generator=gen)
    t[ids] = rows
    got = t[ids]
    assert got.shape == (*ids_shape, 5)
    assert torch.equal(got, rows)
    # duplicates and the last row in a read
    again = t[torch.tensor([int(ids.flatten()[0]), int(ids.flatten()[0]), 39])]
    assert torch.equal(again[0], rows.reshape(-1, 5)[0])
    assert torch.equal(again[1], again[0])
    assert len(t) == 40


def test_dist_tensor_same_name_attaches_to_the_same_rows() -> None:
    a = embcache.DistTensor((10, 3), torch.float32, name="shared")
    b = embcache.DistTensor((10, 3), torch.float32, name="shared")
    a[torch.tensor([4])] = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(b[torch.tensor([4])], torch.tensor([[1.0, 2.0, 3.0]]))


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((10, 4), torch.float32), ((11, 3), torch.float32), ((10, 3), torch.float64)],
    ids=["other-dim", "other-rows", "other-dtype"],
)
def test_dist_tensor_same_name_other_declaration_is_refused(shape, dtype) -> None:
    embcache.DistTensor((10, 3), torch.float32, name="declared")
    with pytest.raises(ValueError, match="declared"):
        embcache.DistTensor(shape, dtype, name="declared")


@pytest.mark.parametrize("bad", [-1, 10, 2**40], ids=["negative", "at-rows", "huge"])
def test_dist_tensor_ids_out_of_range_are_refused(bad: int) -> None:
    t = embcache.DistTensor((10, 3), torch.float32, name="ranged")
    before = t[torch.arange(10)]
    with pytest.raises(ValueError, match=str(bad)):
        t[torch.tensor([0, bad])]
    with pytest.raises(ValueError, match=str(bad)):
        t[torch.tensor([1, bad])] = torch.ones(2, 3)
    with pytest.raises(ValueError):
        _client().update_async("ranged", torch.tensor([bad]), torch.ones(1, 3))
    assert torch.equal(t[torch.arange(10)], before)


def test_dist_tensor_init_func_is_used() -> None:
    calls = []

    def init_func(shape, dtype):
        calls.append((tuple(shape), dtype))
        return torch.arange(shape[0] * shape[1], dtype=dtype).reshape(shape) / 8

    t = embcache.DistTensor((6, 4), torch.float32, name="initialised", init_func=init_func)
    assert calls == [((6, 4), torch.float32)]
    assert torch.equal(t[torch.arange(6)], torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8)


def test_default_init_is_zeros_as_in_recstore() -> None:
    """RecStore's init_data writes zeros when given no init_func; so does ours (made lazily,
    in any order of first touches)."""
    a = embcache.DistTensor((50, 3), torch.float32, name="order_a")
    backward = torch.cat([a[torch.tensor([i])] for i in range(49, -1, -1)]).flip(0)
    assert torch.equal(backward, torch.zeros(50, 3))
    emb = embcache.DistEmbedding(7, 5, name="zero_emb")
    assert torch.equal(emb(torch.arange(7)), torch.zeros(7, 5))
