"""Does every Triton kernel compile for the GPU, here, without one?

Question: with the Triton installed in this Python, does each kernel variant that embcache
launches compile all the way to a CUDA binary (``ptxas`` included) for a given architecture
(default sm_90, the H200's)? Answered without a GPU, so that a kernel the interpreter accepts
but the compiler refuses (the interpreter runs Python, not Triton's compiler) is caught before
any GPU time is spent, and across Triton versions (the GPU image has 3.6, this project pins 3.8).

Two phases, two processes: ``--record`` runs the GPU check's preflight at its tiny size (dims 8
and 300) through Triton's interpreter and writes every launch's kernel, argument types,
constexprs and options to a JSON file; the default phase (no interpreter) compiles each distinct
variant with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", ARCH, 32))``. One line
per variant, each naming the Triton version that compiled it; exit status 1 if any fails. The
record phase also fails when a kernel of an op family in `embcache.ops.registry`
(`triton_kernels`) was never launched: a new family's kernels are compiled the day it is
registered, or the preflight is told to launch them.

A constexpr a launcher picks by device (`DEVICE_CONSTEXPRS`: one unique id per program,
``BLOCK_U=1``, on CUDA; 64 under the interpreter, which pays per program) is recorded at its CPU
value and compiled at the value the GPU launches, so the variants compiled are the GPU's.

    python benchmarks/compile_kernels.py [--arch 90] [--launches FILE] [--json OUT]

``--launches FILE`` compiles the launches recorded in FILE (a record phase's output, or the
test's) instead of recording them; ``--json OUT`` writes each variant's result there.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Constexprs the launchers choose by device: the value a CUDA device launches, where the
# interpreter (CPU tensors) is given a wider one. BLOCK_U, chunks (or ids) per program of the
# segment walks (`ops.update.triton.aggregate_grads_triton`,
# `ops.pooling.triton.pool_backward_triton`, `ops.gather.triton.gather_backward_triton`:
# ``block_u = 1 if <cuda> else 64``): one on a GPU.
DEVICE_CONSTEXPRS = {"BLOCK_U": 1}
# The dims every phase records at: one column block, and several of the widest.
RECORD_DIMS = (8, 300)


def compile_key(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, tuple]:
    """What Triton's JIT keys a launch of ``fn`` (an interpreted kernel) on: its signature
    (``{name: "*fp32" | "i32" | "i64" | "fp32" | "constexpr" ...}``), its constexprs, and a
    hashable key that also holds each argument's specialisation (``"D"``: an integer or a
    pointer divisible by 16; an integer 1 becomes a constexpr), computed by Triton's own
    ``native_specialize_impl`` with the kernel's ``do_not_specialize`` list and each
    parameter's type annotation, as `triton.runtime.jit` does before compiling. Two launches
    with different keys compile two variants on a GPU."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import KernelParam

    params = inspect.signature(fn.fn).parameters
    bound = dict(zip(params, args, strict=False)) | {k: kwargs[k] for k in params if k in kwargs}
    dns = set(fn.kwargs.get("do_not_specialize") or ())
    signature, constexprs, key = {}, {}, []
    for i, (name, p) in enumerate(params.items()):
        value = bound[name]
        kp = KernelParam(i, p, i in dns or name in dns, False)
        if kp.is_constexpr:
            constexprs[name] = value
            signature[name] = "constexpr"
            key.append(("constexpr", value))
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, False, not kp.do_not_specialize, True)
        if ty == "constexpr":  # an integer 1 (or None) is compiled in, as Triton does
            constexprs[name] = spec
        elif kp.annotation_type:  # a declared type wins over the value's
            ty = kp.annotation_type
        signature[name] = ty
        key.append((ty, spec))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return signature, constexprs, (fn.fn.__module__, fn.fn.__name__, tuple(key), options)


