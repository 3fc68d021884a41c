"""The package's import graph, read from the source (ast): layers point one way, no cycles, no
module importing another module's private names, no citation of documents outside the
repository.

Layers, lowest first (a module may import its own package and lower layers only):

    hashing, profiling, native,      the id hash; named phases for torch.profiler; compiled
    hostmem, devices                 CPU loops (numba); host arrays in huge pages; CUDA
                                     devices with their index
    backend                          which implementation runs (``EMBCACHE_BACKEND``): one
                                     `Backend` object per family, with its operations
    indexing                         writes at positions, mask positions, flag counts
    kernels, kv                     the Triton kernels with their twins; the tiers
    cache, optim                    the device cache and its transfers; the optimizer rules
    engine                          one step's data path per cache, inputs, tables
    models, data                    the collection and DLRM; training data
    recstore, tbe                   RecStore's names over the above; FBGEMM's TBE call shape
    torchrec_kv                     RecStore's torchrec_kv module path over recstore
    distributed, torchrec           several processes: embcache's own sharding; torchrec's DMP
    train, checkpoint, signals      the training loop and pipeline; checkpoints; a script's
                                     flush at SIGTERM
    cli                             the command line
    embcache (__init__)             the public names
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "embcache"

LAYERS = [
    ["hashing", "profiling", "native", "hostmem", "devices"],
    ["backend"],
    ["indexing"],
    ["kernels", "kv"],
    ["cache", "optim"],
    ["engine"],
    ["models", "data"],
    ["recstore", "tbe"],
    ["torchrec_kv"],
    ["distributed", "torchrec"],
    ["train", "checkpoint", "signals"],
    ["cli"],
    ["__init__"],
]
RANK = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """``(imported module, names imported from it, line)`` of every import in a module,
    module-level or inside functions, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            out.append((module, [a.name for a in node.names], node.lineno))
    return [(m, names, line) for m, names, line in out if m.split(".")[0] == "embcache"]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _target(imported: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    """The modules an import statement reads (``from pkg import mod`` reads ``pkg.mod``)."""
    found = [f"{imported}.{n}" for n in names if f"{imported}.{n}" in modules]
    return found or [imported]


def test_every_module_has_a_layer() -> None:
    unknown = {_layer(m) for m in _modules()} - set(RANK)
    assert not unknown, f"modules outside the layer table: {sorted(unknown)}"


def test_imports_point_down_the_layers() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        mine = _layer(name)
        for imported, _, line in _imports(name, path):
            theirs = _layer(imported)
            if theirs != mine and RANK.get(theirs, -1) >= RANK[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {imported}")
    assert not wrong, "imports from a layer into one at or above it:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {
        name: {t for m, names, _ in _imports(name, path) for t in _target(m, names, modules)}
        & set(modules)
        for name, path in modules.items()
    }
    # A package's __init__ re-exports its modules; a module importing a sibling through the
    # package is the same edge as importing the sibling.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt == node or (node.startswith(nxt + ".") and modules[nxt].name == "__init__.py"):
                continue  # a module of a package importing the package's own __init__
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_imports_private_names_of_another() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        for imported, names, line in _imports(name, path):
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            if private and imported != name:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {imported}")
    assert not wrong, "\n".join(wrong)


# Spelled in pieces, so that this file does not cite what it looks for.
_OUTSIDE = ("DESIGN" + ".md", "../" + "shared")


@pytest.mark.parametrize("folder", ["embcache", "tests", "benchmarks"])
def test_nothing_cites_documents_outside_the_repository(folder: str) -> None:
    cited = [
        str(p.relative_to(ROOT))
        for p in (ROOT / folder).rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".sh", ".md", ".toml")
        and any(c in p.read_text(errors="ignore") for c in _OUTSIDE)
    ]
    assert not cited, f"files citing documents outside the repository: {cited}"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The ast walk resolves relative imports and finds private names: a planted example."""
    pkg = tmp_path / "embcache" / "kv"
    pkg.mkdir(parents=True)
    bad = pkg / "bad.py"
    bad.write_text("from ..engine.group import _hidden\nfrom . import host\n")
    found = _imports("embcache.kv.bad", bad)
    assert ("embcache.engine.group", ["_hidden"], 1) in found
    assert ("embcache.kv", ["host"], 2) in found
    assert RANK[_layer("embcache.engine.group")] > RANK[_layer("embcache.kv.bad")]


def _strings_outside_docstrings(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of the string literals of a module that are code, not docstrings."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings
    ]  # fmt: skip


def test_the_backend_is_read_in_one_module() -> None:
    """``EMBCACHE_BACKEND`` is read by `embcache.backend` alone: every other module asks
    `embcache.backend.for_device` (or `kernels.backend.use_triton`, which asks it), so a name
    that is none of the choices is a ValueError wherever the choice is made."""
    readers = [
        f"{path.relative_to(ROOT)}:{line}"
        for name, path in _modules().items()
        for line, text in _strings_outside_docstrings(path)
        if "EMBCACHE_BACKEND" in text
    ]
    assert readers and all(r.startswith("embcache/backend.py:") for r in readers), readers


# Names that tell which implementation is present: asked only by `embcache.backend`, whose
# `Backend` objects every other module holds or asks (`for_device`).
CHOICE_NAMES = ("backend_name", "importable", "_njit")


def test_only_the_backend_asks_which_implementation_is_present() -> None:
    askers = []
    for name, path in _modules().items():
        if name in ("embcache.backend", "embcache.native"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            called = node.func if isinstance(node, ast.Call) else None
            ident = getattr(called, "attr", None) or getattr(called, "id", None)
            if ident in CHOICE_NAMES:
                askers.append(f"{path.relative_to(ROOT)}:{node.lineno} {ident}()")
    assert not askers, askers
