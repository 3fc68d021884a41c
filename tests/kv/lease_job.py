"""A job holding a Redis table in another process, for the lease tests (a process that dies or
is paused must not keep, or silently take back, tables another job uses).

python tests/kv/lease_job.py URL TTL_S [NAMESPACE]   open table t0 in NAMESPACE ("lease"),
                                          print "ready" and its owner token, then for each line
                                          on stdin put a row and print "ok" or the error's class
"""

from __future__ import annotations

import sys

import torch

from embcache.kv.base import TableSpec
from embcache.kv.redis_kv import RedisKV


def main(url: str, ttl_s: str, namespace: str = "lease") -> None:
    kv = RedisKV(url, namespace=namespace, lease_ttl_s=float(ttl_s), retry_timeout_s=1)
    kv.init_table(TableSpec("t0", dim=2, num_embeddings=10))
    print("ready", flush=True)
    print(kv.owner, flush=True)
    for _ in sys.stdin:
        try:
            kv.put("t0", torch.tensor([1]), torch.ones(1, 2))
            print("ok", flush=True)
        except Exception as err:  # reported to the test, which asserts on it
            print(f"{type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
