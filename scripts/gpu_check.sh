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
# Steps: GPU_CHECK_STEPS="tests full kernels modes" (the default), or any of
#   tests       every gpu-marked test except the full-graph file
#   full        tests/test_full_graphs_gpu.py: every CUDA-graph mode vs HF at batch
#               1/3/17/256, seeded sampling, the 1B start-up report (issue 15)
#   kernels     scripts/bench_kernels.py: vs SDPA, % of copy bandwidth, eager and
#               graph-replayed, host cost per launch, fixed (max_model_len) split
#               counts, the KV-split sweep (splits.json, issue 17)
#   modes       scripts/bench_modes.py: eager, compiled, graphs, full, linears; the
#               full/linears column is issue 15's bar (<= 1.25 at B=1, <= 1.3 at B=64)
#   load        scripts/bench_load.py: random init before/after, safetensors load vs the
#               disk's read speed of the same file (random:llama-3.2-1b shapes, bf16)
#   startup     llmfast bench --startup: cold and warm start in two fresh processes
#   sweep       llmfast bench --sizes 1..512: pure-decode rows, tok/s, % of HBM bandwidth
#   throughput  llmfast vs HF generate (HF batch size probed), output and total tok/s
#   serve       llmfast serve on random:llama-3.2-1b, load-tested at rates 4, 16, 64, inf
#   defaults    offline throughput at step budgets 2048 / 8192 / 16384 tokens, to confirm
#               the CUDA defaults (512 seqs / 8192 tokens, engine_args.DEFAULT_STEP_LIMITS)
#   async       scripts/bench_async.py: end-to-end decode step vs the model step alone,
#               sync vs async scheduling on one engine (issue 16's bar)
#   profile     llmfast profile, sync then async: host vs device ms per phase, overlap
#   families    tests/test_families_gpu.py: Llama, Mistral, Qwen2, Qwen3 vs HF in every
#               mode (eager, compiled, CUDA graphs), bf16 logits, random Qwen presets chat
#   presets     one bf16 CUDA-graph decode row (batch 1 and 64, context 512) per family's
#               random preset; GPU_CHECK_PRESETS picks some (default: all five, ~550 s)
# One device call may run 600 s at most, and the steps' limits add up to more: split
# them, e.g. GPU_CHECK_STEPS=tests; "full kernels"; modes; "load startup";
# "sweep throughput"; "async profile"; defaults; families; presets (cold caches each time
# on a fresh machine: Triton and Inductor compile from scratch). The async tests alone:
# pytest -m gpu tests/test_async_gpu.py tests/test_sampling.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmfast_gpu_check}
mkdir -p "$OUT"
# The compile cache stays out of $OUT (it is large and need not come back).
export LLMFAST_CACHE=${LLMFAST_CACHE:-/tmp/llmfast_cache}
STEPS=${GPU_CHECK_STEPS:-tests full kernels modes}
PRESETS=${GPU_CHECK_PRESETS:-qwen2.5-0.5b qwen3-0.6b mistral-7b qwen3-8b llama-3.1-8b}
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
            run_step tests 560 python3 -m pytest -m gpu -q -p no:cacheprovider -rs --durations=10 \
                --ignore=tests/test_families_gpu.py --ignore=tests/test_full_graphs_gpu.py ;;
        families)
            run_step families 560 python3 -m pytest -m gpu -q -p no:cacheprovider -rs \
                --durations=10 tests/test_families_gpu.py ;;
        presets)
            for preset in $PRESETS; do
                run_step "preset-$preset" 110 python3 -m llmfast bench --model "random:$preset" \
                    --dtype bfloat16 --max-model-len 1024 --sizes 1,64 --context 512 \
                    --modes graphs --cuda-graph-sizes 1,64 --json "$OUT/preset-$preset.json"
            done ;;
        full)
            run_step full 330 python3 -m pytest -m gpu -q -s -p no:cacheprovider -rs \
                --durations=10 tests/test_full_graphs_gpu.py ;;
        kernels)
            if [[ -f scripts/bench_kernels.py ]]; then
                run_step kernels 240 python3 scripts/bench_kernels.py --json "$OUT/kernels.json" \
                --markdown "$OUT/kernels.md" --sweep-splits "$OUT/splits.json"
            else
                STATUS[kernels]="skipped (no scripts/bench_kernels.py)"
            fi ;;
        modes)
            run_step modes 560 python3 scripts/bench_modes.py --model random:llama-3.2-1b \
                --dtype bfloat16 --batch-sizes 1,8,64,256 --json "$OUT/modes.json" ;;
        load)
            run_step load 150 python3 scripts/bench_load.py --preset llama-3.2-1b \
                --dtype bfloat16 --device cuda --repeats 2 --json "$OUT/load.json" ;;
        startup)
            run_step startup 240 python3 -m llmfast bench --model random:llama-3.2-1b \
                --startup --json "$OUT/startup.json" ;;
        sweep)
            run_step sweep 240 python3 -m llmfast bench --model random:llama-3.2-1b \
                --sizes 1..512 --context 128 --steps 32 --json "$OUT/sweep.json" ;;
        throughput)
            # llmfast keeps its engine (and KV cache) while HF runs in the same process:
            # half the GPU each, so HF's batch-size probe is not cut short by memory.
            run_step throughput 330 python3 -m llmfast bench --model random:llama-3.2-1b \
                --mode throughput --num-prompts 256 --input-len 256 --output-len 128 \
                --gpu-memory-utilization 0.5 --baseline hf --json "$OUT/throughput.json" ;;
        defaults)
            for budget in 2048 8192 16384; do
                run_step "defaults_$budget" 110 python3 -m llmfast bench \
                    --model random:llama-3.2-1b --mode throughput --num-prompts 512 \
                    --input-len 256 --output-len 128 --max-num-seqs 512 \
                    --max-num-batched-tokens "$budget" --json "$OUT/defaults_$budget.json"
            done ;;
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
        async)  # issue 16's bar: end-to-end step / model step, sync vs async, one run
            run_step async 330 python3 scripts/bench_async.py --model random:llama-3.2-1b \
                --dtype bfloat16 --sizes 1,64,256 --json "$OUT/async.json" ;;
        profile)  # the phase table: host vs device ms per phase, overlapped host time
            run_step profile 260 bash -c "python3 -m llmfast profile --model random:llama-3.2-1b \
                --sizes 1,64 --steps 16 --tracer torch --no-async-scheduling \
                --out '$OUT/profile-sync' && python3 -m llmfast profile \
                --model random:llama-3.2-1b --sizes 1,64 --steps 16 --tracer torch \
                --async-scheduling --out '$OUT/profile-async'" ;;
        *) echo "unknown step $step" ;;
    esac
