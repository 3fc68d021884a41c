"""The settings of an ``embcache train`` run, shared by the one-process and the N-rank flows:
defaults, learning rates, the cache config and the data set."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from embcache.cache.config import CacheConfig
from embcache.data.synthetic import SyntheticConfig, SyntheticCriteo

# Defaults sized so that `embcache train` (what `make demo` runs) ends in about a minute on a
# 2-core CPU, start-up included, with a cache that has to evict.
DEFAULT_SCALE = 0.01
DEFAULT_DIM = 16
DEFAULT_STEPS = 800
DEFAULT_BATCH = 1024
DEFAULT_LOAD_FACTOR = 0.1
DEFAULT_LR = {"sgd": 5.0, "adagrad": 0.05, "rowwise_adagrad": 0.05, "adam": 0.005}
DEFAULT_DENSE_LR = {"sgd": 0.1, "adagrad": 0.01, "rowwise_adagrad": 0.01, "adam": 0.001}


def run_settings(
    args: argparse.Namespace,
) -> tuple[float, float, CacheConfig, SyntheticCriteo]:
    """Learning rates, cache config and data set of a run (and torch's thread count)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    dense_lr = args.dense_lr if args.dense_lr is not None else DEFAULT_DENSE_LR[args.optimizer]
    if args.cache_capacity is not None:
        cache = CacheConfig(capacity=args.cache_capacity, policy=args.policy)
    else:
        cache = CacheConfig(load_factor=args.load_factor or DEFAULT_LOAD_FACTOR, policy=args.policy)
    config = SyntheticConfig(
        scale=args.scale, batch_size=args.batch_size, zipf=args.zipf, seed=args.seed
    )
    return lr, dense_lr, cache, SyntheticCriteo(config)


def plain_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options without the parser objects, to send to other processes."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "parser")}
