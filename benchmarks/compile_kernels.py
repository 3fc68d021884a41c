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
per variant; exit status 1 if any fails. (Block sizes that depend on the device, such as one
unique id per program on CUDA, are recorded at their CPU values: the code paths are the same.)

    python benchmarks/compile_kernels.py [--arch 90]
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
from pathlib import Path

HERE = Path(__file__).resolve().parent


def record(path: Path) -> None:
    """Run the tiny preflight under the interpreter, writing each distinct launch to ``path``."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter
    from triton.runtime.jit import mangle_type

    seen: dict[str, dict] = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args, strict=False)) | {
            k: kwargs[k] for k in params if k in kwargs
        }
        constexprs, signature = {}, {}
        for name, p in params.items():
            value = bound[name]
            if "constexpr" in str(p.annotation):
                constexprs[name] = value
                signature[name] = "constexpr"
            else:  # "*fp32" for a tensor, "i32"/"i64"/"fp32" for a scalar
                signature[name] = mangle_type(value)
        options = {k: v for k, v in kwargs.items() if k not in params}
        entry = {
            "module": self.fn.__module__,
            "kernel": self.fn.__name__,
            "signature": signature,
            "constexprs": constexprs,
            "options": options,
        }
        seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    sys.path.insert(0, str(HERE))
    import gpu_preflight  # its _common puts this checkout's embcache first

    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:  # two dims: one column block, and several of the widest
            status = max(
                gpu_preflight.main(["--device", "cpu", "--tiny", "--dim", str(dim)])
                for dim in (8, 300)
            )
        finally:
            sys.stdout = stdout
    if status != 0:
        raise SystemExit(f"the preflight failed under the interpreter (status {status})")
    path.write_text(json.dumps(list(seen.values()), indent=1))


def compile_all(entries: list[dict], arch: int) -> int:
    """Compile each recorded variant for ``cuda:arch``; returns the number that failed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(HERE.parent))  # this checkout's embcache, as the record phase used
    target = GPUTarget("cuda", arch, 32)
    failed = 0
    for e in entries:
        fn = getattr(importlib.import_module(e["module"]), e["kernel"])
        names = list(inspect.signature(fn.fn).parameters)
        constexprs = {(names.index(k),): v for k, v in e["constexprs"].items()}
        variant = " ".join(f"{k}={v}" for k, v in e["constexprs"].items())
        t0 = time.perf_counter()
        try:
            compiled = triton.compile(
                ASTSource(fn, e["signature"], constexprs), target=target, options=e["options"]
            )
            size = len(compiled.asm["cubin"])
            print(f"ok    {e['kernel']:<24} {variant:<56} {time.perf_counter() - t0:5.1f} s "
                  f"cubin {size} B", flush=True)  # fmt: skip
        except Exception as exc:
            failed += 1
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"FAIL  {e['kernel']:<24} {variant}: {type(exc).__name__}: {first}", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10")
    parser.add_argument("--record", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record is not None:
        record(args.record)
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the compile phase needs Triton's compiler")
    with tempfile.TemporaryDirectory() as tmp:
        launches = Path(tmp) / "launches.json"
        subprocess.run(
            [sys.executable, __file__, "--record", str(launches)],
            check=True,
            env={**os.environ, "TRITON_INTERPRET": "1"},
        )
        entries = json.loads(launches.read_text())
    import triton

    print(f"# triton {triton.__version__}: {len(entries)} kernel variants for sm_{args.arch}")
    t0 = time.perf_counter()
    failed = compile_all(entries, args.arch)
    verdict = "all compiled" if not failed else f"{failed} FAILED"
    print(f"summary: compile sm_{args.arch} {len(entries)} variants, {verdict}, "
          f"{time.perf_counter() - t0:.0f} s (triton {triton.__version__})")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
