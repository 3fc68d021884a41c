"""The tiers hold their parts (the Redis call layer, row I/O, declarations and registry; the host
tier's grouped passes; the tiered store's held rows) as members: each part is a class of its own,
and a tier inherits nothing of the package but the `Store` contract."""

from __future__ import annotations

import pytest

from embcache.kv.base import Store
from embcache.kv.held_rows import HeldRows, HeldTable
from embcache.kv.host import HostKV
from embcache.kv.host_tables import GroupedPasses
from embcache.kv.redis_calls import RedisCalls
from embcache.kv.redis_declare import TableDeclarations
from embcache.kv.redis_kv import RedisKV
from embcache.kv.redis_rows import RedisRowIO
from embcache.kv.redis_tables import RedisTables
from embcache.kv.tiered import TieredKV


def _package_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__[1:] if base.__module__.startswith("embcache")]


@pytest.mark.parametrize("tier", [HostKV, RedisKV, TieredKV], ids=lambda c: c.__name__)
def test_a_tier_inherits_only_the_store_contract(tier: type) -> None:
    assert _package_bases(tier) == [Store]


@pytest.mark.parametrize(
    "part",
    [RedisCalls, RedisRowIO, RedisTables, TableDeclarations, GroupedPasses, HeldRows, HeldTable],
    ids=lambda c: c.__name__,
)
def test_each_part_stands_alone(part: type) -> None:
    assert part.__mro__[1:] == (object,)
