"""The device cache's eviction policies by name: the one table every other list of policies
reads (`CacheConfig.policy`'s check, `make_policy`, ``embcache train --policy``, torchrec's
``CachedParameterConstraints.cache_policy``, the tests that run every policy).

A new policy is its `embcache.cache.policy.EvictionPolicy` subclass and one line here (a
built-in, as ``"module:Class"``, imported when a cache is built) or a `register_policy` call
(a policy defined elsewhere, with its class):

    from embcache.cache.policy_registry import register_policy

    register_policy("mru", MruPolicy)
    embcache.CacheConfig(policy="mru")

This module imports neither torch nor triton (``embcache --help`` reads the names from it).
"""

from __future__ import annotations

import importlib

POLICIES: dict[str, type | str] = {
    "lru": "embcache.cache.policy:LruPolicy",
    "lfu": "embcache.cache.policy:LfuPolicy",
}
"""Each policy's name (lower case) and its class, or where the class lives (``module:Class``)."""


def register_policy(name: str, cls: type | str) -> None:
    """Offer ``cls`` (an `EvictionPolicy` subclass, or ``"module:Class"``) as policy ``name``
    (`CacheConfig(policy=name)`, ``embcache train --policy name``).

    Raises:
        ValueError: ``name`` is not a non-empty lower-case string without spaces, or is taken.
        TypeError: ``cls`` is neither a class nor a string.
    """
    if not isinstance(name, str) or not name or name != name.lower() or name.split() != [name]:
        raise ValueError(f"a policy name is a lower-case word, got {name!r}")
    if not isinstance(cls, type | str):
        raise TypeError(f"eviction policy {name!r}: give its class, got {cls!r}")
    if name in POLICIES:
        raise ValueError(f"eviction policy {name!r} is registered already")
    POLICIES[name] = cls


def policy_names() -> tuple[str, ...]:
    """The registered policies' names, built-ins first."""
    return tuple(POLICIES)


def known_policies() -> str:
    """The registered names as a message lists them: ``'lru' or 'lfu'``."""
    names = [repr(n) for n in POLICIES]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def policy_name(value: object, where: str) -> str:
    """The registered name ``value`` gives (a name in any case, or a `CachePolicy` member).

    Raises:
        ValueError: no policy of that name, naming ``where`` and the registered ones.
    """
    name = value.lower() if isinstance(value, str) else None
    if name is None or name not in POLICIES:
        raise ValueError(
            f"{where} must be a registered eviction policy, {known_policies()}; got {value!r}"
        )
    return name


def policy_class(name: str) -> type:
    """The class registered as ``name`` (imported on first use).

    Raises:
        ValueError: no policy of that name, with the registered ones.
    """
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(
            f"unknown eviction policy {name!r}: the registered ones are {known_policies()}"
        )
    cls = POLICIES[name]
    if isinstance(cls, str):
        module, _, attr = cls.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    assert isinstance(cls, type), f"eviction policy {name!r} is registered as {cls!r}"
    return cls
