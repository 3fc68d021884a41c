#!/usr/bin/env bash
# GPU check: every kernel against its twin, the CUDA tests and the benchmarks' CUDA paths, in
# under 8 minutes on one GPU, with one summary table at the end.
#
#   PY=python3 bash benchmarks/gpu_check.sh   # on the GPU machine (PY defaults to .venv's
#                                             # python when there is one, else python3)
#   bash benchmarks/gpu_check.sh --dry-run    # here, without a GPU (or GPU_CHECK_DRY_RUN=1)
#
# Steps, each under `timeout` (the limits add up to the 470 s budget):
#   preflight          benchmarks/gpu_preflight.py: each kernel once against its torch twin at
#                      B=2048, 26 features (stops at the first mismatch, naming the kernel)
#   gpu_tests          pytest tests/test_gpu.py (training on CUDA vs the CPU path at every
#                      step, prefetch pipeline, host syncs, DistEmbedding)
#   kernel_tests       EMBCACHE_BACKEND=triton pytest tests/kernels and
#                      tests/cache/test_hot_cache.py (the cache invariants on CUDA); both
#                      backends on CUDA; one pytest per file, side by side, so cold compiles
#                      share the cores
#   bench_kernels      bench_kernels.py --quick       (ops vs torch baselines, bandwidth)
#   bench_cache_index  bench_cache_index.py --quick   (lookups and victim choice)
#   bench_pipeline     bench_pipeline.py --quick      (prefetch vs synchronous, bit-identical)
# Tests are run by path, never by a tree-wide collection; a pytest step that passes no test
# fails (status NO_TESTS). GPU_CHECK_STEPS="preflight gpu_tests" runs only the named steps (a cheap rerun).
#
# The dry run walks the same steps on the CPU: the Triton kernels through the interpreter at
# tiny sizes (tests/test_gpu.py with EMBCACHE_TEST_DEVICE=cpu EMBCACHE_GPU_TEST_TINY=1, a subset
# of the kernel and cache tests, the benchmarks' toy sizes), in a Python where torchrec,
# fbgemm_gpu, tensordict, iopath and redis cannot be imported, as on the GPU image
# (tests/gpu_image; GPU_CHECK_SIMULATE_IMAGE=0 turns that off).
#
# Output: logs, CSVs, PNGs and summary.txt in one folder; with $OUT set, packed into
# $OUT/gpu_check.tar.gz, with summary.txt beside it. Without $OUT the folder is
# benchmarks/results/gpu/ (dry run: benchmarks/results/gpu-dry-run/).
#
# Exit status: 0 every step passed; 1 a step failed or timed out; 2 no usable GPU or Python.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"

