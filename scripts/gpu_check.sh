#!/usr/bin/env bash
# The one script a GPU session runs (see /work/shared/DEVICE.md): GPU tests, kernel
# benchmark, execution-mode benchmark; everything is written under $OUT and a short
# summary table is printed last. The caller has already installed the .whl preamble
# and exported PYTHONPATH, e.g. (device tool, carry [".whl"]):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
#     || exit; bash scripts/gpu_check.sh
#
# Each step has its own time limit so that one hang still leaves the summary.
# Steps: GPU_CHECK_STEPS="tests kernels modes" (default: all three); "serve" (not in the
# default) starts `llmfast serve` on random:llama-3.2-1b and load-tests it. One device call may
# run 600 s at most, and the steps' limits add up to more: run two calls,
# GPU_CHECK_STEPS=tests, then GPU_CHECK_STEPS="kernels modes" (cold caches both times:
# Triton and Inductor compile from scratch on a fresh machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmfast_gpu_check}
mkdir -p "$OUT"
# The compile cache stays out of $OUT (it is large and need not come back).
export LLMFAST_CACHE=${LLMFAST_CACHE:-/tmp/llmfast_cache}
STEPS=${GPU_CHECK_STEPS:-tests kernels modes}
declare -A STATUS

run_step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*" | tee -a "$OUT/steps.log"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    STATUS[$name]="rc=$rc in $((SECONDS - t0)) s"
    echo "=== $name: ${STATUS[$name]}" | tee -a "$OUT/steps.log"
}

{
    nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/device.txt"

for step in $STEPS; do
    case $step in
        tests)
            run_step tests 560 python3 -m pytest -m gpu -q -p no:cacheprovider -rs --durations=10 ;;
        kernels)
            if [[ -f scripts/bench_kernels.py ]]; then
                run_step kernels 240 python3 scripts/bench_kernels.py --json "$OUT/kernels.json"
            else
                STATUS[kernels]="skipped (no scripts/bench_kernels.py)"
            fi ;;
        modes)
            run_step modes 330 python3 scripts/bench_modes.py --model random:llama-3.2-1b \
                --dtype bfloat16 --json "$OUT/modes.json" ;;
        serve)
            run_step serve 400 bash -c '
                python3 -m llmfast serve --model random:llama-3.2-1b --dtype bfloat16 \
                    --port 8011 > "$0/serve-server.log" 2>&1 &
                pid=$!
                for _ in $(seq 300); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
                python3 scripts/bench_serve.py --url http://127.0.0.1:8011 --num-prompts 256 \
                    --input-len 256 --output-len 128 --vocab-size 32000 \
                    --request-rate 4,16,64,inf --json "$0/serve.json"
                rc=$?; kill -TERM $pid; wait $pid; exit $rc' "$OUT" ;;
        *) echo "unknown step $step" ;;
    esac
done

echo
echo "================ llmfast gpu_check summary ================"
head -n 3 "$OUT/device.txt"
for step in $STEPS; do
    printf '%-8s %s\n' "$step" "${STATUS[$step]:-not run}"
done
if [[ -f "$OUT/tests.log" ]]; then
    echo "--- tests:"
    grep -E '^(FAILED|ERROR)|passed|failed|skipped|error' "$OUT/tests.log" | tail -n 15
fi
if [[ -f "$OUT/kernels.json" ]]; then
    echo "--- kernels: see $OUT/kernels.log / kernels.json"
    tail -n 12 "$OUT/kernels.log"
fi
if [[ -f "$OUT/serve.log" ]]; then
    echo "--- serve (llmfast serve under load, ms):"
    tail -n 7 "$OUT/serve.log"
fi
if [[ -f "$OUT/modes.log" ]]; then
    echo "--- modes (decode step latency, ms; x = speed-up over eager):"
    grep -A 12 '^decode step latency' "$OUT/modes.log"
fi
