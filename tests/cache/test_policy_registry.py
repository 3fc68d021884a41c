"""The eviction policies' registry (`cache.policy_registry`): a policy defined here, outside the
package, registered by name, trains a collection end to end, is offered by ``embcache train
--policy``, and an unknown name is refused naming the registered ones."""

from __future__ import annotations

import re

import pytest
import torch

import embcache
from embcache.backend import for_device
from embcache.cache import policy_registry
from embcache.cache.config import CacheConfig
from embcache.cache.policy import EvictionPolicy, make_policy
from embcache.cache.policy_registry import policy_names, register_policy
from embcache.cli import build_parser
from embcache.kernels.cache_index import set_index

NEVER = 1 << 62  # above every tick: an MRU score stays >= 0, as a resident slot's must
ROWS = {"t0": 50, "t1": 33}
DIM = 4


class MruPolicy(EvictionPolicy):
    """Most recently used first: a slot's score falls with each use, so a miss evicts the way
    used last (right for a loop over more rows than the cache holds; here, a policy that is no
    built-in)."""

    def order_misses(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, miss_ids: torch.Tensor,
        shuffle: torch.Tensor, num_sets: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        sets = set_index(miss_ids, num_sets)
        order = torch.sort(sets, stable=True).indices
        return miss_pos.index_select(0, order), sets.index_select(0, order), None

    def touch(
        self, ids: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor,
        n_main: int | None, all_main: bool, tick: int, lookups: int,
    ) -> None:  # fmt: skip
        main = slots[(slots >= 0) & (slots < scores.numel())]
        scores[main] = NEVER - tick


@pytest.fixture
def mru(monkeypatch: pytest.MonkeyPatch) -> str:
    """``"mru"`` registered for the test (the registry is restored after it)."""
    monkeypatch.setattr(policy_registry, "POLICIES", dict(policy_registry.POLICIES))
    register_policy("mru", MruPolicy)
    return "mru"


def _collection(policy: str) -> embcache.CachedEmbeddingBagCollection:
    tables = [
        embcache.TableConfig(name=name, embedding_dim=DIM, num_embeddings=rows,
                             feature_names=[f"f_{name}"])
        for name, rows in ROWS.items()
    ]  # fmt: skip
    cache = CacheConfig(capacity=12, ways=4, policy=policy)  # far fewer slots than rows
    return embcache.CachedEmbeddingBagCollection(tables, cache=cache, device="cpu", seed=3)


def _batches(n: int, batch_size: int = 5) -> list[embcache.JaggedBatch]:
    gen = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (len(ROWS) * batch_size,), generator=gen)
        per_table = lengths.view(len(ROWS), batch_size).sum(1).tolist()
        values = torch.cat([
            torch.randint(0, rows, (k,), generator=gen)
            for rows, k in zip(ROWS.values(), per_table, strict=True)
        ])  # fmt: skip
        keys = [f"f_{name}" for name in ROWS]
        batches.append(embcache.JaggedBatch.from_lengths(keys, values, lengths))
    return batches


def _train(policy: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list]:
    model = _collection(policy)
    opt = embcache.SparseSGD([model], lr=0.5)
    gen = torch.Generator().manual_seed(5)
    outputs = []
    for batch in _batches(10):
        out = model(batch).values()
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        opt.step()
        outputs.append(out.detach())
    caches = model.caches()
    model.flush()
    return outputs, {name: model.table_rows(name) for name in ROWS}, caches


def test_a_registered_policy_trains_a_collection_end_to_end(mru: str) -> None:
    """The policy decides which rows stay on the device, never a number (I1-I3): every output
    and, after a flush, every row equals an LRU cache's on the same batches."""
    outputs, rows, caches = _train(mru)
    lru_outputs, lru_rows, _ = _train("lru")
    for step, (ours, theirs) in enumerate(zip(outputs, lru_outputs, strict=True)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=f"step {step}")
    for name in ROWS:
        torch.testing.assert_close(rows[name], lru_rows[name], rtol=0, atol=0, msg=name)
    (cache,) = caches
    assert cache.policy == "mru" and isinstance(cache.eviction, MruPolicy)
    assert cache.cache_stats()["evictions"] > 0
    resident = cache.slot_keys[: cache.num_slots] >= 0
    assert bool((cache.scores[resident] > NEVER // 2).all())  # scored by MRU, not by the clock


def test_the_cli_offers_every_registered_policy(mru: str, capsys: pytest.CaptureFixture) -> None:
    assert policy_names()[:2] == ("lru", "lfu") and policy_names()[-1] == mru  # built-ins first
    parser = build_parser()
    assert parser.parse_args(["train", "--policy", mru]).policy == mru
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--policy", "nope"])
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and all(name in err for name in ("lru", "lfu", mru))


def test_an_unknown_policy_is_refused_naming_the_registered_ones(mru: str) -> None:
    registered = re.escape(policy_registry.known_policies())  # "'lru', 'lfu' or 'mru'" today
    assert policy_registry.known_policies().endswith("or 'mru'")
    with pytest.raises(ValueError, match=rf"CacheConfig\.policy .* {registered}; got 'nope'"):
        CacheConfig(policy="nope")
    backend = for_device("cpu")
    with pytest.raises(ValueError, match=rf"unknown eviction policy 'nope': .* {registered}"):
        make_policy("nope", None, CacheConfig(), backend, 20)
    assert isinstance(make_policy(mru, None, CacheConfig(), backend, 20), MruPolicy)
    assert CacheConfig(policy="MRU").policy == "mru"


def test_register_policy_refuses_a_taken_or_malformed_name(mru: str) -> None:
    with pytest.raises(ValueError, match="registered already"):
        register_policy("lru", MruPolicy)
    with pytest.raises(ValueError, match="registered already"):
        register_policy(mru, MruPolicy)
    for bad in ("", "Upper", "two words"):
        with pytest.raises(ValueError, match="lower-case word"):
            register_policy(bad, MruPolicy)
    with pytest.raises(TypeError, match="give its class"):
        register_policy("instance", MruPolicy.__new__(MruPolicy))  # type: ignore[arg-type]
    register_policy("dict", dict)
    config = CacheConfig(policy="dict")  # a registered name: its class is checked at build
    with pytest.raises(TypeError, match="not an EvictionPolicy"):
        make_policy(config.policy, None, config, for_device("cpu"), 20)


def test_only_a_policy_whose_padded_order_matches_its_order_plans_ahead() -> None:
    """A device plan orders padded misses (`order_padded_misses`) only for a policy whose
    `order_misses` comes from the same class: LRU yes; the base, LFU and a policy of its own
    order no; a subclass of LRU that reorders misses but inherits the padded order no."""
    from embcache.cache.policy import LfuPolicy, LruPolicy, orders_padded_misses

    class Reordered(LruPolicy):
        def order_misses(self, ids, miss_pos, miss_ids, shuffle, num_sets):  # type: ignore[no-untyped-def]
            return super().order_misses(ids, miss_pos, miss_ids, -shuffle, num_sets)

    def bare(cls: type) -> EvictionPolicy:
        return cls.__new__(cls)  # the answer depends on the class only

    assert orders_padded_misses(bare(LruPolicy))
    assert not orders_padded_misses(bare(LfuPolicy))
    assert not orders_padded_misses(bare(MruPolicy))
    assert not orders_padded_misses(bare(Reordered))
