#!/usr/bin/env bash
# Everything fxpipe checks on a CUDA machine, in one run of a few minutes: the quickstart on
# the GPUs present, the CUDA-marked tests, the GPU benchmark (python -m benchmarks.gpu), the
# runtime's costs on the GPU (python -m benchmarks.autoconfig --calibrate --device cuda),
# the compiled-stages benchmark on the GPU (python -m benchmarks.compile --device cuda, one
# run per model, in COMPILE_MODE if set) and its numerical agreement in three precisions
# (python -m benchmarks.compile_agreement), one tensor-parallel rank's share of a Llama-7B
# stage (python -m benchmarks.tensor_rank, and what sequence parallelism saves it:
# benchmarks.sequence_parallel), the automatic configuration against its grid
# where AUTOCONFIG_MODELS names models, then the whole suite with CUDA visible (on several
# workers when pytest-xdist is installed). Logs and JSON go to $OUT (default
# /tmp/fxpipe-gpu); a short summary is printed last. SKIP_CUDA_TESTS, SKIP_BENCH,
# SKIP_AUTOCONFIG, SKIP_COMPILE, SKIP_AGREEMENT, SKIP_TENSOR, SKIP_GENERATE and SKIP_SUITE leave
# a part out (pipe.generate's one-device overhead: python -m benchmarks.generate --device cuda).
#
#   bash benchmarks/gpu_check.sh            # from the repository root, torch with CUDA installed
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT="${OUT:-/tmp/fxpipe-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
start=$(date +%s)
summary=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$(($(date +%s) - t0))" \
        "$(grep -E '(passed|failed|error|skipped)' "$OUT/$name.log" | tail -1)")")
    echo "== $name (rc=$rc)"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# No network there: install without dependencies or build isolation (torch, networkx present).
# Benchmarks run as `python -m benchmarks.NAME` from BENCH_DIR: the repository root, or the
# copy (whose fxpipe holds passes/, as the install would) when the install fails.
BENCH_DIR=.
if ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1; then
    echo "editable install failed; using a copy on PYTHONPATH" | tee -a "$OUT/install.log"
    mkdir -p /tmp/fxpipe-site && cp -r fxpipe /tmp/fxpipe-site/ && cp -r passes /tmp/fxpipe-site/fxpipe/
    cp -r benchmarks /tmp/fxpipe-site/
    export PYTHONPATH=/tmp/fxpipe-site
    BENCH_DIR=/tmp/fxpipe-site
fi
"$PY" -c "import torch, fxpipe, networkx; print('torch', torch.__version__, torch.cuda.get_device_name(0))"

workers=()
"$PY" -c "import xdist" 2>/dev/null && workers=(-n "${WORKERS:-8}")

TAIL=8 step quickstart 90 "$PY" examples/quickstart.py
[ -z "${SKIP_CUDA_TESTS:-}" ] && step cuda_tests 150 "$PY" -m pytest -q -m cuda "${workers[@]}" tests
if [ -z "${SKIP_BENCH:-}" ]; then
    TAIL=40 step gpu_bench 170 sh -c 'cd "$1" && shift && exec "$@"' sh "$BENCH_DIR" \
        "$PY" -m benchmarks.gpu --out "$OUT/gpu.json" --budget-s 110
fi
if [ -z "${SKIP_AUTOCONFIG:-}" ]; then  # the runtime's costs per cell and step on the GPU
    TAIL=6 step calibrate "${CALIBRATE_S:-100}" sh -c 'cd "$1" && shift && exec "$@"' sh \
        "$BENCH_DIR" "$PY" -m benchmarks.autoconfig --calibrate --device cuda \
        --out "$OUT/autoconfig_calibration_cuda.json"
fi
if [ -z "${SKIP_COMPILE:-}" ]; then  # compiled stages: the GPU column of benchmarks.compile
    mode=()
    [ -n "${COMPILE_MODE:-}" ] && mode=(--mode "$COMPILE_MODE")
    for model in ${COMPILE_MODELS:-cnn decoder encoder}; do  # one run each: a cut run keeps the rest
        TAIL=14 step "compile_$model" "${COMPILE_S:-100}" sh -c 'cd "$1" && shift && exec "$@"' \
            sh "$BENCH_DIR" "$PY" -m benchmarks.compile --device cuda --repeats 10 \
            --models "$model" "${mode[@]}" --out "$OUT/compile_cuda_$model.json"
    done
fi
if [ -z "${SKIP_AGREEMENT:-}" ]; then  # compiled against uncompiled, in three precisions
    TAIL=10 step agreement "${AGREEMENT_S:-150}" sh -c 'cd "$1" && shift && exec "$@"' sh \
        "$BENCH_DIR" "$PY" -m benchmarks.compile_agreement --device cuda \
        --out "$OUT/compile_agreement_cuda.json"
fi
if [ -z "${SKIP_TENSOR:-}" ]; then  # one tensor-parallel rank's compute, a Llama-7B stage
    TAIL=10 step tensor_rank "${TENSOR_S:-120}" sh -c 'cd "$1" && shift && exec "$@"' sh \
        "$BENCH_DIR" "$PY" -m benchmarks.tensor_rank --device cuda --model llama-7b \
        --out "$OUT/tensor_rank_cuda.json"
    TAIL=10 step tensor_rank_compiled "${TENSOR_S:-120}" sh -c 'cd "$1" && shift && exec "$@"' \
        sh "$BENCH_DIR" "$PY" -m benchmarks.tensor_rank --device cuda --model llama-7b \
        --compile --out "$OUT/tensor_rank_cuda_compiled.json"
    # what sequence parallelism saves a rank of that stage (bf16: its casts are real copies)
    TAIL=10 step sequence_parallel "${TENSOR_S:-120}" sh -c 'cd "$1" && shift && exec "$@"' \
        sh "$BENCH_DIR" "$PY" -m benchmarks.sequence_parallel --device cuda --model llama-7b \
        --repeats 5 --out "$OUT/sequence_parallel_cuda.json"
fi
if [ -z "${SKIP_GENERATE:-}" ]; then  # one lane of pipe.generate over model.generate
    TAIL=6 step generate "${GENERATE_S:-240}" sh -c 'cd "$1" && shift && exec "$@"' sh \
        "$BENCH_DIR" "$PY" -m benchmarks.generate --device cuda --out "$OUT/generate_cuda.json"
fi
if [ -n "${AUTOCONFIG_MODELS:-}" ]; then  # the automatic configuration against its grid
    TAIL=20 step autoconfig "${AUTOCONFIG_S:-200}" sh -c 'cd "$1" && shift && exec "$@"' sh \
        "$BENCH_DIR" "$PY" -m benchmarks.autoconfig --device cuda --repeats 7 \
        --models "$AUTOCONFIG_MODELS" --out "$OUT/autoconfig_cuda.json"
fi
if [ -z "${SKIP_SUITE:-}" ]; then
    # -v: one line per finished test, so a run cut short still says what failed
    TAIL=15 step suite "${SUITE_S:-200}" "$PY" -m pytest -v -rf "${workers[@]}" \
        --ignore=tests/test_cuda.py tests
    grep -E "FAILED|ERROR" "$OUT/suite.log" | grep -v "^DEBUG" | head -20
fi

echo
echo "fxpipe GPU check, $(($(date +%s) - start)) s, $(cat "$OUT/gpu.txt")"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
