#!/usr/bin/env bash
# Build, once, a Python like the GPU image's for `make gpu-rehearsal`; prints its python's path.
#
#   bash tests/gpu_image/build.sh      # -> ${XDG_CACHE_HOME:-~/.cache}/embcache/gpu-image-py3.12/
#
# The image (docs/design.md, "Installing"): Python 3.12, torch 2.11.0+cu130, triton 3.6.0,
# numpy 2.x, safetensors, numba, hypothesis, matplotlib, tqdm, rich, pytest, pytest-timeout,
# pytest-xdist, torchmetrics 1.9.0; no torchrec, fbgemm_gpu, tensordict, iopath or redis-py.
# Differences, on purpose:
#   - torch is the image's own CUDA build (PyPI's torch==2.11.0 for Linux x86_64 is
#     2.11.0+cu130; there is no CPU build of it, nor of any torch that pins triton 3.6). It runs
#     on a CPU given its nvidia-* libraries: about 5 GB installed, 1-3 minutes to download.
#   - no cupy-cuda13x: it fails on first use without a GPU, and embcache does not use it.
#   - no numba-cuda: nothing here imports it (and it needs a GPU too).
# The venv is built in a temporary folder and renamed into place with a stamp naming the
# versions, so a killed build is never taken for a finished one; a stamp that names other pins
# than these rebuilds it. The tree itself is not installed: gpu_check.sh runs it by PYTHONPATH.
set -euo pipefail

PINS=(
    "torch==2.11.0" "triton==3.6.0" "numpy>=2,<3" "safetensors" "numba" "hypothesis"
    "matplotlib" "tqdm" "rich" "pytest" "pytest-timeout" "pytest-xdist" "torchmetrics==1.9.0"
)
DEST="${XDG_CACHE_HOME:-$HOME/.cache}/embcache/gpu-image-py3.12"
WANT="pins: ${PINS[*]}"

if [[ -f $DEST/.gpu-image-stamp ]] && [[ "$(head -n 1 "$DEST/.gpu-image-stamp")" == "$WANT" ]]; then
    echo "$DEST/bin/python"
    exit 0
fi

BASE=""
for candidate in "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do
    [[ -x $candidate ]] && BASE=$candidate
done
if [[ -z $BASE ]] && command -v python3.12 >/dev/null 2>&1; then
    BASE="$(command -v python3.12)"
fi
if [[ -z $BASE ]] || ! "$BASE" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo "gpu_image: no Python 3.12 found (looked in ~/.pyenv/versions/3.12.*/bin and on PATH);" \
        "install one, e.g. 'pyenv install 3.12'" >&2
    exit 2
fi

mkdir -p "$(dirname "$DEST")"
TMP="$(mktemp -d "$DEST.tmp.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
echo "gpu_image: building $DEST from $BASE (torch 2.11.0+cu130 is ~5 GB; a few minutes)" >&2
"$BASE" -m venv "$TMP"
# The venv moves after this, so its console scripts' shebangs would be stale: use `-m` only.
# PIP_CONSTRAINT= and no find-links: this machine's pip caps torch for the main venv.
# (This machine's pip config also names local indexes that may be absent: their warnings go.)
PIP_CONSTRAINT="" PIP_FIND_LINKS="" "$TMP/bin/python" -m pip install -q --no-input \
    --disable-pip-version-check "${PINS[@]}" 2>&1 | { grep -v '^WARNING: Location ' || true; } >&2
"$TMP/bin/python" - >&2 <<'EOF'
import importlib.util, sys, torch, triton
assert torch.__version__.startswith("2.11.0"), torch.__version__
assert triton.__version__ == "3.6.0", triton.__version__
absent = [m for m in ("torchrec", "fbgemm_gpu", "tensordict", "iopath", "redis")
          if importlib.util.find_spec(m)]
assert not absent, f"must be absent, as on the GPU image: {absent}"
print(f"gpu_image: python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"triton {triton.__version__}")
EOF
{
    echo "$WANT"
    "$TMP/bin/python" -m pip freeze --all
} >"$TMP/.gpu-image-stamp.new"
rm -rf "$DEST"
mv "$TMP/.gpu-image-stamp.new" "$TMP/.gpu-image-stamp"
mv "$TMP" "$DEST"
trap - EXIT
echo "$DEST/bin/python"