# parallel_pytest FILE...: one pytest per test file, all at once (each compiles its own kernel
# variants, so cold compiles use the machine's cores instead of one), their logs in turn, then
# one summary line. Fails unless every file exits 0 having passed at least one test.
parallel_pytest() {
    local dir i n word rc=0 pids=()
    local -A total=([passed]=0 [failed]=0 [errors]=0 [skipped]=0)
    dir="$(mktemp -d)"
    for ((i = 1; i <= $#; i++)); do
        "${PY:-python3}" -m pytest -q -rs -p no:cacheprovider "${!i}" >"$dir/$i.log" 2>&1 &
        pids+=($!)
    done
    for ((i = 1; i <= $#; i++)); do
        wait "${pids[$((i - 1))]}" || rc=1
        echo "---- ${!i}"
        cat "$dir/$i.log"
        grep -qE '(^|[^0-9])[1-9][0-9]* passed' "$dir/$i.log" || rc=1
        for word in passed failed errors skipped; do # from pytest's closing line
            n="$(tail -n 1 "$dir/$i.log" | grep -oE "[0-9]+ ${word%s}s?" | cut -d' ' -f1)"
            total[$word]=$((total[$word] + ${n:-0}))
        done
    done
    rm -rf "$dir"
    echo "summary: ${total[passed]} passed, ${total[failed]} failed, ${total[errors]} errors," \
        "${total[skipped]} skipped; $# files side by side"
    return $rc
}
if [[ ${1:-} == --parallel-pytest ]]; then
    shift
    parallel_pytest "$@"
    exit $?
fi

for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        -h | --help)
            sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "gpu_check: unknown argument '$arg' (--dry-run, --help)" >&2
            exit 2
            ;;
    esac
done
if [[ -z ${PY:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: Python '$PY' not found; set PY=/path/to/python" >&2
    exit 2
fi
BUDGET_S=470 # all steps together: 8 minutes, less a margin for start-up and packing
STEPS="${GPU_CHECK_STEPS:-preflight gpu_tests kernel_tests bench_kernels bench_cache_index bench_pipeline}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [[ $DRY_RUN == 1 ]]; then
    MODE="dry run"
    export TRITON_INTERPRET=1
    export EMBCACHE_TEST_DEVICE="${EMBCACHE_TEST_DEVICE:-cpu}"
    export EMBCACHE_GPU_TEST_TINY=1
    if [[ ${GPU_CHECK_SIMULATE_IMAGE:-1} == 1 ]]; then
        export PYTHONPATH="$ROOT/tests/gpu_image:$PYTHONPATH"
        MODE="dry run, torchrec/fbgemm_gpu/tensordict/iopath/redis blocked"
    fi
    GPU_NAME="none (CPU, Triton interpreter)"
else
    MODE="gpu"
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu_check: no GPU present: nvidia-smi is missing or lists no device." >&2
        echo "gpu_check: nothing was run; use a GPU machine, or --dry-run to rehearse." >&2
        exit 2
    fi
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "gpu_check: a GPU is present but torch under '$PY' cannot use CUDA (a CPU build?)" >&2
        exit 2
    fi
    GPU_NAME="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
fi

if [[ -n ${OUT:-} ]]; then
    STAGE="$(mktemp -d)"
    RESULTS="$STAGE/gpu_check"
elif [[ $DRY_RUN == 1 ]]; then
    RESULTS="benchmarks/results/gpu-dry-run"
else
    RESULTS="benchmarks/results/gpu"
fi
mkdir -p "$RESULTS"
VERSIONS="$("$PY" -c 'import platform, torch, triton; print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}")' 2>&1 | tail -n 1)"
REV="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
HEADER="# GPU: ${GPU_NAME} | ${VERSIONS} | ${MODE} | commit ${REV} | $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "$HEADER"

START=$SECONDS
NAMES=()
STATUSES=()
TIMES=()
RESULTS_TEXT=()

# run_step NAME KIND LIMIT_S CMD...: run CMD under timeout, log to $RESULTS/NAME.log, record a
# row. KIND pytest: passes only when pytest exits 0 having passed at least one test.
run_step() {
    local name=$1 kind=$2 limit=$3
    shift 3
    [[ " $STEPS " == *" $name "* ]] || return 0
    local left=$((BUDGET_S - (SECONDS - START)))
    if ((left < limit)); then limit=$left; fi
    local log="$RESULTS/$name.log"
    { echo "$HEADER"; echo "# step: $name (timeout ${limit}s): $*"; } >"$log"
    echo "== $name (timeout ${limit}s): $*"
    local t0=$SECONDS rc status result
    if ((limit <= 0)); then
        rc=124
        echo "# not run: the 8-minute budget is spent" >>"$log"
    else
        timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
        rc=$?
    fi
    case $rc in
        0) status=pass ;;
        124 | 137) status=TIMEOUT ;;
        5) status=NO_TESTS ;; # pytest collected nothing
        *) status="FAIL($rc)" ;;
    esac
    if [[ $kind == pytest && $rc == 0 ]] && ! grep -qE '(^|[^0-9])[1-9][0-9]* passed' "$log"; then
        status=NO_TESTS # every test skipped or deselected: nothing was checked
    fi
    # The scripts print "summary: ..." lines; pytest ends with its counts.
    result="$(grep -E '^summary: ' "$log" | sed 's/^summary: //' | paste -sd ';' -)"
    if [[ -z $result ]]; then
        result="$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran' "$log" |
            tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')"
    fi
    if [[ -z $result ]]; then # a crash: its last words (the exception)
        result="$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-120)"
    fi
    tail -n 3 "$log" | sed 's/^/   | /'
    NAMES+=("$name")
    STATUSES+=("$status")
    TIMES+=("$((SECONDS - t0))")
    RESULTS_TEXT+=("${result:-see $name.log}")
}

PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider)
if [[ $DRY_RUN == 1 ]]; then
    run_step preflight script 60 "$PY" benchmarks/gpu_preflight.py --device cpu --tiny
    run_step gpu_tests pytest 120 "${PYTEST[@]}" tests/test_gpu.py
    run_step kernel_tests pytest 120 env EMBCACHE_BACKEND=triton PY="$PY" \
        bash "${BASH_SOURCE[0]}" --parallel-pytest \
        "tests/kernels/test_optim.py::test_aggregate_grads_sums_duplicates" \
        "tests/kernels/test_cache_index.py::test_set_index_bit_identical_to_twin" \
        "tests/cache/test_hot_cache.py::test_training_through_cache_equals_dense[one_row_per_set-adam-lfu]"
    run_step bench_kernels script 60 "$PY" benchmarks/bench_kernels.py --device cpu \
        --batch 16 --features 3 --rows 1000 --dims 8 --reps 1 --out "$RESULTS/kernels.csv"
    run_step bench_cache_index script 60 "$PY" benchmarks/bench_cache_index.py --device cpu \
        --tiny --out "$RESULTS/cache_index.csv"
    run_step bench_pipeline script 60 "$PY" benchmarks/bench_pipeline.py --device cpu \
        --tables 2 --rows 1000 --dim 8 --batch 16 --steps 3 --warmup 1 --repeats 1 \
        --latencies-ms 0 --out "$RESULTS/pipeline.csv"
