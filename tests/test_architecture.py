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
    ops                              the op families (ids, plan, rows, pooling, gather,
                                     update): per family its protocol, its torch
                                     specification, Triton and numba implementations, and
                                     the registry that binds one; the optimizer rules
    kernels, kv                     the families' public functions at their old paths; the
                                     tiers
    cache, optim                    the device cache and its transfers; the sparse optimizers
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

from embcache.ops.registry import families, implementations, operations

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "embcache"

LAYERS = [
    ["hashing", "profiling", "native", "hostmem", "devices"],
    ["backend"],
    ["indexing"],
    ["ops"],
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


# ----------------------------------------------------------------------------------------------
# function length

MAX_FUNCTION_LINES = 100

# Functions allowed over MAX_FUNCTION_LINES, by "path:qualified name", each with the reason it was
# not split. An entry is a debt: the test below fails once its function fits (drop it then).
LONG_FUNCTIONS: dict[str, str] = {
    # Functions allowed past the limit, each with its reason (none today).
}


def _function_lengths(package: Path) -> dict[str, int]:
    """Lines of every function and method under ``package``, by ``"path:qualified name"``
    (path from the package's parent; a nested function as ``outer.inner``), counted from its
    ``def`` line to the end of its body: docstring included, decorators not. Of two
    definitions under one name (a property's getter and setter) the longer counts."""
    lengths: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent).as_posix()

        def visit(node: ast.AST, prefix: str, where: str = where) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{where}:{prefix}{child.name}"
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    lengths[name] = max(lines, lengths.get(name, 0))
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text(), filename=str(path)), "")
    return lengths


def test_no_function_is_over_100_lines() -> None:
    """A function that does not fit on a screen or two is several steps in one: split it into
    named parts that read top-down (a parser built from its argument groups, a job from its
    phases, a loop from its setup, one pass and its summary)."""
    long = {
        name: lines
        for name, lines in _function_lengths(PACKAGE).items()
        if lines > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(
        f"{name}: {lines} lines" for name, lines in sorted(long.items())
    )


def test_the_long_function_allowlist_is_still_needed() -> None:
    lengths = _function_lengths(PACKAGE)
    stale = [
        f"{name}: {lengths[name]} lines" if name in lengths else f"{name}: no such function"
        for name in LONG_FUNCTIONS
        if lengths.get(name, 0) <= MAX_FUNCTION_LINES
    ]
    assert not stale, "LONG_FUNCTIONS entries that now fit (remove them):\n" + "\n".join(stale)


def test_the_length_check_sees_a_long_function(tmp_path: Path) -> None:
    """Lines from ``def`` to the body's end, docstring included, decorators not; methods and
    nested functions by their qualified names: a planted example."""
    pkg = tmp_path / "embcache" / "cli"
    pkg.mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(98))
    (pkg / "long.py").write_text(
        "import functools\n\n\n"
        "@functools.cache\n"
        f'def long():\n    """Docstring."""\n{body}'  # 1 + 1 + 98 = 100 lines
        "\n\nclass Job:\n"
        f'    def run(self):\n        """Docstring."""\n{body.replace("    ", "        ")}'
        "        def inner():\n            return 1\n"  # 1 + 1 + 98 + 2 = 102 lines
    )
    lengths = _function_lengths(tmp_path / "embcache")
    assert lengths == {
        "embcache/cli/long.py:long": 100,
        "embcache/cli/long.py:Job.run": 102,
        "embcache/cli/long.py:Job.run.inner": 2,
    }


# ----------------------------------------------------------------------------------------------
# op families bound once (`embcache.ops`)

# The families moved under `embcache/ops/` (the registry's `Ops`: a new one is checked here the
# day it is registered), and each implementation a family may have there.
MIGRATED = tuple(families())
IMPLEMENTATION_MODULES = ("spec", "triton", "native")
# The compiled CPU loops of the migrated families: called by their `ops/<family>/native.py`
# alone, straight from the kernels' modules (`native.plan_kernels`, `row_kernels`,
# `direct_kernels`), which hold other families' loops too.
MIGRATED_NATIVE = frozenset(
    {"first_bad_key", "unique_rows", "unique_values", "plan_lru", "plan_lfu", "touch_lfu",
     "reserve", "scratch_done", "free_slots", "bags_sample_major", "direct_rows"}
)  # fmt: skip
# The names a module holds `embcache.native` or its kernels' modules by.
NATIVE_HOLDERS = ("native", "native_module", "plan_kernels", "row_kernels", "direct_kernels")
# Modules outside `embcache/ops/` allowed to reach an implementation, or to ask which one is
# present, in a migrated family, each with its reason (a debt: the tests below fail once it is
# paid, so drop the entry then).
IMPLEMENTATION_DEBTS: dict[str, str] = {
    # Modules allowed to reach an implementation, each with its reason (none today).
}
# What asks which implementation is present: per call (``use_triton``), or a
# held `Backend`'s family (``backend.compiled``, ``backend.triton``). Choosing the `Backend`
# once for a cache (``for_device``) and binding its `Ops` is the one choice, not an asking.
ASKING_CALLS = ("use_triton",)
ASKING_FACTS = ("compiled", "triton")
FAMILY_MODULES = (
    *(f"embcache.ops.{f}" for f in MIGRATED),
    "embcache.ops.registry",
    "embcache.kernels.ids",
    "embcache.kernels.cache_index",
    "embcache.kernels.pooling",
    "embcache.kernels.gather",
    "embcache.kernels.optim",
    "embcache.kernels.optim_rules",
    "embcache.kernels.rounding",
)