done

echo
echo "================ llmfast gpu_check summary ================"
head -n 3 "$OUT/device.txt"
for step in $STEPS; do
    if [[ $step == presets ]]; then
        for preset in $PRESETS; do
            printf '%-16s %s\n' "preset-$preset" "${STATUS[preset-$preset]:-not run}"
        done
    elif [[ $step == defaults ]]; then
        for budget in 2048 8192 16384; do
            printf '%-16s %s\n' "defaults_$budget" "${STATUS[defaults_$budget]:-not run}"
        done
    else
        printf '%-16s %s\n' "$step" "${STATUS[$step]:-not run}"
    fi
done
for log in tests full families; do  # pytest steps: their verdict lines
    if [[ -f "$OUT/$log.log" ]]; then
        echo "--- $log:"
        grep -E '^(FAILED|ERROR)|passed|failed|skipped|error|full graphs' "$OUT/$log.log" | tail -n 15
    fi
done
if [[ -f "$OUT/kernels.json" ]]; then
    echo "--- kernels: see $OUT/kernels.log / kernels.json"
    tail -n 16 "$OUT/kernels.log"
fi
if [[ -f "$OUT/serve.log" ]]; then
    echo "--- serve (llmfast serve under load, ms):"
    tail -n 7 "$OUT/serve.log"
fi
if [[ -f "$OUT/async.log" ]]; then
    echo "--- async scheduling (ms per decode step; bar: async / model <= 1.10 at 1 and 64,"
    echo "    <= 1.05 at 256):"
    grep -E '^\|' "$OUT/async.log"
fi
if [[ -f "$OUT/profile.log" ]]; then
    echo "--- profile phase tables (sync, then async): $OUT/profile-*/top_ops.md"
    grep -h -A 10 '^## Engine phases' "$OUT"/profile-*/top_ops.md
fi
if [[ -f "$OUT/modes.log" ]]; then
    echo "--- modes (decode step latency, ms; x = speed-up over eager):"
    grep -A 12 '^decode step latency' "$OUT/modes.log"
fi
if [[ -f "$OUT/load.log" ]]; then
    echo "--- load (random init, safetensors vs disk read):"
    tail -n 4 "$OUT/load.log"
fi
for name in startup sweep throughput; do
    if [[ -f "$OUT/$name.log" ]]; then
        echo "--- $name:"
        grep -v -E '^(===|wrote )' "$OUT/$name.log" | tail -n 24
    fi
done
for budget in 2048 8192 16384; do
    if [[ -f "$OUT/defaults_$budget.log" ]]; then
        echo "--- defaults, budget $budget tokens:"
        grep -E '│ llmfast ' "$OUT/defaults_$budget.log" | tail -n 1
    fi
done
if compgen -G "$OUT/preset-*.json" > /dev/null; then
    echo "--- presets (bf16, CUDA graphs, context 512; step ms p50, decode tok/s, load s):"
    python3 - "$OUT"/preset-*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    run = json.load(open(path))["runs"]["graphs"]
    rows = "  ".join(f"b{r['batch_size']}: {r['step_latency']['median'] * 1e3:.2f} ms "
                     f"{r['decode_tokens_per_s']:.0f} tok/s" for r in run["sweep"])
    print(f"{run['model']:<22} {rows}  load {run['startup'].get('load', float('nan')):.1f} s")
PY
fi