else
    run_step preflight script 60 "$PY" benchmarks/gpu_preflight.py --device cuda
    run_step gpu_tests pytest 100 "${PYTEST[@]}" tests/test_gpu.py
    # Cold compiles of every kernel variant the tests use: the longest step, so one pytest per
    # file, side by side (the cache invariants here too: their many small batches compile
    # dozens of cache-index variants).
    run_step kernel_tests pytest 170 env EMBCACHE_BACKEND=triton PY="$PY" \
        bash "${BASH_SOURCE[0]}" --parallel-pytest tests/kernels/test_*.py \
        tests/cache/test_hot_cache.py
    run_step bench_kernels script 50 "$PY" benchmarks/bench_kernels.py --device cuda --quick \
        --out "$RESULTS/kernels.csv"
    run_step bench_cache_index script 30 "$PY" benchmarks/bench_cache_index.py --device cuda \
        --quick --out "$RESULTS/cache_index.csv"
    run_step bench_pipeline script 60 "$PY" benchmarks/bench_pipeline.py --device cuda --quick \
        --out "$RESULTS/pipeline.csv"
fi

failed=0
((${#NAMES[@]} > 0)) || failed=1
for status in "${STATUSES[@]}"; do
    [[ $status == pass ]] || failed=1
done
{
    echo "$HEADER"
    printf '%-18s %-15s %5s  %s\n' step status secs result
    for i in "${!NAMES[@]}"; do
        printf '%-18s %-15s %5s  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${TIMES[$i]}" \
            "${RESULTS_TEXT[$i]}"
    done
    verdict=$([[ $failed == 0 ]] && echo "all passed" || echo "FAILED")
    echo "total $((SECONDS - START)) s: $verdict"
} | tee "$RESULTS/summary.txt"
if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    tar -czf "$OUT/gpu_check.tar.gz" -C "$STAGE" gpu_check && cp "$RESULTS/summary.txt" "$OUT/"
    echo "packed: $OUT/gpu_check.tar.gz ($(find "$RESULTS" -type f | wc -l) files) and $OUT/summary.txt"
    rm -rf "$STAGE"
else
    echo "logs and results in $RESULTS/"
fi
exit "$failed"
