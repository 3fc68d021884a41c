"""docs/design.md cites code by name; every name it cites exists.

The document is checked as a reader would use it: each backticked span (and each name in the
training step's diagram) is classified, then checked where it claims to live.

- A file or folder (`kv/base.py`, `tests/...`, `benchmarks/...`, `native/`) exists in the
  repository, at the root or under ``embcache/``; a bare file name exists somewhere in it.
- A dotted name resolves (`tests/code_names.py`, which reads the package with `ast`):
  module-qualified (`kv.base.HashedInit`, `embcache.backend`) through the package's modules;
  `Class.attr` through a class of that name under ``embcache/`` that defines the attribute (a
  method, a class-level or ``self.`` field), itself or through a base class; torch's and
  triton's names by import; keywords of a call (`TrainPipeline(prefetch=True)`) are
  parameters of the callee. In the training step's diagram a name after a file
  (``engine/inputs.py  as_jagged``) is defined in that file.
- A bare identifier (`fuse_ids`, `defer_writeback`) is a name the project's Python code
  defines or uses (a definition, a parameter, an attribute, a keyword or a string key).
- A ``make`` target is in the Makefile, an ``embcache`` subcommand and a ``--flag`` are in the
  CLI's parser, an environment variable is read where `ENV_VARS` says.
- A section named after a document (``README, "On a GPU"``, ``docs/memory.md, "..."``) or
  inside this one (``see "Backends and devices"``) is a heading there.
- A count and a list: the methods of `SparseParameters`, and the modules that call the
  compiled passes directly (under "Backends and devices"), against the imports.

What is not a code name (a shape, a formula, a key pattern, a shell command) is listed in
`NOT_CODE` with the reason, and a name that lives outside Python (a benchmark case, a state
key, a pytest marker) in `ELSEWHERE` with the file that must contain it; a span that fits
nowhere fails, so that a new citation gets a check or a reason.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.code_names import (
    IDENT,
    PACKAGE,
    ROOT,
    accepts,
    class_has,
    external_has,
    module_name,
    package_index,
    path_exists,
    used_names,
)
from tests.code_names import resolves as resolves_in_code

DOC = ROOT / "docs" / "design.md"

# Spans that are not names: shapes, formulas, key patterns, shell commands and values.
NOT_CODE = {
    "(score, id)": "an ordering key",
    "[0, 2**fusion_k)": "an interval",
    "id | table << fusion_k": "a formula",
    "mix64(id ^ salt) % num_sets": "a formula",
    "{key: JaggedTensor}": "a type in words",
    "<op>_triton": "a naming pattern",
    "cuda:<current device>": "a device string",
    "feature@table": "a naming pattern",
    "embeddings.<table>.weight": "a state_dict key pattern",
    "allkeys-*": "Redis policy names",
    "volatile-*": "Redis policy names",
    "maxmemory-policy": "a Redis setting",
    "import embcache": "a Python statement",
    "ruff check": "a shell command",
    "ruff format --check": "a shell command",
    "with": "the Python keyword",
    "llvm.prefetch": "an LLVM intrinsic",
    "ns:tier": "a Redis key",
    "ns:record": "a Redis key",
    "ns:jobs": "a Redis key",
    "?shared=1": "a URL query",
    "://": "a URL's separator",
    "tiered+": "a URL scheme's prefix",
    "module:Class": "the form of a registered policy's home",
}

# Names that live outside Python code (state keys, folders, a Makefile variable): the file or
# folder that must contain the text.
ELSEWHERE = {
    "TYPED": ("Makefile", "TYPED :="),
    "inits/": ("embcache/checkpoint", '"inits"'),
    "t0.momentum1": ("embcache/torchrec/kernel.py", "momentum1"),
    "t0.weight.momentum_1": ("embcache/models/torch_optim.py", "momentum_1"),
    "t0_rows500_cols0": ("embcache/torchrec", "_rows{"),
    '"init"': ("embcache/checkpoint", '"init"'),
    '"<kv_client>"': ("embcache/checkpoint", '"<kv_client>"'),
    "embcache::pooled_lookup": ("embcache/models/collection.py", '"embcache::pooled_lookup"'),
    "~/.cache/embcache/": ("tests/gpu_image/build.sh", "$HOME/.cache}/embcache"),
    ".venv": ("Makefile", "VENV := .venv"),
    "$XDG_STATE_HOME/embcache/tiers/": ("embcache/cli/tier_record.py", "XDG_STATE_HOME"),
}

# Variables the document names methods on, and the type each stands for.
VARIABLES = {
    "module": "SparseParameters",
    "optimizer": "SparseOptimizer",
    "collection": "CachedEmbeddingBagCollection",
    "loss": "torch.Tensor",
    "model": "torch.nn.Module",
    "grad_anchor": "torch.Tensor",
    "request": "_pytest.fixtures.FixtureRequest",
}

# Third-party names cited bare or on a variable: ``module:Class.attribute`` (read with ast, not
# imported; unchecked where the package is not installed).
TORCHREC = "torchrec.distributed"
EXTERNAL = {
    "model.fused_optimizer": f"{TORCHREC}.model_parallel:DistributedModelParallel.fused_optimizer",
    "cache_params.load_factor": f"{TORCHREC}.types:CacheParams.load_factor",
    "input_dist": f"{TORCHREC}.embeddingbag:ShardedEmbeddingBagCollection.input_dist",
    "compute_and_output_dist": (
        f"{TORCHREC}.embeddingbag:ShardedEmbeddingBagCollection.compute_and_output_dist"
    ),
    "PrefetchPipelinedForward": (
        f"{TORCHREC}.train_pipeline.runtime_forwards:PrefetchPipelinedForward"
    ),
    "TorchFunctionMode": "torch.overrides:TorchFunctionMode",
}

# Environment variables and where each must be read (as a string in that file or folder).
ENV_VARS = {
    "EMBCACHE_BACKEND": "embcache/backend.py",
    "EMBCACHE_TEST_SUBSET": "tests/conftest.py",
    "TRITON_INTERPRET": "tests/conftest.py",
    "OUT": "benchmarks/gpu_check.sh",
}

DOTTED = rf"{IDENT}(?:\.{IDENT})*"
NAME_SPAN = re.compile(rf"^(?P<name>{DOTTED})(?P<call>\(.*\))?(?:\s*\[.*\])?(?:\s*->.*)?$")
KEYWORD_SPAN = re.compile(rf"^(?P<name>{IDENT})=(?P<value>.*)$")
ENV_SPAN = re.compile(r"^\$?(?P<name>[A-Z][A-Z0-9_]*)(?:=\S+)?$")
PATH_SPAN = re.compile(r"^(?:[\w.~$/-]*(?:/|\.(?:py|sh|md|toml))|[\w.-]+/[\w./-]+)$")
COMMAND_SPAN = re.compile(r"^(?P<path>[\w./-]+\.(?:py|sh)) (?P<flags>(?:--[\w-]+ ?)+)$")
ATTRIBUTE_SPAN = re.compile(rf"^\.(?P<name>{IDENT})$")
SHAPE_SPAN = re.compile(r"^\[.*\]$")


def used() -> frozenset[str]:
    """`used_names` but this file's, which cites stale names as examples."""
    return used_names(Path(__file__).resolve())


