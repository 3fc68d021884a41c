#!/usr/bin/env bash
# GPU check: every kernel against its twin, the CUDA tests and the benchmarks' CUDA paths, in
# at most 7 minutes on one GPU, with one summary table at the end.
#
#   PY=python3 bash benchmarks/gpu_check.sh   # on the GPU machine (PY defaults to .venv's
#                                             # python when there is one, else python3)
#   make gpu-rehearsal                        # here: the same steps in a Python like the GPU
#                                             # image's (tests/gpu_image/build.sh), --rehearsal
#   bash benchmarks/gpu_check.sh --rehearsal [--subset]   # the same, in $PY
#   bash benchmarks/gpu_check.sh --dry-run    # --rehearsal --subset in this Python, with
#                                             # torchrec/fbgemm_gpu/tensordict/iopath/redis/numba
#                                             # blocked (tests/gpu_image; GPU_CHECK_DRY_RUN=1)
#
# Steps, each under `timeout` (on the GPU the limits add up to the 420 s budget):
#   preflight          benchmarks/gpu_preflight.py: each kernel once against its torch twin at
#                      B=2048, 26 features (stops at the first mismatch, naming the kernel)
#   gpu_tests          pytest tests/test_gpu.py (training on CUDA vs the CPU path at every
#                      step, prefetch pipeline, host syncs, DistEmbedding)
#   kernel_tests       EMBCACHE_BACKEND=triton pytest tests/kernels/test_*.py and
#                      tests/cache/test_hot_cache.py (the cache invariants on CUDA); both
#                      backends on CUDA; one pytest per file, side by side, so cold compiles
#                      share the cores
#   bench_kernels      bench_kernels.py --quick   (ops vs torch; pool_forward GB/s vs a
#                                                 device-to-device copy; lookups/s)
#   bench_cache_index  bench_cache_index.py --quick   (lookups and victim choice)
#   bench_pipeline     bench_pipeline.py --quick      (prefetch overlap vs synchronous)
#   bench_gpu_step     bench_gpu_step.py --quick      (a training step vs nn.EmbeddingBag
#                                                 (sparse=True) + torch.optim, 10% and 100%)
#   gpu_profile        gpu_profile.py --quick         (that step under torch's profiler: device
#                                                 busy time, kernels, host syncs and Triton
#                                                 compiles per step; the top kernels)
# Every pytest runs with the launch guard (-p tests.triton_launch_guard): a CPU tensor handed
# to a compiled kernel, or (interpreted) a launching test without the `device` fixture, fails.
# Tests are run by path, never by a tree-wide collection; a pytest step that passes no test
# fails (status NO_TESTS). GPU_CHECK_STEPS="preflight gpu_tests" runs only the named steps.
#
# The rehearsal runs exactly these commands on the CPU: TRITON_INTERPRET=1 stands in for the
# device, EMBCACHE_TEST_DEVICE=cpu, EMBCACHE_GPU_TEST_TINY=1 and the benchmarks at toy sizes
# (the interpreter runs each program in Python), every limit times GPU_CHECK_SLOWDOWN (30).
# --subset (CI): kernel_tests still collects every test of its files but runs the first
# parametrization of each test function per backend (EMBCACHE_TEST_SUBSET=first-per-function).
#
# Output: logs, CSVs, PNGs and summary.txt in one folder, each written as its step ends; with
# $OUT set, $OUT/gpu_check.tar.gz and $OUT/summary.txt are rewritten after every step, and
# again on exit, TERM or INT (a step cut short is marked KILLED), so whatever finished comes
# back. The folder is benchmarks/results/gpu/ (rehearsal: benchmarks/results/gpu-rehearsal/), in
# the checkout or, with $OUT, in the tarball (`tar -xzf gpu_check.tar.gz` in the checkout puts
# it there). On the GPU every log and CSV starts with a line naming the GPU.
#
# Exit status: 0 every step passed; 1 a step failed, timed out or was killed; 2 no usable GPU
# or Python.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
REHEARSAL=0
SUBSET=0
BLOCK_IMAGE=0
if [[ ${GPU_CHECK_DRY_RUN:-0} == 1 ]]; then REHEARSAL=1 SUBSET=1 BLOCK_IMAGE=1; fi

