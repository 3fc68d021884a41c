"""`DistEmbedding` on several ranks: one table, never one per rank.

A DistEmbedding's table is a tensor of its process's KV client, so on 2 ranks each rank would
train a copy of its own (on a host tier, and on one Redis server too: each rank's SparseSGD
reads its rows, subtracts its own gradient and writes them back over the other's). It refuses
to be built in a process group of more than one rank, before it declares any row, naming
`ShardedEmbeddingCollection` (one row per id, sharded over the ranks) and `ShardedKVClient`,
and the opt-out ``allow_unsharded_replicas=True``; a forward in a group initialised after it
was built is refused alike, and a group of one rank trains as one process.

The advice is checked too: on 2 ranks (gloo on CPU, one spawn) `ShardedEmbeddingCollection`
with `SparseSGD`, given the ids each rank's DistEmbedding would have looked up (duplicates, the
last row, one rank empty at a step), ends with equal rows on both ranks, and those rows equal a
single-process DistEmbedding's trained on the concatenated batches with the loss summed over
the ranks (float32 tolerances: the sharded run sums an id's gradients per rank, then over
ranks).
"""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor

import embcache
from embcache.distributed import ShardedEmbeddingCollection
from embcache.distributed.launch import spawn

ROWS, DIM, LR = 41, 5, 0.5
NAME = "user"
BATCHES = ((6, 3), (0, 5), (4, 4))  # ids per rank at each step: rank 0 has none at step 1


def _initial(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)


def _ids(step: int, rank: int) -> torch.Tensor:
    n = BATCHES[step][rank]
    ids = torch.randint(0, ROWS, (n,), generator=torch.Generator().manual_seed(10 * step + rank))
    if n >= 3:
        ids[1], ids[2] = ids[0], ROWS - 1  # a duplicate, the last row
    return ids


def _coeff(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + 10 * step + rank)
    return torch.randn(BATCHES[step][rank], DIM, generator=gen)


def _refusal(make) -> str:
    try:
        make()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _worker(rank: int, redis_url: str) -> dict:
    out: dict = {}
    for tier, url in (("host", None), ("redis", redis_url)):
        embcache.reset_kv_client()
        client = embcache.get_kv_client(url)
        out[tier] = _refusal(lambda: embcache.DistEmbedding(ROWS, DIM, NAME, init_func=_initial))
        out[f"{tier}_declared"] = client.names()
    embcache.reset_kv_client()

    # The opt-out: one table per rank, on purpose.
    own = embcache.DistEmbedding(ROWS, DIM, NAME, _initial, allow_unsharded_replicas=True)
    opt = embcache.SparseSGD([own], lr=LR)
    own(_ids(0, rank)).sum().backward()
    opt.step()
    out["replica_rows"] = own.weight[torch.arange(ROWS)]
    embcache.reset_kv_client()

    # The advice: ShardedEmbeddingCollection, one row per id, trained by SparseSGD.
    tables = [
        EmbeddingConfig(name=NAME, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[NAME])
    ]
    sharded = ShardedEmbeddingCollection(tables, device="cpu")
    sharded.load_state_dict({f"embeddings.{NAME}.weight": _initial((ROWS, DIM), torch.float32)})
    opt = embcache.SparseSGD([sharded], lr=LR)
    for step in range(len(BATCHES)):
        ids = _ids(step, rank)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[NAME], values=ids, lengths=torch.ones(ids.numel(), dtype=torch.int64)
        )
        rows = sharded(kjt)[NAME].values()
        (rows * _coeff(step, rank)).square().sum().backward()
        opt.step()
    out["sharded_rows"] = sharded.state_dict()[f"embeddings.{NAME}.weight"]
    return out


