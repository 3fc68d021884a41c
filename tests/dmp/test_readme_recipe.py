"""The README's "Scaling out with torchrec" recipe runs as written: its Python block, saved as
the file it names, under ``torchrun --nproc_per_node 2`` (gloo on CPU), both ranks reporting
their half of ``t0``'s rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recipe() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Scaling out with torchrec") :]
    section = section[: section.index("\n## ", 1)]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def test_readme_recipe_trains_on_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "dmp_cached.py"
    script.write_text(recipe())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, run.stdout
    assert "shard_offsets=[0, 0], shard_sizes=[50000, 16]" in lines[0]
    assert "shard_offsets=[50000, 0], shard_sizes=[50000, 16]" in lines[1]