def resolves(dotted: str) -> bool:
    """`resolves_in_code`, a variable of the document (`VARIABLES`) read as its type."""
    root, _, rest = dotted.partition(".")
    return resolves_in_code(f"{VARIABLES[root]}.{rest}" if root in VARIABLES else dotted)


def _contains(where: str, text: str) -> bool:
    place = ROOT / where
    files = sorted(place.rglob("*")) if place.is_dir() else [place]
    return any(f.is_file() and text in f.read_text(errors="replace") for f in files)


@cache
def makefile_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([\w-]+):", text, flags=re.M))


def _flag_exists(flag: str) -> bool:
    if flag == "--help":
        return True  # argparse's own
    return _contains("embcache/cli", f'"{flag}"') or _contains("Makefile", flag)


def check_span(span: str) -> str | None:
    """None when the span names something that exists, else what is wrong."""
    name = span.removesuffix("()")
    if span in NOT_CODE:
        return None
    if span in ELSEWHERE:
        where, text = ELSEWHERE[span]
        return None if _contains(where, text) else f"{text!r} is not in {where}"
    if span in EXTERNAL:
        return None if external_has(EXTERNAL[span]) else f"no {EXTERNAL[span]}"
    if span.startswith("make "):
        target = span.split()[1]
        return None if target in makefile_targets() else f"no Makefile target {target}"
    if span.startswith("embcache "):
        command = span.split()[1]
        return None if _contains("embcache/cli/__init__.py", f'"{command}"') else "no command"
    if span.startswith("--"):
        return None if _flag_exists(span) else "no such flag"
    if (m := ENV_SPAN.match(span)) and m["name"] in ENV_VARS:
        where = ENV_VARS[m["name"]]
        return None if _contains(where, m["name"]) else f"not read in {where}"
    if span.startswith("benchmarks/") and (m := re.match(rf"^(.+)\.({IDENT})$", span)):
        file = ROOT / f"{m[1]}.py"
        if file.is_file():
            return None if f"def {m[2]}(" in file.read_text() else f"no {m[2]} in {file.name}"
    if m := COMMAND_SPAN.match(span):
        if not path_exists(m["path"]):
            return "no such file"
        flags = [f for f in m["flags"].split() if f not in (ROOT / m["path"]).read_text()]
        return f"{m['path']} has no {flags}" if flags else None
    if PATH_SPAN.match(span):
        return None if path_exists(span) else "no such file"
    if m := ATTRIBUTE_SPAN.match(span):
        return None if m["name"] in used() else "not a name the code defines or uses"
    if SHAPE_SPAN.match(span):
        return None
    if m := KEYWORD_SPAN.match(span):
        return None if m["name"] in used() else "no such parameter"
    if m := NAME_SPAN.match(name):
        dotted = m["name"]
        if "." in dotted:
            for keyword in re.findall(rf"\b({IDENT})=", m["call"] or ""):
                if not accepts(dotted, keyword):
                    return f"no parameter {keyword}"
            return None if resolves(dotted) else "does not resolve"
        return None if dotted in used() else "not a name the code defines or uses"
    return "not classified: give it a check, or a reason in NOT_CODE"