def test_every_registered_family_is_a_folder_of_implementations() -> None:
    """Each family of the registry is a folder ``embcache/ops/<family>/`` with its protocol in
    its ``__init__.py`` and a ``spec.py``; the registry lists exactly its implementation
    modules there."""
    assert {"ids", "plan", "rows", "pooling", "gather", "update"} <= set(MIGRATED)
    for family in MIGRATED:
        assert (PACKAGE / "ops" / family / "__init__.py").is_file()
        assert operations(family), f"the {family} protocol declares no operation"
        found = implementations(family)
        assert "spec" in found and set(found) <= set(IMPLEMENTATION_MODULES), found
        on_disk = {p.stem for p in (PACKAGE / "ops" / family).glob("*.py")}
        assert set(found) == on_disk & set(IMPLEMENTATION_MODULES)


def _reaches_an_implementation(name: str, path: Path) -> list[str]:
    """Where module ``name`` imports a migrated family's implementation module or compiled
    loops, or asks which implementation is present."""
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    impls = {f"embcache.ops.{f}.{m}" for f in MIGRATED for m in IMPLEMENTATION_MODULES}
    modules = _modules()
    for imported, names, line in _imports(name, path):
        targets = set(_target(imported, names, modules)) | {imported}
        if targets & impls:
            found.append(f"{where}:{line} imports {sorted(targets & impls)}")
        if imported.startswith("embcache.native") and MIGRATED_NATIVE & set(names):
            found.append(f"{where}:{line} imports {sorted(set(names))}")
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in MIGRATED_NATIVE
            and isinstance(node.value, ast.Name)
            and node.value.id in NATIVE_HOLDERS
        ):
            found.append(f"{where}:{node.lineno} {node.value.id}.{node.attr}")
    uses_family = any(
        t.startswith(FAMILY_MODULES)
        for imported, names, _ in _imports(name, path)
        for t in _target(imported, names, modules)
    )
    if uses_family:
        for node in ast.walk(tree):
            called = node.func if isinstance(node, ast.Call) else None
            ident = getattr(called, "attr", None) or getattr(called, "id", None)
            if ident in ASKING_CALLS:
                found.append(f"{where}:{node.lineno} {ident}()")
            holder = node.value if isinstance(node, ast.Attribute) else None
            held = getattr(holder, "attr", None) or getattr(holder, "id", None)
            if held == "backend" and isinstance(node, ast.Attribute) and node.attr in ASKING_FACTS:
                found.append(f"{where}:{node.lineno} backend.{node.attr}")
    return found


def test_only_ops_reaches_the_implementations_of_a_migrated_family() -> None:
    """Outside `embcache/ops/`, no module imports a migrated family's ``spec``/``triton``/
    ``native`` module or its compiled loops, and no module that calls a migrated family asks
    which implementation is present (``use_triton``, ``backend.compiled``,
    ``backend.triton``): it holds the `Ops` bound for its cache (``HotCache.ops``) and asks
    the protocol's capabilities (``ops.plan.compiled``), or calls a public function that binds
    for its tensor (`kernels.ids`, `kernels.cache_index`, `kernels.pooling`,
    `kernels.gather`, `kernels.optim`, `kernels.rounding`)."""
    found = {}
    for name, path in _modules().items():
        if name.startswith(("embcache.ops", "embcache.native")):
            continue
        reached = _reaches_an_implementation(name, path)
        if reached:
            found[name] = reached
    wrong = {name: where for name, where in found.items() if name not in IMPLEMENTATION_DEBTS}
    assert not wrong, "\n".join(w for where in wrong.values() for w in where)
    paid = sorted(set(IMPLEMENTATION_DEBTS) - set(found))
    assert not paid, f"IMPLEMENTATION_DEBTS entries no longer needed (remove them): {paid}"


def test_the_implementation_check_sees_a_violation(tmp_path: Path) -> None:
    """A planted module that imports an implementation, a compiled loop and asks."""
    pkg = tmp_path / "embcache" / "cache"
    pkg.mkdir(parents=True)
    bad = pkg / "bad.py"
    bad.write_text(
        "import embcache.native as native\n"
        "from embcache.ops.ids import spec\n"
        "from embcache.kernels.backend import use_triton\n"
        "native.plan_lru()\nuse_triton(None)\nself.backend.compiled\n"
        "from embcache.native import row_kernels\nrow_kernels.bags_sample_major()\n"
    )
    found = _reaches_an_implementation("embcache.cache.bad", bad)
    assert len(found) == 5, found
