"""The Makefile's pins resolve: pip's resolver, run over exactly what `make venv` installs.

``make -s install-args`` prints the first install's arguments (torch's CPU build, triton, the
checkout with its extras, and ``--extra-index-url`` for PyTorch's CPU index when pip's own
sources lack that build) and, on a second line, what goes in with ``--no-deps``. Each test runs
``pip install --dry-run --ignore-installed --report`` with this machine's pip configuration (on
these machines a local wheel directory holds torch's CPU build; PyPI serves the rest): a
conflict fails, and so does an index that cannot be reached, with pip's own words. Nothing is
installed (pip fetches what it must read the metadata of: about 1 GB here, in seconds).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip"]
# As in a fresh venv; --no-build-isolation: the checkout's metadata built with this venv's
# setuptools (what it resolves to does not change).
DRY_RUN = [*PIP, "install", "--dry-run", "--ignore-installed", "--no-build-isolation"]
DRY_RUN += ["--disable-pip-version-check"]
CUDA_PREFIXES = ("nvidia-", "cuda-")


def install_args() -> tuple[list[str], list[str]]:
    """The Makefile's two installs: (the resolved one's arguments, the ``--no-deps`` one's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "install-args", f"PIP={shlex.join(PIP)}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    first, nodeps = done.stdout.splitlines()
    return shlex.split(first), shlex.split(nodeps)


def resolve(tmp_path: Path, *args: str) -> dict[str, dict]:
    """pip's resolver over ``args`` as in a fresh venv: {normalised name: its metadata}. Fails
    with pip's message on a conflict or an unreachable index."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [*DRY_RUN, "-q", "--report", str(report), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (
        f"pip cannot resolve {shlex.join(args)} (a conflict, or no index reachable: pip's "
        f"configuration here is `pip config list`):\n{done.stderr[-4000:]}"
    )
    installs = json.loads(report.read_text())["install"]
    return {_norm(i["metadata"]["name"]): i["metadata"] for i in installs}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _pin(args: list[str], name: str) -> str:
    """The argument of ``args`` that pins ``name`` (``name==X``)."""
    (pin,) = [a for a in args if a.startswith(f"{name}==")]
    return pin


def _pinned(args: list[str], name: str) -> str:
    """The version ``args`` pin ``name`` to (``name==X``)."""
    return _pin(args, name).split("==", 1)[1]


def test_the_makefile_installs_resolve_together(tmp_path: Path) -> None:
    args, nodeps = install_args()
    found = resolve(tmp_path, *args)
    versions = {name: meta["version"] for name, meta in found.items()}
    for name in ("torch", "triton"):
        assert versions[name] == _pinned(args, name), versions
    assert versions["torch"].endswith("+cpu"), "the CPU build of torch"
    assert versions["fbgemm-gpu-cpu"] == "1.8.0", versions
    cuda = sorted(name for name in found if name.startswith(CUDA_PREFIXES))
    assert not cuda, f"the CPU pins pulled CUDA packages: {cuda}"

    # Whatever triton the pinned torch declares (its CUDA build does), the pinned one satisfies.
    env = default_environment()
    for line in found["torch"].get("requires_dist", []):
        req = Requirement(line)
        if _norm(req.name) == "triton" and (req.marker is None or req.marker.evaluate(env)):
            assert req.specifier.contains(versions["triton"]), (line, versions["triton"])

    # torchrec, with --no-deps: it exists for this Python, and what it declares is installed
    # by the first install, but for the two it is installed without on purpose (the CUDA
    # fbgemm-gpu, whose modules fbgemm-gpu-cpu provides; torchmetrics==1.0.3: a newer one runs).
    (tmp_path / "nodeps").mkdir()
    torchrec = resolve(tmp_path / "nodeps", "--no-deps", *nodeps)["torchrec"]
    assert torchrec["version"] == _pinned(nodeps, "torchrec")
    for line in torchrec.get("requires_dist", []):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        if _norm(req.name) in ("fbgemm-gpu", "torchmetrics"):
            assert _norm(req.name) in found or "fbgemm-gpu-cpu" in found
            continue
        assert _norm(req.name) in found, f"torchrec needs {line}; the Makefile installs no such"


def test_the_triton_pin_is_the_one_pypis_torch_requires(tmp_path: Path) -> None:
    """On a stock index without PyTorch's CPU index, torch==2.13.0 is PyPI's CUDA build, which
    requires an exact triton: the Makefile's triton pin must be that one, so that the same pins
    resolve there too."""
    args, _ = install_args()
    torch_version = _pinned(args, "torch").split("+")[0]
    cuda_torch = resolve(tmp_path, "--no-deps", f"torch==={torch_version}")["torch"]
    env = default_environment()
    wanted = [
        Requirement(line)
        for line in cuda_torch.get("requires_dist", [])
        if _norm(Requirement(line).name) == "triton"
    ]
    assert [r for r in wanted if r.marker is None or r.marker.evaluate(env)], wanted
    for req in wanted:
        assert req.specifier.contains(_pinned(args, "triton")), (str(req), args)


def test_the_torchrec_extra_refuses_another_torch() -> None:
    """fbgemm-gpu-cpu 1.8.0 is built against torch 2.13: asked for beside another torch, the
    [torchrec] extra is refused, and pip's message names the pin. (2.14.1: a release that lies
    on these machines' disk, so that pip reads it there.)"""
    args, _ = install_args()
    done = subprocess.run(
        [*DRY_RUN, "torch==2.14.1", _pin(args, "triton"), ".[torchrec]"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, "pip accepted the [torchrec] extra beside torch 2.14.1"
    assert "ResolutionImpossible" in out, out[-3000:]
    assert re.search(r"embcache\[torchrec\] .*depends on torch==2\.13\.\*", out), out[-3000:]
