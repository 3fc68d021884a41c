"""The optimizer rules at their old path: the registry lives in `embcache.ops.update.rules`
(the update family's rules, one spec each); every public name is re-exported here."""

from __future__ import annotations

from embcache.ops.update.rules import (
    CLI_NAMES,
    DEFAULT_DENSE_LR,
    DEFAULT_LR,
    RULES,
    WIDEST_STATE,
    OptimRule,
    Reference,
    RuleSpec,
    StatePart,
    by_cli,
    by_fbgemm,
    by_recstore,
    by_torch_class,
)

__all__ = [
    "CLI_NAMES",
    "DEFAULT_DENSE_LR",
    "DEFAULT_LR",
    "RULES",
    "WIDEST_STATE",
    "OptimRule",
    "Reference",
    "RuleSpec",
    "StatePart",
    "by_cli",
    "by_fbgemm",
    "by_recstore",
    "by_torch_class",
]