# pytest_counts LOG: "P F E S C" from pytest's closing line (passed, failed, errors, skipped)
# and its "ERROR collecting" lines (C: collection errors).
pytest_counts() {
    local word n line counts=()
    line="$(grep -E '^=*.*[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran' "$1" |
        tail -n 1)"
    for word in passed failed error skipped; do
        n="$(grep -oE "[0-9]+ ${word}s?( |,|$)" <<<"$line" | head -n 1 | cut -d' ' -f1)"
        counts+=("${n:-0}")
    done
    counts+=("$(grep -c 'ERROR collecting' "$1")")
    echo "${counts[*]}"
}

# parallel_pytest FILE...: one pytest per test file, all at once (each compiles its own kernel
# variants, so cold compiles use the machine's cores instead of one), their logs in turn, then
# one summary line. Fails when a file fails, errs or collects nothing, or when no file passed
# a test; a file whose every test was skipped with a stated reason (pytest -rs lists it) counts
# as skipped.
parallel_pytest() {
    local dir i rc=0 pids=() p f e s c all_skipped=()
    local -A total=([passed]=0 [failed]=0 [errors]=0 [skipped]=0 [collect]=0)
    dir="$(mktemp -d)"
    # The children die with this shell: timeout signals the whole process group.
    for ((i = 1; i <= $#; i++)); do
        "${PY:-python3}" -m pytest -q -rs -p no:cacheprovider -p tests.triton_launch_guard \
            "${!i}" >"$dir/$i.log" 2>&1 &
        pids+=($!)
    done
    for ((i = 1; i <= $#; i++)); do
        wait "${pids[$((i - 1))]}" || rc=1
        echo "---- ${!i}"
        cat "$dir/$i.log"
        read -r p f e s c <<<"$(pytest_counts "$dir/$i.log")"
        total[passed]=$((total[passed] + p)) total[failed]=$((total[failed] + f))
        total[errors]=$((total[errors] + e)) total[skipped]=$((total[skipped] + s))
        total[collect]=$((total[collect] + c))
        if ((p == 0 && f + e == 0 && s > 0)) && grep -q '^SKIPPED ' "$dir/$i.log"; then
            all_skipped+=("$(basename "${!i}")")
        elif ((p == 0)); then
            rc=1
        fi
    done
    rm -rf "$dir"
    ((total[passed] > 0)) || rc=1
    local also=""
    ((${#all_skipped[@]} == 0)) || also="; every test skipped in ${all_skipped[*]}"
    echo "summary: ${total[passed]} passed, ${total[failed]} failed, ${total[errors]} errors" \
        "(${total[collect]} collecting), ${total[skipped]} skipped; $# files side by side$also"
    return $rc
}
if [[ ${1:-} == --parallel-pytest ]]; then
    shift
    parallel_pytest "$@"
    exit $?
fi

for arg in "$@"; do
    case $arg in
        --rehearsal) REHEARSAL=1 ;;
        --subset) SUBSET=1 ;;
        --dry-run) REHEARSAL=1 SUBSET=1 BLOCK_IMAGE=1 ;;
        -h | --help)
            sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "gpu_check: unknown argument '$arg' (--rehearsal, --subset, --dry-run, --help)" >&2
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
BUDGET_S=420 # all steps together on the GPU: 7 minutes
STEPS="${GPU_CHECK_STEPS:-preflight gpu_tests kernel_tests bench_kernels bench_cache_index bench_pipeline bench_gpu_step gpu_profile}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [[ $REHEARSAL == 1 ]]; then
    MODE="rehearsal (Triton interpreter for the device)"
    DEV=cpu
    SLOWDOWN="${GPU_CHECK_SLOWDOWN:-30}"
    export TRITON_INTERPRET=1
    export EMBCACHE_TEST_DEVICE="${EMBCACHE_TEST_DEVICE:-cpu}"
    export EMBCACHE_GPU_TEST_TINY=1
    if [[ $BLOCK_IMAGE == 1 && ${GPU_CHECK_SIMULATE_IMAGE:-1} == 1 ]]; then
        export PYTHONPATH="$ROOT/tests/gpu_image:$PYTHONPATH"
        MODE="$MODE, torchrec/fbgemm_gpu/tensordict/iopath/redis/numba blocked"
    fi
    GPU_NAME="none (CPU, Triton interpreter)"
else
    MODE="gpu"
    DEV=cuda
    SLOWDOWN=1
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu_check: no GPU present: nvidia-smi is missing or lists no device." >&2
        echo "gpu_check: nothing was run; use a GPU machine, or --rehearsal to rehearse." >&2
        exit 2
    fi
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "gpu_check: a GPU is present but torch under '$PY' cannot use CUDA (a CPU build?)" >&2
        exit 2
    fi
    GPU_NAME="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
fi
SUBSET_ENV=()
if [[ $SUBSET == 1 ]]; then
    SUBSET_ENV=(EMBCACHE_TEST_SUBSET=first-per-function)
    MODE="$MODE, kernel tests: all collected, first per test function run"
fi

RESULTS="benchmarks/results/gpu"
[[ $REHEARSAL == 1 ]] && RESULTS="benchmarks/results/gpu-rehearsal"
if [[ -n ${OUT:-} ]]; then # the tarball unpacks into the checkout: tar -xzf gpu_check.tar.gz
    mkdir -p "$OUT"
    STAGE="$(mktemp -d)"
    RESULTS="$STAGE/$RESULTS"
fi
rm -rf "$RESULTS"
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
STEP_PID=""
STEP_NAME=""
STEP_T0=0

# write_summary [VERDICT]: the table so far into $RESULTS/summary.txt; status 1 unless all passed.
write_summary() {
    local i failed=0 status verdict
    ((${#NAMES[@]} > 0)) || failed=1
    for status in "${STATUSES[@]}"; do
        [[ $status == pass ]] || failed=1
    done
    verdict="${1:-$([[ $failed == 0 ]] && echo "all passed" || echo "FAILED")}"
    {
        echo "$HEADER"
        printf '%-18s %-15s %5s  %s\n' step status secs result
        for i in "${!NAMES[@]}"; do
            printf '%-18s %-15s %5s  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${TIMES[$i]}" \
                "${RESULTS_TEXT[$i]}"
        done
        echo "total $((SECONDS - START)) s: $verdict"
    } >"$RESULTS/summary.txt"
    return $failed
}

# pack: $OUT/gpu_check.tar.gz and $OUT/summary.txt from what exists now (each replaced whole).
pack() {
    [[ -n ${OUT:-} ]] || return 0
    tar -czf "$OUT/.gpu_check.tar.gz.tmp" -C "$STAGE" benchmarks &&
        mv -f "$OUT/.gpu_check.tar.gz.tmp" "$OUT/gpu_check.tar.gz"
    [[ -f $RESULTS/summary.txt ]] && cp "$RESULTS/summary.txt" "$OUT/.summary.txt.tmp" &&
        mv -f "$OUT/.summary.txt.tmp" "$OUT/summary.txt"
}

# record NAME STATUS SECS RESULT
record() {
    NAMES+=("$1")
    STATUSES+=("$2")
    TIMES+=("$3")
    RESULTS_TEXT+=("$4")
}

# on_signal SIG: stop the running step, mark it KILLED, pack what exists, exit.
on_signal() {
    trap - TERM INT
    if [[ -n $STEP_PID ]]; then
        kill -TERM "$STEP_PID" 2>/dev/null # timeout passes it to the step's process group
        wait "$STEP_PID" 2>/dev/null
        echo "# killed by SIG$1 after $((SECONDS - STEP_T0)) s" >>"$RESULTS/$STEP_NAME.log"
        record "$STEP_NAME" KILLED "$((SECONDS - STEP_T0))" "SIG$1 during the step; see $STEP_NAME.log"
        STEP_PID=""
    fi
    write_summary "FAILED (SIG$1: stopped)"
    cat "$RESULTS/summary.txt"
    pack
    [[ -n ${OUT:-} ]] && rm -rf "$STAGE"
    exit 1
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap '[[ -n ${OUT:-} && -d ${STAGE:-/nonexistent} ]] && pack && rm -rf "$STAGE"' EXIT

# run_step NAME KIND LIMIT_S CMD...: run CMD under timeout (LIMIT_S x SLOWDOWN), log to
# $RESULTS/NAME.log, record a row, pack. KIND pytest: passes only when pytest exits 0 having
# passed at least one test.
run_step() {
    local name=$1 kind=$2 limit=$(($3 * SLOWDOWN))
    shift 3
    [[ " $STEPS " == *" $name "* ]] || return 0
    local left=$((BUDGET_S * SLOWDOWN - (SECONDS - START)))
    if ((left < limit)); then limit=$left; fi
    local log="$RESULTS/$name.log"
    { echo "$HEADER"; echo "# step: $name (timeout ${limit}s): $*"; } >"$log"
    echo "== $name (timeout ${limit}s): $*"
    local t0=$SECONDS rc status result p f e s c csv
    if ((limit <= 0)); then
        rc=124
        echo "# not run: the budget is spent" >>"$log"
    else
        # In the background, so that a TERM or INT to this script is handled at once.
        STEP_NAME=$name STEP_T0=$t0
        timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 &
        STEP_PID=$!
        wait "$STEP_PID"
        rc=$?
        STEP_PID=""
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
    if [[ -z $result && $kind == pytest ]]; then
        read -r p f e s c <<<"$(pytest_counts "$log")"
        result="$p passed, $f failed, $e errors ($c collecting), $s skipped"
        result="$result$(grep -oE '[0-9]+ deselected' "$log" | tail -n 1 | sed 's/^/, /')"
    fi
    if [[ -z $result ]]; then # a crash: its last words (the exception)
        result="$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-120)"
    fi
    tail -n 3 "$log" | sed 's/^/   | /'
    if [[ $REHEARSAL == 0 ]]; then # name the GPU in every CSV this step wrote
        for csv in "$RESULTS"/*.csv; do
            [[ -f $csv ]] && ! grep -q '^# GPU: ' "$csv" && sed -i "1i $HEADER" "$csv"
        done
    fi
    record "$name" "$status" "$((SECONDS - t0))" "${result:-see $name.log}"
    write_summary || true
    pack
}

# The GPU's sizes, or the interpreter's toy sizes: the same commands either way.
if [[ $REHEARSAL == 1 ]]; then
    PREFLIGHT_SIZE=(--tiny)
    KERNELS_SIZE=(--batch 16 --features 3 --rows 1000 --dims 8 --reps 1)
    CACHE_INDEX_SIZE=(--tiny)
    PIPELINE_SIZE=(--tables 2 --rows 1000 --dim 8 --batch 16 --steps 3 --warmup 1 --repeats 1
        --latencies-ms 0)
    GPU_STEP_SIZE=(--tiny)
    PROFILE_SIZE=(--tiny)
else
    PREFLIGHT_SIZE=()
    KERNELS_SIZE=(--quick)
    CACHE_INDEX_SIZE=(--quick)
    PIPELINE_SIZE=(--quick)
    GPU_STEP_SIZE=(--quick)
    PROFILE_SIZE=(--quick)
fi
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider -p tests.triton_launch_guard)
# matplotlib builds its font cache on first use (tens of seconds on a fresh machine): once here,
# outside every step's limit, so that no benchmark's plot runs into its own.
timeout 120 "$PY" -c 'import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot' \
    >/dev/null 2>&1 || echo "gpu_check: matplotlib did not import; plots will fail" >&2
run_step preflight script 30 "$PY" benchmarks/gpu_preflight.py --device "$DEV" \
    "${PREFLIGHT_SIZE[@]}"
run_step gpu_tests pytest 80 "${PYTEST[@]}" tests/test_gpu.py
# Cold compiles of every kernel variant the tests use: the longest step, so one pytest per
# file, side by side (the cache invariants here too: their many small batches compile dozens
# of cache-index variants).
run_step kernel_tests pytest 100 env EMBCACHE_BACKEND=triton "${SUBSET_ENV[@]}" PY="$PY" \
    bash "${BASH_SOURCE[0]}" --parallel-pytest tests/kernels/test_*.py \
    tests/cache/test_hot_cache.py
run_step bench_kernels script 60 "$PY" benchmarks/bench_kernels.py --device "$DEV" \
    "${KERNELS_SIZE[@]}" --out "$RESULTS/kernels.csv"
run_step bench_cache_index script 20 "$PY" benchmarks/bench_cache_index.py --device "$DEV" \
    "${CACHE_INDEX_SIZE[@]}" --out "$RESULTS/cache_index.csv"
run_step bench_pipeline script 30 "$PY" benchmarks/bench_pipeline.py --device "$DEV" \
    "${PIPELINE_SIZE[@]}" --out "$RESULTS/pipeline.csv"
run_step bench_gpu_step script 60 "$PY" benchmarks/bench_gpu_step.py --device "$DEV" \
    "${GPU_STEP_SIZE[@]}" --out "$RESULTS/gpu_step.csv"
run_step gpu_profile script 40 "$PY" benchmarks/gpu_profile.py --device "$DEV" \
    "${PROFILE_SIZE[@]}" --out "$RESULTS/gpu_profile.csv"

write_summary
failed=$?
cat "$RESULTS/summary.txt"
pack
if [[ -n ${OUT:-} ]]; then
    echo "packed: $OUT/gpu_check.tar.gz ($(find "$RESULTS" -type f | wc -l) files) and $OUT/summary.txt"
    rm -rf "$STAGE"
else
    echo "logs and results in $RESULTS/"
fi
exit "$failed"
