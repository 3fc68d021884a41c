#!/usr/bin/env bash
# GPU check: the CUDA tests and the benchmarks' CUDA paths, in under 8 minutes.
#
#   bash benchmarks/gpu_check.sh                     # after `make venv`
#   PY=/path/to/python bash benchmarks/gpu_check.sh  # any Python with torch, triton, embcache
#
# Steps, each under `timeout` (the limits add up to less than the 8-minute budget):
#   1. pytest -m gpu                               (tests marked gpu)
#   2. EMBCACHE_BACKEND=triton pytest tests/kernels (every kernel test, Triton on CUDA)
#   3. bench_kernels.py --device cuda              (ops vs torch baselines, bandwidth, keys/s)
#   4. bench_cache_index.py --device cuda          (cache lookups and victim choice)
#   5. bench_pipeline.py --device cuda --quick     (prefetch vs synchronous, bit-identical):
#      the end-to-end training step on the GPU (bench_e2e.py compares the CPU paths of
#      torchrec and FBGEMM, whose CUDA builds this project does not install)
# Logs, CSVs, PNGs and summary.txt go to benchmarks/results/gpu/, each file headed by a line
# naming the GPU. The summary table is printed last.
#
# Exit status: 0 every step passed; 1 a step failed or timed out; 2 no usable GPU (nothing run).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PY:-.venv/bin/python}"
OUT_DIR="benchmarks/results/gpu"
BUDGET_S=470 # hard ceiling for all steps together (8 minutes, less a margin)

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no GPU present: nvidia-smi is missing or lists no device." >&2
    echo "gpu_check: nothing was run; use a machine with an NVIDIA GPU." >&2
    exit 2
fi
nvidia-smi -L
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: Python '$PY' not found; run 'make venv' or set PY=/path/to/python" >&2
    exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: a GPU is present but torch under '$PY' cannot use CUDA (a CPU build?)" >&2
    exit 2
fi

mkdir -p "$OUT_DIR"
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
VERSIONS="$("$PY" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")')"
REV="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
HEADER="# GPU: ${GPU_NAME} | ${VERSIONS} | commit ${REV} | $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "$HEADER"
export PYTHONUNBUFFERED=1

START=$SECONDS
NAMES=()
STATUSES=()
TIMES=()
RESULTS=()

# run_step NAME LIMIT_S CMD...: run CMD under timeout, log to $OUT_DIR/NAME.log, record a row.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - START)))
    if ((left < limit)); then limit=$left; fi
    local log="$OUT_DIR/$name.log"
    { echo "$HEADER"; echo "# step: $name (timeout ${limit}s): $*"; } >"$log"
    echo "== $name (timeout ${limit}s): $*"
    local t0=$SECONDS rc status result
    if ((limit <= 0)); then
        rc=124
        echo "# skipped: the 8-minute budget is spent" >>"$log"
    else
        timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
        rc=$?
    fi
    case $rc in
        0) status=pass ;;
        124 | 137) status=TIMEOUT ;;
        *) status="FAIL($rc)" ;;
    esac
    # The benchmarks print "summary: ..." lines; pytest ends with its counts.
    result="$(grep '^summary: ' "$log" | sed 's/^summary: //' | paste -sd ';' -)"
    if [[ -z $result ]]; then
        result="$(grep -E '[0-9]+ (passed|failed|error|errors|skipped|deselected)' "$log" | tail -n 1)"
    fi
    if [[ -z $result ]]; then # bench_cache_index: its largest lookup row (ops/s, ratios)
        result="$(grep -E '^cache_lookup ' "$log" | tail -n 1 | tr -s ' ')"
    fi
    tail -n 3 "$log" | sed 's/^/   | /'
    NAMES+=("$name")
    STATUSES+=("$status")
    TIMES+=("$((SECONDS - t0))")
    RESULTS+=("${result:-see $log}")
}

run_step gpu_tests 100 "$PY" -m pytest -m gpu -q -p no:cacheprovider
run_step kernel_tests_triton 110 env EMBCACHE_BACKEND=triton \
    "$PY" -m pytest tests/kernels -q -p no:cacheprovider
run_step bench_kernels 110 "$PY" benchmarks/bench_kernels.py --device cuda \
    --out "$OUT_DIR/kernels.csv"
run_step bench_cache_index 60 "$PY" benchmarks/bench_cache_index.py --device cuda \
    --out "$OUT_DIR/cache_index.csv"
run_step bench_pipeline 70 "$PY" benchmarks/bench_pipeline.py --device cuda --quick \
    --out "$OUT_DIR/pipeline.csv"

failed=0
for status in "${STATUSES[@]}"; do
    [[ $status == pass ]] || failed=1
done
{
    echo "$HEADER"
    printf '%-20s %-9s %5s  %s\n' step status secs result
    for i in "${!NAMES[@]}"; do
        printf '%-20s %-9s %5s  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${TIMES[$i]}" "${RESULTS[$i]}"
    done
    echo "total $((SECONDS - START)) s; logs and results in $OUT_DIR/"
} | tee "$OUT_DIR/summary.txt"
exit "$failed"
