"""Redis servers for the tier tests of this folder: ``server`` (a fresh single server per
test), ``cluster`` (one three-node cluster per module) and ``url`` (each of them in turn). A
module that needs other lifetimes defines its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kv.redis_servers import RedisClusterNodes, RedisServer, running_cluster, running_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path) as started:
        yield started


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture(params=["server", "cluster"])
def url(request: pytest.FixtureRequest) -> str:
    """URL of a fresh single server, or of the (module-wide) cluster."""
    return request.getfixturevalue(request.param).url
