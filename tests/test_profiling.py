"""`embcache.profiling.profiled`: a named range while a torch profiler records, the bare call
otherwise (and the same result and exceptions either way); `phase_times` times the calls on
every thread while it collects."""

from __future__ import annotations

import threading

import pytest
import torch

from embcache.profiling import phase_times, profiled


@profiled("test.double")
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@profiled("test.fail")
def _fail() -> None:
    raise ValueError("bad input")


def _ranges(prof: torch.profiler.profile) -> list[str]:
    return [e.name for e in prof.events()]


def test_a_recording_profiler_sees_one_range_per_call() -> None:
    x = torch.arange(4.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = _double(x)
        _double(x)
    assert torch.equal(out, x * 2)
    assert _ranges(prof).count("test.double") == 2


def test_without_a_profiler_the_call_is_bare_and_gives_the_same_result() -> None:
    x = torch.arange(4.0)
    assert not torch.autograd._profiler_enabled()
    assert torch.equal(_double(x), x * 2)
    assert _double.__name__ == "_double"  # functools.wraps keeps the name


def test_exceptions_pass_through_either_way() -> None:
    with pytest.raises(ValueError, match="bad input"):
        _fail()
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof, pytest.raises(ValueError, match="bad"):
        _fail()
    assert "test.fail" in _ranges(prof)


def test_phase_times_are_collected_per_thread_and_only_inside() -> None:
    x = torch.arange(4.0)
    _double(x)  # before: not collected
    with phase_times() as times:
        _double(x)
        worker = threading.Thread(target=lambda: [_double(x), _double(x)], name="side")
        worker.start()
        worker.join()
        with pytest.raises(ValueError):
            _fail()  # a call that raises is timed too
    _double(x)  # after: not collected
    main = threading.current_thread().name
    assert times.calls == {(main, "test.double"): 1, ("side", "test.double"): 2,
                           (main, "test.fail"): 1}  # fmt: skip
    assert all(s > 0 for s in times.seconds.values())
    with phase_times(), pytest.raises(RuntimeError, match="already"), phase_times():
        pass


def test_a_step_times_its_resolve_once_around_its_parts() -> None:
    """A collection's forward resolves its caches together (`resolve_together`): one
    ``cache.resolve`` per forward, at least as long as the plan and tier transfer inside it,
    so that `bench_step_profile`'s "cache.resolve (rest)" and "other" mean what they say."""
    import embcache

    tables = [embcache.TableConfig(name=f"t{i}", embedding_dim=4 * (i + 1), num_embeddings=400,
                                   feature_names=[f"f{i}"]) for i in range(2)]  # fmt: skip
    ebc = embcache.CachedEmbeddingBagCollection(
        tables=tables, cache=embcache.CacheConfig(capacity=32, ways=4), seed=0
    )
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 400, (120,), generator=gen)
    batch = embcache.JaggedBatch.from_lengths(["f0", "f1"], values, torch.full((12,), 10))
    main = threading.current_thread().name
    with phase_times() as times:
        ebc(batch)
    assert len(ebc.engines.engines) == 2  # two dims: two caches, resolved together
    assert times.calls[(main, "cache.resolve")] == 1
    inside = sum(times.seconds.get((main, p), 0.0) for p in ("cache.plan", "cache.tier_io"))
    assert times.calls[(main, "cache.plan")] >= 1
    assert times.seconds[(main, "cache.resolve")] >= inside
