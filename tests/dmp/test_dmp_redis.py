"""DMP over embcache's cached collection with a Redis tier shared by both ranks: each rank's
shards are tables of their own on the one server, and training equals one process as with the
host tier (`tests/dmp/test_dmp.py`, whose scenario, worker and checks this reuses)."""

from __future__ import annotations

from pathlib import Path

import pytest

from embcache.distributed.launch import spawn
from tests.dmp.test_dmp import Scenario, _worker, check_against_one_process
from tests.kv.redis_servers import running_server

SCENARIO = Scenario("row_wise_adagrad_redis", "row_wise", "adagrad")


@pytest.fixture(scope="module")
def two_ranks_on_redis(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    where: Path = tmp_path_factory.mktemp("redis")
    with running_server(where) as server:
        url = f"{server.url}?namespace=dmp_test"
        return spawn(_worker, 2, args=(2, [SCENARIO], str(where), url), timeout=120)


def test_dmp_on_a_redis_tier_trains_like_one_process(two_ranks_on_redis: list[dict]) -> None:
    check_against_one_process(two_ranks_on_redis, SCENARIO)
    assert [r[SCENARIO.name]["tiers"] for r in two_ranks_on_redis] == [["RedisKV"]] * 2
