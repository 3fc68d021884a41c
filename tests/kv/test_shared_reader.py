"""A ``?shared=1`` reader beside a job that trains with a stateful optimizer (issue 44, finding
10): it opens the tables whatever state layout the server records (a view of the rows), its
forward under ``torch.no_grad()`` gives the trained rows bit for bit, and nothing on the server
changes because of it (key set and every value compared, row-writing commands counted). Real
redis-server processes; the trainer is another collection in this process under its own owner
token (a job of its own as far as the server knows).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
import torch
from torchrec import KeyedJaggedTensor

import embcache
from tests.kv.redis_servers import RedisServer, running_server
from tests.test_redis_training import TABLES, batches, step

ROW_WRITES = ("set", "mset", "msetnx", "setrange", "del", "unlink", "incr", "incrby", "evalsha")
OPTIMIZERS = {
    "adagrad": lambda m: embcache.SparseAdaGrad(m, lr=0.1),
    "rowwise": lambda m: embcache.SparseRowWiseAdaGrad(m, lr=0.1),
    "adam": lambda m: embcache.SparseAdam(m, lr=0.05),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_server(tmp_path_factory.mktemp("redis")) as started:
        yield started


def _collection(url: str) -> embcache.CachedEmbeddingBagCollection:
    return embcache.CachedEmbeddingBagCollection(
        tables=TABLES, cache=embcache.CacheConfig(load_factor=0.05, ways=4), store=url, seed=0
    )


def _snapshot(client: redis.Redis, namespace: str) -> dict[bytes, bytes]:
    """Every key of ``namespace`` but the leases (which expire and renew) and its value."""
    keys = sorted(k for k in client.scan_iter(match=f"{namespace}:*", count=1000)
                  if b":lease:" not in k)  # fmt: skip
    return dict(zip(keys, [client.dump(k) for k in keys], strict=True))


def _writes(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {cmd: int(stats.get(f"cmdstat_{cmd}", {}).get("calls", 0)) for cmd in ROW_WRITES}


def _eval_batches() -> list[KeyedJaggedTensor]:
    """The training batches (rows the trainer wrote) and one of every id (most never seen)."""
    every = torch.cat([torch.arange(400), torch.arange(400), torch.arange(150)])
    ones, empty = torch.ones(400, dtype=torch.int64), torch.zeros(250, dtype=torch.int64)
    lengths = torch.cat([ones, ones, ones[:150], empty])  # 400 bags a feature
    whole = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=every, lengths=lengths
    )
    return [*batches(5), whole]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("attach", [False, True], ids=["no-optimizer", "reader-optimizer"])
def test_a_shared_reader_reads_what_a_stateful_optimizer_trained(
    server: RedisServer, optimizer: str, attach: bool
) -> None:
    namespace = f"shared-{uuid.uuid4().hex[:8]}"
    url = f"{server.url}?namespace={namespace}"
    trainer = _collection(url)
    opt = OPTIMIZERS[optimizer]([trainer])
    for kjt in batches(5):
        step(trainer, opt, kjt)
    with torch.no_grad():
        wanted = [trainer(kjt).values() for kjt in _eval_batches()]
    trainer.flush()
    client = server.client()
    before = _snapshot(client, namespace)
    client.config_resetstat()

    reader = _collection(f"{url}&shared=1")  # beside the live trainer, which holds the lease
    if attach:  # another optimizer's layout: still a view of the rows, nothing rewritten
        OPTIMIZERS["adagrad" if optimizer == "adam" else "adam"]([reader])
    with torch.no_grad():
        for kjt, want in zip(_eval_batches(), wanted, strict=True):
            got = reader(kjt).values()
            assert torch.equal(got, want), (optimizer, (got - want).abs().max())
    for table in TABLES:
        trained = trainer.table_rows(table.name)[:, : table.embedding_dim]
        assert torch.equal(reader.table_rows(table.name)[:, : table.embedding_dim], trained)
    reader.flush()
    reader.close()

    assert _writes(client) == dict.fromkeys(ROW_WRITES, 0), "the reader wrote to the server"
    assert _snapshot(client, namespace) == before, "keys changed because of the reader"
    trainer.close()


def test_a_shared_reader_refuses_training(server: RedisServer) -> None:
    """Writes stay refused: a shared reader's training step raises, naming the table and
    what to do, and the server is unchanged."""
    namespace = f"shared-{uuid.uuid4().hex[:8]}"
    url = f"{server.url}?namespace={namespace}"
    trainer = _collection(url)
    opt = embcache.SparseAdaGrad([trainer], lr=0.1)
    step(trainer, opt, batches(1)[0])
    trainer.flush()
    client = server.client()
    before = _snapshot(client, namespace)
    reader = _collection(f"{url}&shared=1")
    reader_opt = embcache.SparseAdaGrad([reader], lr=0.1)
    with pytest.raises(embcache.TierOwnershipError, match="read-only") as caught:
        for kjt in batches(30):
            step(reader, reader_opt, kjt)
        reader.flush()
    message = str(caught.value)
    assert "\n" not in message and "'t" in message and namespace in message, message
    assert _snapshot(client, namespace) == before
    trainer.close()
