"""What the project's code defines, read with `ast`, for tests that check the names a
document cites (tests/test_design_doc.py).

Nothing of embcache is imported: its modules, their top-level names, their classes with their
attributes and bases, and the parameters of functions and constructors are read from the
source, so modules that need torchrec or redis-py are read like the others. Third-party names
are resolved by import (torch, triton) or from their source (`external_has`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "embcache"
CODE_DIRS = ("embcache", "tests", "benchmarks", "scripts", "examples")
IDENT = r"[A-Za-z_]\w*"

# Roots of third-party dotted names (the module each stands for), resolved by import.
IMPORTED = {
    "torch": "torch",
    "nn": "torch.nn",
    "tl": "triton.language",
    "sys": "sys",
    "_pytest": "_pytest",
}


@dataclass
class ClassInfo:
    """A class under embcache/: its attributes and the names of its bases."""

    module: str
    attrs: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)
    params: set[str] = field(default_factory=set)  # its __init__'s


@dataclass
class ModuleInfo:
    """A module under embcache/: its top-level names (defined or imported), its classes and
    the parameters of its top-level functions."""

    path: Path
    defined: set[str] = field(default_factory=set)
    imported: set[str] = field(default_factory=set)
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    params: dict[str, set[str]] = field(default_factory=dict)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, those under module-level ``if``/``try``/``with`` included."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.With):
            yield from _top_level(node.body + getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            yield from _top_level(node.body + node.orelse + node.finalbody + handlers)


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = node.args
    return {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def _class_info(module: str, node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(module)
    for base in node.bases:
        if isinstance(base, ast.Subscript):
            base = base.value
        if isinstance(base, ast.Name | ast.Attribute):
            info.bases.append(base.id if isinstance(base, ast.Name) else base.attr)
    for stmt in _top_level(node.body):
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            info.attrs.add(stmt.name)
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            info.params = _params(stmt)
        for target in _targets(stmt):
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    info.attrs.add(name.id)
    for sub in ast.walk(node):
        for target in _targets(sub) if isinstance(sub, ast.stmt) else []:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                info.attrs.add(target.attr)
    return info


@cache
def package_index() -> dict[str, ModuleInfo]:
    """Every module under embcache/, by dotted name, read with ast."""
    index = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        info = ModuleInfo(path)
        name = module_name(path)
        for node in _top_level(tree.body):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                info.defined.add(node.name)
                if isinstance(node, ast.ClassDef):
                    info.classes[node.name] = _class_info(name, node)
                else:
                    info.params[node.name] = _params(node)
                if node.name == "__getattr__":  # PEP 562: the names it answers
                    info.imported |= {
                        c.value
                        for c in ast.walk(node)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    }
            elif isinstance(node, ast.Import | ast.ImportFrom):
                info.imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            for target in _targets(node):
                info.defined |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                if (  # embcache/__init__.py's lazily loaded names (PEP 562)
                    isinstance(target, ast.Name)
                    and target.id == "_HOMES"
                    and isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Dict)
                ):
                    info.imported |= {ast.literal_eval(k) for k in node.value.keys if k}
        index[name] = info
    return index


def accepts(dotted: str, keyword: str) -> bool:
    """Whether a function or class takes ``keyword``: under embcache/, a function of that name
    or a class whose ``__init__`` (or dataclass field) has it; a third-party one by its
    signature."""
    if dotted.split(".")[0] in IMPORTED:
        root, *rest = dotted.split(".")
        callee = _imported(".".join([IMPORTED[root], *rest]))
        return callable(callee) and keyword in inspect.signature(callee).parameters
    name = dotted.split(".")[-1]
    return any(keyword in m.params.get(name, ()) for m in package_index().values()) or any(
        keyword in c.params | c.attrs for c in classes_named(name)
    )


@cache
def classes_named(name: str) -> list[ClassInfo]:
    return [m.classes[name] for m in package_index().values() if name in m.classes]


def class_has(name: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a class ``name`` under embcache/ defines ``attr``, itself or through a base."""
    for info in classes_named(name):
        if attr in info.attrs:
            return True
        if any(b not in seen and class_has(b, attr, seen | {name}) for b in info.bases):
            return True
    return False


def _modules_ending(parts: list[str]) -> list[ModuleInfo]:
    suffix = ".".join(parts)
    return [m for n, m in package_index().items() if n == suffix or n.endswith("." + suffix)]


def _imported(dotted: str) -> object:
    """A third-party dotted name's object (its longest importable module, then getattr), or
    None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def resolves(dotted: str) -> bool:
    """Whether a dotted name names something that exists: module-qualified
    (``kv.base.HashedInit``, any trailing part of a module's name) through the package's
    modules; ``Class.attr`` through a class of that name under embcache/ that defines the
    attribute, itself or through a base; a third-party name (`IMPORTED`) by import."""
    parts = dotted.split(".")
    if parts[0] in IMPORTED:
        return _imported(".".join([IMPORTED[parts[0]], *parts[1:]])) is not None
    for i in range(len(parts), 0, -1):
        rest = parts[i:]
        for module in _modules_ending(parts[:i]):
            if not rest:
                return True
            top = rest[0]
            if top not in module.defined | module.imported:
                continue
            if len(rest) == 1 or (len(rest) == 2 and class_has(top, rest[1])):
                return True
    return len(parts) == 2 and class_has(parts[0], parts[1])


@cache
def used_names(excluding: Path | None = None) -> frozenset[str]:
    """Every name the project's Python code (but the file ``excluding``) defines or uses:
    definitions, parameters, attributes, keywords, imports, module names and identifier-like
    string constants (not docstrings)."""
    names: set[str] = set()
    for top in CODE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            if path == excluding:
                continue
            names |= set(path.with_suffix("").parts[len(ROOT.parts) :])
            tree = ast.parse(path.read_text(), filename=str(path))
            docstrings = {
                id(n.value)
                for n in ast.walk(tree)
                if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
            }
            for n in ast.walk(tree):
                if isinstance(n, ast.Name):
                    names.add(n.id)
                elif isinstance(n, ast.Attribute):
                    names.add(n.attr)
                elif isinstance(n, ast.arg | ast.keyword) and n.arg:
                    names.add(n.arg)
                elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(n.name)
                elif isinstance(n, ast.alias):
                    names |= {*n.name.split("."), n.asname or ""}
                elif (
                    isinstance(n, ast.Constant)
                    and isinstance(n.value, str)
                    and id(n) not in docstrings
                    and re.fullmatch(IDENT, n.value)
                ):
                    names.add(n.value)
    return frozenset(names)


def path_exists(span: str) -> bool:
    """A path at the root or under embcache/; a bare file name anywhere in the repository."""
    rel = span.rstrip("/")
    if any((base / rel).exists() for base in (ROOT, PACKAGE)):
        return True
    if "/" not in rel:
        return any(p.name == rel for top in (*CODE_DIRS, "docs") for p in (ROOT / top).rglob(rel))
    return False


def external_has(where: str) -> bool:
    """Whether ``module:Class.attribute`` exists (True when the package is not installed:
    nothing to check against)."""
    module, _, qualified = where.partition(":")
    owner, _, attr = qualified.partition(".")
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return True
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    tree = ast.parse(Path(spec.origin).read_text())
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
    return any(not attr or attr in _class_info(module, n).attrs for n in found)