@contextmanager
def recording() -> Iterator[list[dict]]:
    """While open, every launch of a Triton kernel through the interpreter (``TRITON_INTERPRET=1``
    set before triton was imported) is recorded, once per distinct variant, in the list given:
    its kernel, argument types, constexprs and launch options."""
    from triton.runtime import interpreter

    seen: dict[str, dict] = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        # "*fp32" for a tensor, "i32"/"i64"/"fp32" for a scalar (its annotation's, if typed)
        signature, constexprs, _ = compile_key(self, args, kwargs)
        options = {k: v for k, v in kwargs.items() if k not in params}
        entry = {
            "module": self.fn.__module__,
            "kernel": self.fn.__name__,
            "signature": signature,
            "constexprs": constexprs,
            "options": options,
        }
        if json.dumps(entry, sort_keys=True) not in seen:
            seen[json.dumps(entry, sort_keys=True)] = entry
            launches.append(entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    launches: list[dict] = []
    interpreter.InterpretedFunction.run = recording_run
    try:
        yield launches
    finally:
        interpreter.InterpretedFunction.run = run


def record(path: Path) -> None:
    """Run the tiny preflight under the interpreter, writing each distinct launch to ``path``."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(HERE))
    import gpu_preflight  # its _common puts this checkout's embcache first

    with recording() as launches, open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            status = max(
                gpu_preflight.main(["--device", "cpu", "--tiny", "--dim", str(dim)])
                for dim in RECORD_DIMS
            )
        finally:
            sys.stdout = stdout
    if status != 0:
        raise SystemExit(f"the preflight failed under the interpreter (status {status})")
    missing = unlaunched(launches)
    if missing:
        raise SystemExit(f"registered kernels never launched, so never compiled: {missing}")
    path.write_text(json.dumps(launches, indent=1))


def unlaunched(launches: list[dict]) -> list[str]:
    """The kernels of the registry's op families (`embcache.ops.registry.triton_kernels`)
    that no recorded launch ran, as ``module.kernel``."""
    from embcache.ops.registry import families, triton_kernels

    ran = {(e["module"], e["kernel"]) for e in launches}
    return [
        f"{fn.fn.__module__}.{name}"
        for family in families()
        for name, fn in triton_kernels(family).items()
        if (fn.fn.__module__, name) not in ran
    ]


def device_variants(entries: list[dict]) -> list[dict]:
    """The variants a CUDA device launches for the recorded ``entries``: each with the
    constexprs of `DEVICE_CONSTEXPRS` set to their device values (recorded ones kept under
    ``"recorded"``), distinct, in the order first recorded."""
    out: dict[str, dict] = {}
    for e in entries:
        changed = {
            k: v for k, v in e["constexprs"].items() if k in DEVICE_CONSTEXPRS
            and v != DEVICE_CONSTEXPRS[k]
        }  # fmt: skip
        variant = {k: e[k] for k in ("module", "kernel", "signature", "options")}
        variant["constexprs"] = {
            k: DEVICE_CONSTEXPRS.get(k, v) if k in changed else v
            for k, v in e["constexprs"].items()
        }
        key = json.dumps(variant, sort_keys=True)
        if key not in out:
            out[key] = variant | {"recorded": changed}
        else:  # two recorded variants that the device launches as one
            out[key]["recorded"] = out[key]["recorded"] or changed
    return list(out.values())


def compile_all(entries: list[dict], arch: int) -> list[dict]:
    """Compile each variant for ``cuda:arch``; returns one result per variant (kernel,
    constexprs, triton version, arch, ``ok``, cubin bytes or the error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(HERE.parent))  # this checkout's embcache, as the record phase used
    target = GPUTarget("cuda", arch, 32)
    results = []
    for e in entries:
        fn = getattr(importlib.import_module(e["module"]), e["kernel"])
        names = list(inspect.signature(fn.fn).parameters)
        # Keyed by the parameter's index path: the form both 3.6's and 3.8's ASTSource take.
        constexprs = {(names.index(k),): v for k, v in e["constexprs"].items()}
        variant = " ".join(f"{k}={v}" for k, v in e["constexprs"].items())
        recorded = e.get("recorded") or {}
        note = " (GPU's; recorded " + ", ".join(f"{k}={v}" for k, v in recorded.items()) + ")"
        note = note if recorded else ""
        result = {
            "kernel": e["kernel"],
            "constexprs": e["constexprs"],
            "recorded": recorded,
            "triton": triton.__version__,
            "arch": f"sm_{arch}",
        }
        t0 = time.perf_counter()
        try:
            compiled = triton.compile(
                ASTSource(fn, e["signature"], constexprs), target=target, options=e["options"]
            )
            size = len(compiled.asm["cubin"])
            result |= {"ok": True, "cubin_bytes": size}
            print(f"ok    triton {triton.__version__} sm_{arch} {e['kernel']:<24} "
                  f"{variant + note:<56} {time.perf_counter() - t0:5.1f} s cubin {size} B",
                  flush=True)  # fmt: skip
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            result |= {"ok": False, "error": f"{type(exc).__name__}: {first}"}
            print(f"FAIL  triton {triton.__version__} sm_{arch} {e['kernel']:<24} {variant}"
                  f"{note}: {result['error']}", flush=True)  # fmt: skip
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10")
    parser.add_argument("--record", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--launches", type=Path, default=None, help="compile the launches recorded in this file"
    )
    parser.add_argument("--json", type=Path, default=None, help="write each result here")
    args = parser.parse_args(argv)
    if args.record is not None:
        record(args.record)
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the compile phase needs Triton's compiler")
    if args.launches is not None:
        recorded = json.loads(args.launches.read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            launches = Path(tmp) / "launches.json"
            subprocess.run(
                [sys.executable, __file__, "--record", str(launches)],
                check=True,
                env={**os.environ, "TRITON_INTERPRET": "1"},
            )
            recorded = json.loads(launches.read_text())
    entries = device_variants(recorded)
    import triton

    moved = sum(bool(e["recorded"]) for e in entries)
    print(f"# triton {triton.__version__} ({Path(triton.__file__).parent}), python "
          f"{sys.version.split()[0]}: {len(entries)} kernel variants for sm_{args.arch} "
          f"({len(recorded)} recorded; {moved} at the GPU's "
          f"{', '.join(f'{k}={v}' for k, v in DEVICE_CONSTEXPRS.items())})")  # fmt: skip
    t0 = time.perf_counter()
    results = compile_all(entries, args.arch)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    failed = sum(not r["ok"] for r in results)
    verdict = "all compiled" if not failed else f"{failed} FAILED"
    print(f"summary: triton {triton.__version__} compiled for sm_{args.arch} {len(entries)} "
          f"variants, {verdict}, {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