def _single_process_rows() -> torch.Tensor:
    """One DistEmbedding trained on each step's ranks' ids together, the loss summed."""
    embcache.reset_kv_client()
    try:
        emb = embcache.DistEmbedding(ROWS, DIM, NAME, init_func=_initial)
        opt = embcache.SparseSGD([emb], lr=LR)
        for step in range(len(BATCHES)):
            ids = torch.cat([_ids(step, r) for r in range(2)])
            coeff = torch.cat([_coeff(step, r) for r in range(2)])
            (emb(ids) * coeff).square().sum().backward()
            opt.step()
        return emb.weight[torch.arange(ROWS)]
    finally:
        embcache.reset_kv_client()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[bytes]]:
    from tests.kv.redis_servers import running_server

    with running_server(tmp_path_factory.mktemp("redis")) as server:
        # Both ranks one job: one lease owner, as `embcache train --nproc` gives its ranks.
        url = f"{server.url}?owner=dist-embedding-job"
        results = spawn(_worker, 2, args=(url,), timeout=60)
        keys = server.client().keys("*")
    return results, keys


@pytest.mark.parametrize("tier", ["host", "redis"])
def test_dist_embedding_on_two_ranks_is_refused_before_any_row(runs, tier: str) -> None:
    results, keys = runs
    for rank, r in enumerate(results):
        message = r[tier]
        assert "2 ranks" in message, (rank, message)
        assert "embcache.distributed.ShardedEmbeddingCollection" in message
        assert "embcache.distributed.ShardedKVClient" in message
        assert "allow_unsharded_replicas=True" in message
        assert r[f"{tier}_declared"] == []  # no tensor declared, no row written
    if tier == "redis":
        assert not [k for k in keys if NAME.encode() in k], keys


def test_the_opt_out_keeps_one_table_per_rank(runs) -> None:
    results, _ = runs
    initial = _initial((ROWS, DIM), torch.float32)
    for r in results:
        assert not torch.equal(r["replica_rows"], initial)  # it trained
    assert not torch.equal(results[0]["replica_rows"], results[1]["replica_rows"])


def test_the_advised_sharded_collection_is_one_table(runs) -> None:
    results, _ = runs
    assert torch.equal(results[0]["sharded_rows"], results[1]["sharded_rows"])
    expected = _single_process_rows()
    assert not torch.equal(expected, _initial((ROWS, DIM), torch.float32))
    torch.testing.assert_close(results[0]["sharded_rows"], expected)


def _one_rank_worker(rank: int) -> torch.Tensor:
    embcache.reset_kv_client()
    emb = embcache.DistEmbedding(ROWS, DIM, NAME, init_func=_initial)
    opt = embcache.SparseSGD([emb], lr=LR)
    (emb(_ids(0, 0)) * _coeff(0, 0)).square().sum().backward()
    opt.step()
    return emb.weight[torch.arange(ROWS)]


def test_a_process_group_of_one_rank_trains_as_one_process() -> None:
    (rows,) = spawn(_one_rank_worker, 1, timeout=60)
    embcache.reset_kv_client()
    try:
        emb = embcache.DistEmbedding(ROWS, DIM, NAME, init_func=_initial)
        opt = embcache.SparseSGD([emb], lr=LR)
        (emb(_ids(0, 0)) * _coeff(0, 0)).square().sum().backward()
        opt.step()
        assert torch.equal(rows, emb.weight[torch.arange(ROWS)])
    finally:
        embcache.reset_kv_client()


def test_a_forward_after_the_group_grew_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built before torch.distributed was initialised (2 ranks, as torch.distributed then
    reports them here), the forward refuses before it reads or records anything."""
    embcache.reset_kv_client()
    try:
        emb = embcache.DistEmbedding(ROWS, DIM, NAME, init_func=_initial)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        with pytest.raises(RuntimeError, match="ShardedEmbeddingCollection"):
            emb(torch.tensor([1, 2]))
        assert emb._trace == []
    finally:
        embcache.reset_kv_client()


def test_the_refusal_names_the_tables_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    embcache.reset_kv_client()
    try:
        with pytest.raises(RuntimeError) as refused:
            embcache.DistEmbedding(ROWS, DIM, NAME)
        assert embcache.get_kv_client().names() == []
    finally:
        embcache.reset_kv_client()
    message = str(refused.value)
    assert "3 ranks" in message
    assert f"EmbeddingConfig(name='{NAME}', embedding_dim={DIM}, num_embeddings={ROWS}" in message