def _without_fences(text: str) -> str:
    """The text with each fenced block blanked, its lines kept."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S | re.M)


def spans(text: str) -> list[tuple[int, str]]:
    """(line, text) of every backticked span outside fenced blocks, ``double`` ones included."""
    prose = _without_fences(text)
    return [
        (prose.count("\n", 0, m.start()) + 1, " ".join(m[2].split()))
        for m in re.finditer(r"(``?)(?!`)(.+?)\1(?!`)", prose, flags=re.S)
    ]


# The training step's diagram: a file, then the names it defines ("engine/inputs.py  as_jagged,
# checked_batch"), and dotted names anywhere (`EngineGroup.prepare`, `module.flush()`).
DIAGRAM_FILE = re.compile(rf"(?P<path>[\w/]+\.py)[ \t]+(?P<names>{DOTTED}(?:,[ \t]*{DOTTED})*)")
DIAGRAM_DOTTED = re.compile(rf"(?<![\w/.])({IDENT}\.{IDENT})(?![\w/])")
DIAGRAM_SNAKE = re.compile(rf"(?<![\w/.])({IDENT}_{IDENT})(?![\w/.(])")


def diagram_problems(text: str) -> list[str]:
    """What is wrong with the names of every fenced block of the document."""
    problems = []
    for block in re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        first = text.count("\n", 0, block.start(1)) + 1
        for offset, line in enumerate(block[1].splitlines()):
            at = f"line {first + offset}"
            for path in re.findall(r"[\w/]+\.py\b", line):
                if not (PACKAGE / path).is_file():
                    problems.append(f"{at}: {path}: no such file")
            after_files = set()
            for m in DIAGRAM_FILE.finditer(line):
                path = PACKAGE / m["path"]
                if not path.is_file():
                    continue
                module = package_index()[module_name(path)]
                after_files |= set(re.split(r",[ \t]*", m["names"]))
                for name in re.split(r",[ \t]*", m["names"]):
                    owner, _, attr = name.partition(".")
                    if not attr and owner not in module.defined:
                        problems.append(f"{at}: {name} is not defined in {m['path']}")
                    elif attr and not (owner in module.classes and class_has(owner, attr)):
                        problems.append(f"{at}: {name} is not a class of {m['path']} with it")
            for dotted in DIAGRAM_DOTTED.findall(line):
                if dotted not in after_files and not resolves(dotted):
                    problems.append(f"{at}: {dotted} does not resolve")
            for snake in DIAGRAM_SNAKE.findall(line):
                if snake not in after_files and snake not in used():
                    problems.append(f"{at}: {snake} is not a name the code defines or uses")
    return problems


def headings(path: Path) -> set[str]:
    """A Markdown file's headings, and its bold paragraph leads (``**The TBE step**``)."""
    text = _without_fences(path.read_text())
    found = {h.strip() for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    return found | set(re.findall(r"^\*\*(.+?)\*\*", text, flags=re.M))


SECTION_REF = re.compile(
    r'(?P<doc>README(?:\.md)?|docs/[\w-]+\.md|benchmarks/README\.md), "(?P<section>[^"]+)"'
    r'|[Ss]ee "(?P<here>[^"]+)"'
    r"|(?P<link>README\.md|docs/[\w-]+\.md)#(?P<anchor>[\w-]+)"
)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def section_problems(text: str) -> list[str]:
    """Sections named by the document that its target does not have."""
    problems = []
    for m in SECTION_REF.finditer(" ".join(text.split())):
        if m["here"]:
            if m["here"] not in headings(DOC):
                problems.append(f'see "{m["here"]}": no such section here')
        elif m["link"]:
            target = ROOT / m["link"]
            if m["anchor"] not in {_anchor(h) for h in headings(target)}:
                problems.append(f"{m['link']}#{m['anchor']}: no such heading")
        else:
            target = ROOT / (m["doc"] if m["doc"].endswith(".md") else "README.md")
            if m["section"] not in headings(target):
                problems.append(f'{m["doc"]}, "{m["section"]}": no such heading')
    return problems


NUMBERS = dict(one=1, two=2, three=3, four=4, five=5, six=6, seven=7, eight=8, nine=9, ten=10)


def protocol_methods() -> list[str]:
    """The methods of `SparseParameters` (optim/protocol.py)."""
    tree = ast.parse((PACKAGE / "optim" / "protocol.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SparseParameters"]
    return [n.name for n in cls.body if isinstance(n, ast.FunctionDef)]


def native_callers() -> set[str]:
    """The modules outside native/ and backend.py that import embcache.native, as the document
    names them (``plan.py``; ``kv/host.py`` outside cache/)."""
    callers = set()
    for name, module in package_index().items():
        if name.startswith("embcache.native") or name == "embcache.backend":
            continue
        tree = ast.parse(module.path.read_text())
        for n in ast.walk(tree):
            imported = []
            if isinstance(n, ast.ImportFrom) and n.module:
                imported = [n.module, *(f"{n.module}.{a.name}" for a in n.names)]
            elif isinstance(n, ast.Import):
                imported = [a.name for a in n.names]
            if any(i == "embcache.native" or i.startswith("embcache.native.") for i in imported):
                rel = module.path.relative_to(PACKAGE)
                callers.add(rel.name if rel.parts[0] == "cache" else str(rel))
    return callers


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def test_every_cited_span_exists(doc: str) -> None:
    problems = [f"line {line}: `{s}`: {why}" for line, s in spans(doc) if (why := check_span(s))]
    assert not problems, "docs/design.md cites what is not there:\n" + "\n".join(problems)


def test_every_name_in_the_diagram_exists(doc: str) -> None:
    problems = diagram_problems(doc)
    assert not problems, "the training step's diagram:\n" + "\n".join(problems)


def test_every_named_section_exists(doc: str) -> None:
    problems = section_problems(doc)
    assert not problems, "\n".join(problems)


def test_the_protocol_has_as_many_methods_as_the_document_says(doc: str) -> None:
    m = re.search(r"`SparseParameters`.{0,200}?through (\w+) methods", " ".join(doc.split()))
    assert m, "the sentence that counts the methods of SparseParameters moved: update this test"
    assert NUMBERS.get(m[1]) == len(protocol_methods()), (m[1], protocol_methods())


def test_the_callers_of_the_compiled_passes_are_all_named(doc: str) -> None:
    m = re.search(
        r"- The compiled passes are called by(.*?)\n- ",
        doc,
        re.S,
    )
    assert m, "the sentence that lists the callers of native/ moved: update this test"
    named = {p for p in re.findall(r"`([\w/]+\.py)`", m[1]) if not p.startswith("tests/")}
    assert named == native_callers(), (sorted(named), sorted(native_callers()))


@pytest.mark.parametrize(
    ("span", "exists"),
    [
        ("HotCache.flush", True),
        ("HotCache.flush_everything", False),
        ("kv.base.HashedInit", True),
        ("kv.base.HashedInitial", False),
        ("embcache.kv.base.Store.get_grouped", True),
        ("check_batch", False),
        ("checked_batch", True),
        ("engine/inputs.py", True),
        ("engine/input.py", False),
        ("tests/cache/test_hot_cache.py", True),
        ("make lint", True),
        ("make lints", False),
        ("EMBCACHE_BACKEND=torch", True),
        ("CacheConfig.admit_after", True),
        ("TrainPipeline(prefetch=True)", True),
        ("row_init.table_inits(per_table=True)", True),
        ("row_init.table_inits(per_tables=True)", False),
        ("torch.optim.Optimizer", True),
        ("a new spelling", False),
    ],
    ids=lambda v: str(v),
)
def test_the_checks_tell_names_from_stale_ones(span: str, exists: bool) -> None:
    assert (check_span(span) is None) == exists, check_span(span)


def test_a_stale_name_in_the_diagram_is_found() -> None:
    stale = "```\n engine/inputs.py  as_jagged, check_batch\n EngineGroup.prepared\n```\n"
    assert diagram_problems(stale) == [
        "line 2: check_batch is not defined in engine/inputs.py",
        "line 3: EngineGroup.prepared does not resolve",
    ]


def test_a_moved_section_is_found() -> None:
    assert section_problems('(README, "Cache counters")') == [
        'README, "Cache counters": no such heading'
    ]
    assert section_problems('(docs/memory.md, "Cache counters")') == []
