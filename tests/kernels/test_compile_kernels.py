"""`benchmarks/compile_kernels.py`: the GPU's kernel variants compiled ahead of time, no GPU.

The launchers give the interpreter wider programs than a GPU (``BLOCK_U=64`` chunks of ids per
program against one on CUDA), so the variants recorded on a CPU are not all the GPU's: the
script must compile the GPU's (``BLOCK_U=1``), and say which Triton compiled each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embcache.kernels.optim import aggregate_grads
from embcache.kernels.pooling import PoolingMode, pool_backward

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "compile_kernels.py"


@pytest.fixture
def compile_kernels(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/compile_kernels.py imported in this process."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import compile_kernels

    return compile_kernels


def test_device_variants_take_the_gpus_block_u(compile_kernels) -> None:
    recorded = [
        {"module": "m", "kernel": "_seg", "signature": {"x": "*fp32", "BLOCK_U": "constexpr"},
         "constexprs": {"BLOCK_U": 64, "BLOCK_D": 16}, "options": {}},
        {"module": "m", "kernel": "_fwd", "signature": {"x": "*fp32"},
         "constexprs": {"BLOCK_N": 64}, "options": {}},
        {"module": "m", "kernel": "_seg", "signature": {"x": "*fp32", "BLOCK_U": "constexpr"},
         "constexprs": {"BLOCK_U": 32, "BLOCK_D": 16}, "options": {}},  # the same on a GPU
    ]  # fmt: skip
    variants = compile_kernels.device_variants(recorded)
    assert [(v["kernel"], v["constexprs"], v["recorded"]) for v in variants] == [
        ("_seg", {"BLOCK_U": 1, "BLOCK_D": 16}, {"BLOCK_U": 64}),
        ("_fwd", {"BLOCK_N": 64}, {}),
    ]


def test_the_launchers_give_a_gpu_the_block_u_compiled(compile_kernels) -> None:
    """`DEVICE_CONSTEXPRS` states what the launchers choose on CUDA (which no CPU run can
    observe): each ``block_u = <cuda> if ... else <cpu>`` in the kernels must agree with it."""
    found = {}
    for name in ("ops/update/triton.py", "ops/pooling/triton.py", "ops/gather/triton.py"):
        source = (ROOT / "embcache" / name).read_text()
        found[name] = re.findall(r"block_u = (\d+) if .*cuda.* else (\d+)", source)
    assert all(found.values()), f"a launcher no longer picks BLOCK_U by device: {found}"
    gpu = {int(cuda) for choices in found.values() for cuda, _ in choices}
    assert gpu == {compile_kernels.DEVICE_CONSTEXPRS["BLOCK_U"]}


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="records launches through the interpreter"
)
@pytest.mark.launch_guard_exempt  # runs only under the interpreter, never on the device
def test_block_u_variants_compile_for_sm90(
    compile_kernels, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Record the launches of the two segment walks here (BLOCK_U=64, the interpreter's), then
    compile them in a process with Triton's compiler: the variants compiled are BLOCK_U=1."""
    import triton

    monkeypatch.setenv("EMBCACHE_BACKEND", "triton")
    with compile_kernels.recording() as launches:
        aggregate_grads(torch.tensor([3, 1, 3, 7]), torch.ones(4, 4))
        offsets, inverse = torch.tensor([0, 2, 3]), torch.tensor([0, 1, 0])
        pool_backward(torch.ones(2, 4), 4, inverse, 2, offsets, None, PoolingMode.SUM, 2,
                      torch.tensor([0]), None)  # fmt: skip
    kernels = {e["kernel"]: e["constexprs"]["BLOCK_U"] for e in launches}
    assert kernels == {
        "_segment_sum_kernel": 64,
        "_pool_backward_kernel": 64,
        "chunk_sum_kernel": 64,
    }
    recorded, results = tmp_path / "launches.json", tmp_path / "results.json"
    recorded.write_text(json.dumps(launches))

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--launches", str(recorded), "--json", str(results)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    compiled = json.loads(results.read_text())
    assert {r["kernel"]: r["constexprs"]["BLOCK_U"] for r in compiled} == {
        "_segment_sum_kernel": 1,
        "_pool_backward_kernel": 1,
        "chunk_sum_kernel": 1,
    }
    for r in compiled:
        assert r["ok"] and r["cubin_bytes"] > 0, r
        assert r["recorded"] == {"BLOCK_U": 64}
        assert (r["triton"], r["arch"]) == (triton.__version__, "sm_90")
    # The output says which Triton compiled what.
    lines = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == 3
    assert all(f"triton {triton.__version__} sm_90" in line and "BLOCK_U=1" in line
               for line in lines)  # fmt: skip
    assert f"summary: triton {triton.__version__} compiled for sm_90 3 variants" in run.stdout
