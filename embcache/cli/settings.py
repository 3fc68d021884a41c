"""The settings of an ``embcache train`` run, shared by the one-process and the N-rank flows:
defaults, learning rates, the cache config and the data set."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from embcache.cache.config import CacheConfig
from embcache.data import ClickDataset, SyntheticConfig, SyntheticCriteo, open_dataset

# Defaults sized so that `embcache train` (what `make demo` runs) ends in about a minute on a
# 2-core CPU, start-up included, with a cache that has to evict.
DEFAULT_SCALE = 0.01
DEFAULT_ZIPF = 1.05
DEFAULT_DIM = 16
DEFAULT_STEPS = 800
DEFAULT_BATCH = 1024
DEFAULT_LOAD_FACTOR = 0.1
DEFAULT_EVAL_BATCHES = 20  # synthetic data: held-out batches (files: the whole held-out split)
DEFAULT_LR = {"sgd": 5.0, "adagrad": 0.05, "rowwise_adagrad": 0.05, "adam": 0.005}
DEFAULT_DENSE_LR = {"sgd": 0.1, "adagrad": 0.01, "rowwise_adagrad": 0.01, "adam": 0.001}


def run_settings(args: argparse.Namespace) -> tuple[float, float, CacheConfig]:
    """Learning rates and cache config of a run (and torch's thread count)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    dense_lr = args.dense_lr if args.dense_lr is not None else DEFAULT_DENSE_LR[args.optimizer]
    if args.cache_capacity is not None:
        cache = CacheConfig(capacity=args.cache_capacity, policy=args.policy)
    else:
        cache = CacheConfig(load_factor=args.load_factor or DEFAULT_LOAD_FACTOR, policy=args.policy)
    return lr, dense_lr, cache


def open_data(args: argparse.Namespace, progress: bool = False) -> ClickDataset:
    """The run's data: ``--data KIND:PATH``, or the synthetic Criteo-like stream.

    Raises:
        ValueError, FileNotFoundError: a bad ``--data`` (the message says what and where).
    """
    if args.data is None:
        config = SyntheticConfig(
            scale=args.scale if args.scale is not None else DEFAULT_SCALE,
            batch_size=args.batch_size,
            zipf=args.zipf if args.zipf is not None else DEFAULT_ZIPF,
            seed=args.seed,
        )
        return SyntheticCriteo(config)
    return open_dataset(args.data, args.batch_size, args.buckets, args.eval_fraction, progress)


def eval_batches(args: argparse.Namespace) -> int | None:
    """Held-out batches to evaluate on (None: the whole held-out split of a file)."""
    if args.eval_batches is not None:
        return args.eval_batches
    return DEFAULT_EVAL_BATCHES if args.data is None else None


def plain_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options without the parser objects, to send to other processes."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "parser")}
