#!/usr/bin/env bash
# The one script a GPU session runs (see /work/shared/DEVICE.md): GPU tests and the
# benchmarks of the open issues. Everything goes under $OUT; after each step its
# PASS/FAIL lines against the issues' bars (scripts/gpu_verdicts.py) are printed and
# appended to $OUT/verdicts.txt, and a summary comes last, with $OUT/report.md (device
# lines, exact commands, verdicts and tables: what profiles/ asks for). The caller has installed the
# .whl preamble and exported PYTHONPATH. Once, here (.whl/ is git-ignored):
# `bash scripts/device_wheels.sh` (nvtx, gguf and the server's stack for `serve`); then
# each call (device tool, carry [".whl"]):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
#     || exit; GPU_CHECK_QUICK=1 bash scripts/gpu_check.sh
#
# Steps: arguments, else GPU_CHECK_STEPS, else "full modes diag kernels install_splits
# kernels_table startup throughput sweep startup_profile" (call 1 of the plan below). Each has a
# time limit, and an estimate (warm machine, cold compile caches; GPU_CHECK_QUICK's in
# brackets) used to keep one call within GPU_CHECK_BUDGET_S (default 560; one device call
# may run 600 s): a step that would not fit in what is left is skipped with a SKIPPED
# line, and the step `skipped` of the machine's next call runs it (GPU_CHECK_DEFER="a b":
# steps a and b are skipped that way whatever the time left). A step that fails or
# times out does not stop the later ones.
#
#   step        est/limit s  what (issue: bar); est = measured on an H200 on 2026-11-26
#                            (warm machine, cold compile caches) with a margin
#   full          130/330    tests/test_full_graphs_gpu.py, the GPU tests of the layer
#                            kernels, of RoPE fused into the KV write (test_rope_cache.py)
#                            and of mixed attention launches (the decode region): every
#                            CUDA-graph mode vs HF at
#                            batch 1/3/17/256, seeded sampling, 1B default-size capture
#                            (#15: identical tokens; capture <= 10 s)   [63 s before the
#                            last two files]; a failure in the layer kernels or the decode
#                            region switches them off for the later steps (NOTE line)
#   async_tests   220/300    tests/test_async_gpu.py + tests/test_sampling.py gpu tests
#                            (#16: steady-state steps under sync-debug "error", with
#                            every sampler stage and with prompt scoring; async == sync on
#                            CUDA, phase timer device time)   [> 200 s: cut off at 200]
#   modes     90[45]/560    scripts/bench_modes.py eager, compiled, graphs, full, linears
#                            (#15: full/linears <= 1.25 at B=1, <= 1.3 at B=64; eager/full
#                            >= 6 at B=1)   [quick: 30 s]
#   async     60[45]/330    scripts/bench_async.py (#16: async/model <= 1.10 at 1 and 64,
#                            <= 1.05 at 256)   [quick: 29 s]
#   profile        80/260    llmfast profile, sync then async (#16: device ms per phase
#                            under CUDA graphs, host/device overlap)   [53 s]
#   load           45/150    scripts/bench_load.py (#18: random 1B init <= 2 s;
#                            safetensors load >= 50 % of the disk's read speed)   [30 s]
#   startup       120/300    scripts/ship_prefill_tiles.py (the model's prefill tiles tuned
#                            and installed as shipped: prefill_tiles_model.json), then
#                            llmfast bench --startup with tuning on auto (#18: TTFT warm
#                            <= 10 s, cold <= 25 s; #15: capture <= 10 s; graphs, memory;
#                            where torch has no bytecode, a first process compiles the
#                            imports' before the cold start: ~7 s more)   [83 s]
#   startup_thin  120/300    the startup step with --piecewise-graph-sizes 1..512 (10
#                            piecewise sizes instead of 51; full graphs at every size):
#                            what fewer piecewise graphs save of #18's TTFT  [unmeasured]
#   startup_serial 100/300   the startup step's start-up with LLMFAST_KERNEL_PRECOMPILE=0
#                            TORCH_WARM_POOL=0 (Triton variants compiled at their
#                            launches, Inductor's workers started by its first kernel,
#                            as before session 19): what the two save of the cold start
#                            (an info line against startup.json)   [unmeasured]
#   startup_profile 90/300   scripts/profile_startup.py: a cold start, then a cProfile of
#                            a warm one and `-X importtime` (#18: where the warm start's
#                            unstaged seconds go; startup_profile.md)   [unmeasured]
#   sweep          40/240    llmfast bench --sizes 1..512 (#18: every row pure decode,
#                            tok/s, % of HBM)   [21 s]
#   throughput    110/330    llmfast vs HF generate, HF batch probed (#18: >= 10x output
#                            tok/s)   [75 s]
#   tests         250/560    every other gpu-marked test
#   kernels 150[60]/540     scripts/bench_kernels.py (#17: prefill >= 0.8x SDPA flash at
#                            2k-8k causal; decode >= 1.0x SDPA at B=1..8; max abs diff
#                            <= 4e-3): prefill tiles tuned first (2 classes x 10
#                            candidates; prefill_tiles.json is the table to ship), decode
#                            (eager, graph, host us per launch cached vs Triton JIT, split
#                            sweep: splits.json), prefill 2k/4k/8k, mixed vs its parts
#                            [quick: 36 s]
#   kernels64      30/240    the same decode rows and split sweep at head dim 64 (the 1B
#                            default's shape), added to splits.json   [11 s]
#   install_splits  5/60     this call's splits.json (kernels, kernels64 --sweep-splits)
#                            merged into this GPU's shipped split table on the machine
#                            (splits_installed.json: the file to ship): the steps after
#                            it run with the table that will ship
#   kernels_table  25/180    after install_splits: bench_kernels' decode rows again (B=1,
#                            8, 64 x 512/2k/8k, head dim 128) with that table: #17's
#                            decode bars as they will ship   [unmeasured]
#   diag           60/240    bench_modes full + linears at B=1,64 with each kernel's device
#                            time per step (traces/full_B*_kernels.md) and Inductor's
#                            generated code (inductor_output_code.log): what #15's full
#                            graph spends beside the GEMMs
#   decode_configs 100/300   scripts/sweep_decode_configs.py: decode attention BLOCK_N x
#                            min tiles per split x one or two key-tile loops (3 stages:
#                            4 made no difference) at the full graph's launch, head dim
#                            64 (B=1,8,64 x 140..8k) and 128 (B=1,8 x 512, 8k); its last
#                            line says whether DECODE_ONE_KV_LOOP should be on
#   decode_tiles  150/330    scripts/sweep_decode_configs.py at head dim 128, B=1,8,64 x
#                            2k/8k: warps 4/8 x stages 2-5 x BLOCK_N 64/128 x KV splits
#                            1-16, graph-replayed (#17: what the B=8 8k and B=64 2k rows,
#                            78 % and 87 % of copy bandwidth on 2026-11-27, can reach)
#   decode_stages  40/200    sweep_decode_configs.py: decode pipeline stages 3 vs 5 (74 vs
#                            140 KB of shared memory at head dim 128) x split counts, head
#                            dim 64 (B=1,8,64 x 512/8k) and 128 (x 512). Session 26: the
#                            H100's head-dim-128 table takes 5 stages (a table names one
#                            count per shape: the start-up precompiles one decode variant)
#   decode_gap     60/200    scripts/bench_decode_gap.py: llmfast (paged, shuffled and in
#                            order) vs SDPA flash decode over contiguous K/V, graph and
#                            eager, after a writing and a reading L2 flush (#17: where
#                            the B=8 8k gap to SDPA's kernel comes from)
#   launch_host    30/120    scripts/bench_launch_device.py: an eager attention call's host
#                            us layer by layer (op, launch_planned, CudaLauncher.__call__,
#                            the C launch called directly: session 26), beside a torch
#                            one-element kernel and SDPA's flash decode (#17's eager rows)
#   families      300/560    tests/test_families_gpu.py (#19)
#   defaults      300/330    throughput (512 prompts, max_num_seqs 512) at the CUDA default
#                            token budget, 16384 and 2048 (#18: defaults decided by
#                            measurement: the default within 5 % of the best)
#   serve         250/400    llmfast serve under load, rates 4, 16, 64, inf (or
#                            GPU_CHECK_SERVE_RATES, e.g. 64,inf: ~60 s less than 4 and 16)
#   serve_procs   300/540    llmfast serve --api-servers 0, 1, 2 under the same load (512
#                            streams at once): does HTTP in processes of its own free the
#                            engine's step (output tok/s, TPOT)? Decides the default.
#   serve_gil     120/330    llmfast serve (--api-servers 0) under 256 streams at once, at
#                            each GIL switch interval of GPU_CHECK_GIL_MS in turn (default
#                            "5 0.5"; serve/switch_interval.py). Session 26 on the H100:
#                            13.3k tok/s at 5 ms, 11.6k at 0.5 (so serve keeps Python's 5
#                            ms unless LLMFAST_SWITCH_INTERVAL_MS says otherwise)   [68 s]
#   serve_stall    90/240    scripts/bench_serve_stall.py (the 1B, CUDA graphs, max-num-seqs
#                            256): a streaming request's gaps while a 400k-character prompt
#                            is tokenised and while 2000 x n=50 engine requests go in
#                            (session 24's tokenising thread and sliced adds; no bar: CPU
#                            figures in profiles/serve-stall-cpu.md)
#   presets       550/550    one CUDA-graph decode row per family preset (GPU_CHECK_PRESETS)
#   kvfp8         210/360    --kv-cache-dtype fp8: tests/test_kv_cache_fp8_gpu.py (kernels
#                            vs float64 on the dequantized cache; the 1B with an fp8 cache
#                            vs a bf16 cache under CUDA graphs), then bench_kernels' decode
#                            rows over an fp8 cache (B=1,8,64,256 x 2k/8k: vs SDPA in bf16,
#                            % of copy bandwidth at one byte per element)
#   fp8           280/400    --quantization fp8: tests/test_fp8_gpu.py, then bench_modes
#                            eager/full/linears at B=1,64 in bf16 and fp8 (no bar: how much
#                            the half-size weights buy a decode step)
#                            (the two fp8 test files together passed in 87 s on 2026-11-26)
#
# A device session: 15 minutes of device time in all (the machine's start counts: ~30 s
# on 2026-11-26), calls of <= 600 s, and the machine goes back 30 s after a call ends.
# So: calls issued AT ONCE one after another on the same warm machine (read each one's
# results while the next runs); a later call starts a bare machine (cold caches).
# GPU_CHECK_QUICK=1 trims modes (B=1,64,256; eager, graphs, full, linears), async (two
# repeats) and kernels (the bars' rows only: B=1,8,64 x 512/8k, prefill 2k/8k, one
# mixed batch). The plan, from the 2026-11-26 timings (H200: profiles/h200-2026-11-26*;
# H100, session 15: profiles/h100-2026-11-26c, 15 min of device time: 3 calls, 484 +
# 175 + 68 s; machines start in ~30-60 s, and each call after the machine went back
# starts a fresh one with cold caches):
#   0. Since session 26 (profiles/h100-2026-11-27c-gpu-check.md: every #17 bar passed,
#      thin at B=8 8k eager and B=64 2k copy bandwidth; the server keeps Python's GIL
#      interval), first:
#      GPU_CHECK_QUICK=1 GPU_CHECK_BUDGET_S=540 ... gpu_check.sh kernels install_splits
#        kernels_table full serve_procs
#      (#17's thin rows again; `serve_procs` decides --api-servers' default), then the
#      older plan below.
#   1. GPU_CHECK_QUICK=1 GPU_CHECK_BUDGET_S=540 ... gpu_check.sh full modes diag kernels
#        install_splits kernels_table startup throughput sweep startup_profile
#        correctness first, then every issue's headline bar (on the H100: 129 + 25 + 20
#        + 54 + 88 + 72 + 27 + 61 s, and ~30 s for the table's decode rows). Since
#        session 20 the split sweep also times the counts between the powers of two (3,
#        6, 12, 24, 48: B=8 x 8 KV heads fills 132 SMs at 6 splits, not 4 or 8), the
#        installed table merges into the shipped one, and `kernels_table` re-times #17's
#        decode rows with it: its verdicts are the bars as they will ship once
#        splits_installed.json is committed. New since 51327d1, never run on a GPU: the split
#        counts as runtime arguments (one compiled attention variant for every mixed
#        launch, one for decode launches: `full` checks numerics, `throughput` and
#        `sweep` now FAIL when a timed run compiled a Triton kernel), decode tiles
#        walking their keys in one loop (DECODE_ONE_KV_LOOP on), the shipped H100 split
#        and prefill tile tables, and the bytecode cache (device.txt's `bytecode:` line
#        says whether this machine recompiles torch from source on every start: it did
#        on 2026-11-26, 6.5 s of a warm start), and uniform decode with RoPE and the KV
#        write inside the attention kernel (`full`'s test_decode_rope_kernel_on_cuda;
#        on its failure the later steps run with LLMFAST_ATTENTION_DECODE_ROPE=0;
#        `diag`'s trace should show no `_rope_and_cache_kernel` at B=1 and 64, and
#        `_decode_rope_attention_kernel` x16 instead of `_unified_attention_kernel`),
#        and the warm start without Dynamo (llmfast/compile/precompiled.py: `startup`'s
#        new verdict line says whether the warm start loaded the cold one's trace;
#        `full` and every compiled step after the first start load it too); since
#        a5229f2: the tokenizer loads in a thread beside the runner's start (`startup`'s
#        stages show `tokenizer_wait`, the part it still cost), and `startup`'s cold
#        start finds the imports' bytecode primed (an info line gives the priming's
#        seconds: what a machine's very first start adds); the fused decode kernel now
#        takes async steps with a token-less row (it raised before: `full`'s async
#        tests and every engine step after would have failed); the full graphs are
#        captured once (the largest measured first); one merge-counter buffer per
#        runner (the engine's full graphs record no memsets: `sweep`'s small batches);
#        since 97a09ce: the cached launch path hands Triton's launcher addresses, not
#        tensors (no data_ptr() call or driver pointer check per tensor: `kernels`' decode
#        rows show host us per launch both ways, and an info line sums them up); every
#        cold start since 6cf0f3a would have failed in capture (the full graphs' host
#        max_query_len, made under inference_mode, recompiled the model: fixed in
#        84c6757, found on the CPU by forcing RoPE into the op), so `full` is the first
#        run of that path; test_decode_rope_kernel_on_cuda now also holds the op's
#        uniform-decode cases (their failure turns the fused kernel off, not the layer
#        kernels); session 19: a start compiles its Triton variants in threads before
#        the memory profile (dry forwards; `startup`'s stages show `precompile`, and a
#        verdict line says no variant was compiled at a launch after it) and starts
#        Inductor's compile workers while it profiles and traces, not at its first
#        kernel (cold start only; compile/workers.py); session 21: a precompile
#        thread's failed compile is logged with its root cause (a warning in the
#        `startup` and `full` logs). All of this ran on the H100 on 2026-11-27
#        (profiles/h100-2026-11-27-gpu-check.md: every step ok, the bars of #15 and
#        #18's throughput and defaults pass; warm TTFT 10.0-11.3 s). New since then:
#        the random presets' tokenizer without transformers (c8034eb): `startup` first
#        (GPU_CHECK_QUICK=1 GPU_CHECK_BUDGET_S=200 ... startup startup_profile), for the
#        warm TTFT it should bring under 10 s
#   2. at once, on the warm machine: GPU_CHECK_QUICK=1 GPU_CHECK_BUDGET_S=<budget_left_s
#        - 60> ... gpu_check.sh skipped defaults startup_serial decode_configs
#        (defaults: #18 asks for the CUDA step limits to be decided by measurement, and
#        they never were: 8192 and 16384 tokens first; startup_serial: the cold start
#        without session 19's two start-up changes, for what they save; decode_configs:
#        #15's B=64 attention tiles). `load` and `async` passed on the H100 (#16 is
#        closed), `kernels64` shipped its table: not again unless time is left.
#        `skipped` = the steps the previous call of this machine skipped (a file under
#        /tmp)
#   3. with what is left (no machine starts with < 4 min left; use it while warm):
#        `serve_gil` first (session 25's GIL switch interval for the server: the server
#        was host-bound on the H100, 18.4 ms a token at 256 streams), then
#        `kernels64`, `async_tests`, `tests`, `fp8 kvfp8`, `families`,
#        `serve_stall` (session 24's tokenising thread and sliced adds, on the GPU's
#        2-5 ms steps), `serve_procs serve`, as time allows.
#   Then copy the calls' report.md, verdicts.txt and results.tar.gz's files into
#   profiles/<gpu>-<date>/ and commit them: session 15's were lost.
# Set GPU_CHECK_BUDGET_S to status's budget_left_s less ~60 s when that is under 620.
# Compile caches persist between calls while the machine stays warm (LLMFAST_CACHE
# below). What comes back of $OUT: report.md, verdicts.txt and results.tar.gz
# (everything else, packed at the end: the tool returns 8 files at most).
#
# Dry run, on CPU, here: PYTHONPATH=$PWD GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh [steps|all]
# runs every step's command with random:tiny, float32, on the CPU and tiny sizes
# (pytest steps: --collect-only), then its verdict parsing (DRY-PASS / DRY-FAIL lines:
# CPU figures, not the bars). It catches bad flags, missing files and parse errors
# before GPU minutes are spent. Output under /tmp/llmfast_gpu_check_dry by default.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${GPU_CHECK_DRY_RUN:-0}
if [[ $DRY == 1 ]]; then
    OUT=${OUT:-/tmp/llmfast_gpu_check_dry}
    BUDGET=${GPU_CHECK_BUDGET_S:-100000}
else
    OUT=${OUT:-/tmp/llmfast_gpu_check}
    BUDGET=${GPU_CHECK_BUDGET_S:-560}
fi
mkdir -p "$OUT"
# The compile cache stays out of $OUT (it is large and need not come back).
export LLMFAST_CACHE=${LLMFAST_CACHE:-/tmp/llmfast_cache}
# No prefill tile tuning inside the benchmarks (30-60 s, in whichever step first runs a
# long prefill, and inside the cold start of `startup`): they use a tuned or shipped table
# when there is one (the kernels step tunes explicitly and leaves its table in
# $LLMFAST_CACHE for the steps after it on the same machine), else the fixed heuristic.
export LLMFAST_ATTENTION_TUNING=${LLMFAST_ATTENTION_TUNING:-off}
ALL_STEPS="full async_tests modes async profile load startup sweep throughput tests kernels
kernels64 families defaults serve serve_procs serve_stall serve_gil presets executor tp fp8 kvfp8 diag
decode_configs install_splits kernels_table startup_profile startup_thin startup_serial
decode_tiles launch_host decode_gap decode_stages"
if (( $# )); then STEPS="$*"; else STEPS=${GPU_CHECK_STEPS:-full modes diag kernels install_splits kernels_table startup throughput sweep startup_profile}; fi
[[ $STEPS == all ]] && STEPS=$ALL_STEPS
QUICK=${GPU_CHECK_QUICK:-0}
# What a call skipped for lack of time, kept on the machine (it stays warm between calls)
# for the next call's step `skipped`.
STATE=${GPU_CHECK_STATE:-/tmp/llmfast_gpu_check_state$([[ $DRY == 1 ]] && echo _dry)}
mkdir -p "$STATE"
if [[ " $STEPS " == *" skipped "* ]]; then
    before=$(echo $(cat "$STATE/skipped" 2>/dev/null))
    STEPS=$(echo $(for step in $STEPS; do
                       if [[ $step == skipped ]]; then printf '%s\n' $before; else echo "$step"; fi
                   done | awk 'NF && !seen[$0]++'))
    echo "skipped by the previous call: ${before:-none}"
fi
PRESETS=${GPU_CHECK_PRESETS:-qwen2.5-0.5b qwen3-0.6b mistral-7b qwen3-8b llama-3.1-8b}
START=$SECONDS
declare -A STATUS
SKIPPED_STEPS=()  # the steps (as named in STEPS) that run_step skipped
KERNELS_ARGS=()
MODES_EST=90 ASYNC_EST=60 KERNELS_EST=150

if [[ $DRY == 1 ]]; then  # the same commands, CPU-sized
    MODEL=random:tiny DTYPE=float32 DEV=(--device cpu)
    PYTEST=(python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider)
    MODES_ARGS=(--batch-sizes 1,64 --modes eager,compiled,full,linears --iters 2 --warmup 1)
    ASYNC_ARGS=(--sizes 1,2 --steps 4 --repeats 1)
    PROFILE_ARGS=(--sizes 1,2 --steps 4)
    LOAD_ARGS=(--preset tiny --repeats 1)
    SWEEP_ARGS=(--sizes 1..4 --context 16 --steps 4)
    THROUGHPUT_ARGS=(--num-prompts 8 --input-len 16 --output-len 8)
    DEFAULTS_ARGS=(--num-prompts 16 --input-len 16 --output-len 8 --max-num-seqs 16)
    BUDGETS="default 64"
    SERVE_PROCS_ARGS=(--num-prompts 8 --input-len 16 --output-len 8 --vocab-size 512
                      --request-rate inf)
    SERVE_ARGS=(--num-prompts 8 --input-len 16 --output-len 8 --vocab-size 512
                --request-rate 4,inf)
    SERVE_GIL_ARGS=(--num-prompts 8 --input-len 16 --output-len 8 --vocab-size 512
                    --request-rate inf)
    PRESET_ARGS=(--sizes 1,2 --context 16 --modes eager --steps 4)
    PRESETS="tiny"
    EXECUTOR_ARGS=(--configs uni:1,mp:1 --sizes 1,2 --steps 8 --repeats 1)
    FP8_MODES_ARGS=(--batch-sizes 1,2 --modes eager,compiled,full --iters 2 --warmup 1)
else
    MODEL=random:llama-3.2-1b DTYPE=bfloat16 DEV=()
    # -v: one line per test as it ends, so a step cut off by its time limit still shows
    # which tests passed; -rA: the summary (and passed tests' output) at the end.
    PYTEST=(python3 -m pytest -m gpu -v -p no:cacheprovider -rA --durations=10)
    MODES_ARGS=(--batch-sizes 1,8,64,256)
    ASYNC_ARGS=(--sizes 1,64,256)
    if [[ $QUICK == 1 ]]; then  # the bars' rows only (see the plan above)
        MODES_ARGS=(--batch-sizes 1,64,256 --modes eager,graphs,full,linears --iters 30)
        ASYNC_ARGS=(--sizes 1,64,256 --repeats 2)
        KERNELS_ARGS=(--batches 1 8 64 --contexts 512 8192 --prefill-tokens 2048 8192
                      --mixed 2048,2048,64,2048 --iters 20)
        MODES_EST=45 ASYNC_EST=45 KERNELS_EST=70  # kernels: 54 s on the H100 with 7 split counts, 12 now
    fi
    PROFILE_ARGS=(--sizes 1,64 --steps 16)
    LOAD_ARGS=(--preset llama-3.2-1b --repeats 2)
    # The former random init (10-20 s of CPU RNG for the 1B) is known: not again.
    [[ $QUICK == 1 ]] && LOAD_ARGS+=(--skip-old)
    SWEEP_ARGS=(--sizes 1..512 --context 128 --steps 32)
    # llmfast keeps its engine (and KV cache) while HF runs in the same process: half
    # the GPU each, so HF's batch-size probe is not cut short by memory.
    THROUGHPUT_ARGS=(--num-prompts 256 --input-len 256 --output-len 128
                     --gpu-memory-utilization 0.5)
    DEFAULTS_ARGS=(--num-prompts 512 --input-len 256 --output-len 128 --max-num-seqs 512)
    BUDGETS="default 16384 2048"  # the CUDA default (8192), a larger, the old one
    SERVE_PROCS_ARGS=(--num-prompts 512 --input-len 128 --output-len 128 --vocab-size 32000
                      --request-rate inf)
    SERVE_ARGS=(--num-prompts 256 --input-len 256 --output-len 128 --vocab-size 32000
                --request-rate "${GPU_CHECK_SERVE_RATES:-4,16,64,inf}")
    SERVE_GIL_ARGS=(--num-prompts 256 --input-len 256 --output-len 128 --vocab-size 32000
                    --request-rate inf)
    PRESET_ARGS=(--max-model-len 1024 --sizes 1,64 --context 512 --modes graphs
                 --cuda-graph-sizes 1,64)
    EXECUTOR_ARGS=(--device cuda --configs uni:1,mp:1,mp-2msg:1 --sizes 1,64)
    FP8_MODES_ARGS=(--batch-sizes 1,64 --modes eager,full,linears)
fi

verdict() {  # step name: its PASS/FAIL lines, printed and kept in verdicts.txt
    local flags=()
    [[ $DRY == 1 ]] && flags=(--dry-run)
    python3 scripts/gpu_verdicts.py "${flags[@]}" "$1" "$OUT" 2>&1 | tee -a "$OUT/verdicts.txt"
}

queued_after() {  # step, its prerequisite steps: whether one of those was skipped for
    # time in this call; if so the step is queued behind it for `skipped` (the next call
    # runs them in order; the step may still run now, on what this call has) and 0 is
    # returned
    local step=$1 prior
    shift
    for prior in "$@"; do
        if [[ " ${SKIPPED_STEPS[*]} " == *" $prior "* ]]; then
            STATUS[$step]="SKIPPED: after $prior, which was skipped for time"
            echo "QUEUED   $step: after $prior, skipped for time; the next call runs it" \
                | tee -a "$OUT/verdicts.txt"
            SKIPPED_STEPS+=("$step")
            return 0
        fi
    done
    return 1
}

run_step() {  # name, estimate s, limit s, command...
    local name=$1 est=$2 limit=$3
    shift 3
    local left=$((BUDGET - (SECONDS - START))) why=""
    if [[ " ${GPU_CHECK_DEFER:-} " == *" $name "* ]]; then  # as if out of time
        why="deferred (GPU_CHECK_DEFER)"
    elif (( left < est )); then
        why="needs ~$est s"
    fi
    if [[ -n $why ]]; then
        STATUS[$name]="SKIPPED: $why, $left s left in this call"
        echo "=== $name: ${STATUS[$name]}" | tee -a "$OUT/steps.log"
        echo "SKIPPED  $name: $why, not run in this call; run it in the next" \
            | tee -a "$OUT/verdicts.txt"
        SKIPPED_STEPS+=("$step")
        return
    fi
    (( limit > left )) && limit=$left
    echo "=== $name (limit $limit s): $*" | tee -a "$OUT/steps.log"
    local t0=$SECONDS
    timeout -k 15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    case $rc in
        0) STATUS[$name]="ok in $((SECONDS - t0)) s" ;;
        124|137) STATUS[$name]="TIMED OUT after $((SECONDS - t0)) s (limit $limit s)" ;;
        *) STATUS[$name]="FAILED rc=$rc in $((SECONDS - t0)) s" ;;
    esac
    echo "=== $name: ${STATUS[$name]}" | tee -a "$OUT/steps.log"
    (( rc != 0 )) && echo "FAIL     $name: ${STATUS[$name]} (see $name.log)" \
        | tee -a "$OUT/verdicts.txt"
    verdict "$name"
}

{
    if [[ $DRY == 1 ]]; then echo "DRY RUN on the CPU: $(uname -n)"; else nvidia-smi -L; fi
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    echo "steps: $STEPS; budget $BUDGET s; commit ${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    # Whether starts compile torch from source each time (#18; llmfast/utils/bytecode.py).
    python3 -c "import importlib.util as u, os, sys; o = u.find_spec('torch').origin; print('bytecode: torch .pyc beside its source', os.path.isfile(u.cache_from_source(o)), '| dont_write_bytecode', sys.dont_write_bytecode, '| site-packages writable', os.access(os.path.dirname(o), os.W_OK))"
} 2>&1 | tee "$OUT/device.txt"

for step in $STEPS; do
    case $step in
        full)
            run_step full 130 330 "${PYTEST[@]}" -s tests/test_full_graphs_gpu.py \
                tests/test_layer_kernels.py tests/test_rope_cache.py \
                tests/test_attention_kernels_gpu.py -k "not test_attention_kernels_gpu or mixed or decode_region"
            # When the failure is the layer kernels' (their GPU tests, RoPE fused into the
            # KV write included, or a traceback through their files), measure the rest
            # with the torch norms and RoPE rather than not at all; when it is the mixed
            # launches' decode region, without it; any other failure leaves them on.
            if [[ ${STATUS[full]} == FAILED* && $DRY != 1 && -z ${LLMFAST_LAYER_KERNELS:-} ]] \
                && [[ -n $(grep -E 'test_(layer_kernels|rope_cache)\.py::[a-z_]+ FAILED|llmfast/kernels/(layers/|rope_cache)' \
                           "$OUT/full.log" | grep -v 'test_decode_rope_kernel_on_cuda') ]]; then
                export LLMFAST_LAYER_KERNELS=0
                echo "NOTE     full failed in the layer kernels: the steps after it run with" \
                    "LLMFAST_LAYER_KERNELS=0" | tee -a "$OUT/verdicts.txt"
            fi
            if [[ ${STATUS[full]} == FAILED* && $DRY != 1 \
                    && -z ${LLMFAST_ATTENTION_DECODE_REGION:-} ]] \
                && grep -Eq 'test_attention_kernels_gpu\.py::test_(mixed|decode_region|forced_splits_on_mixed)[a-z_]*\[?[^ ]* FAILED' \
                    "$OUT/full.log"; then
                export LLMFAST_ATTENTION_DECODE_REGION=0
                echo "NOTE     full failed in mixed attention launches: the steps after it" \
                    "run with LLMFAST_ATTENTION_DECODE_REGION=0" | tee -a "$OUT/verdicts.txt"
            fi
            # The uniform-decode kernel with RoPE and the KV write fused in: without it.
            if [[ ${STATUS[full]} == FAILED* && $DRY != 1 \
                    && -z ${LLMFAST_ATTENTION_DECODE_ROPE:-} ]] \
                && grep -Eq 'test_decode_rope_kernel_on_cuda FAILED' "$OUT/full.log"; then
                export LLMFAST_ATTENTION_DECODE_ROPE=0
                echo "NOTE     full failed in the fused decode + RoPE kernel: the steps after" \
                    "it run with LLMFAST_ATTENTION_DECODE_ROPE=0" | tee -a "$OUT/verdicts.txt"
            fi ;;
        async_tests)
            run_step async_tests 220 300 "${PYTEST[@]}" tests/test_async_gpu.py \
                tests/test_sampling.py ;;
        tests)
            run_step tests 250 560 "${PYTEST[@]}" --ignore=tests/test_families_gpu.py \
                --ignore=tests/test_full_graphs_gpu.py --ignore=tests/test_async_gpu.py \
                --ignore=tests/test_sampling.py --ignore=tests/test_fp8_gpu.py \
                --ignore=tests/test_kv_cache_fp8_gpu.py ;;  # their own steps' files
        families)
            run_step families 300 560 "${PYTEST[@]}" tests/test_families_gpu.py ;;
        kernels)  # the kernels helper's step: its command is theirs
            if [[ ! -f scripts/bench_kernels.py ]]; then
                STATUS[kernels]="skipped (no scripts/bench_kernels.py)"
            elif [[ $DRY == 1 ]]; then  # only that its flags exist
                run_step kernels 10 60 bash -c 'h=$(python3 scripts/bench_kernels.py --help) \
                    || exit 1; for f in --json --markdown --sweep-splits --tune \
                    --tuned-table --prefill-tokens --mixed; do \
                    grep -q -- "$f" <<<"$h" || { echo "no $f"; exit 1; }; done; echo flags ok'
            else
                run_step kernels "$KERNELS_EST" 540 python3 scripts/bench_kernels.py \
                    "${KERNELS_ARGS[@]}" --tune force \
                    --tuned-table "$OUT/prefill_tiles.json" --json "$OUT/kernels.json" \
                    --markdown "$OUT/kernels.md" --sweep-splits "$OUT/splits.json"
            fi ;;
        kernels64)  # the default model's decode shape (1B: head dim 64), splits only
            if [[ $DRY == 1 ]]; then
                run_step kernels64 10 60 bash -c 'python3 scripts/bench_kernels.py --help \
                    | grep -q -- --prefill-tokens && echo flags ok'
            else
                run_step kernels64 30 240 python3 scripts/bench_kernels.py --head-dim 64 \
                    --tune off --prefill-tokens --mixed --batches 1 4 16 64 256 \
                    --iters 30 --json "$OUT/kernels64.json" \
                    --markdown "$OUT/kernels64.md" --sweep-splits "$OUT/splits.json"
            fi ;;
        install_splits)  # the split sweeps of this call (kernels, kernels64) merged into
            # this machine's shipped table (their head dims replaced, the others kept), so
            # that the later steps run with what will ship: splits_installed.json
            # Queued again when a sweep of this call was skipped (the next call's sweep
            # needs installing), even if the other one's is installed now.
            queued=0
            queued_after install_splits kernels kernels64 && queued=1
            if [[ ! -f $OUT/splits.json ]]; then
                (( queued )) \
                    || STATUS[install_splits]="skipped (no splits.json: run kernels or kernels64 first)"
            else
                run_step install_splits 5 60 python3 -c 'import json, sys, torch
from llmfast.kernels.tuning.split_table import merge_tables, parse_tables, table_path
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu dry run"
dest = table_path(name)
shipped = json.loads(dest.read_text()) if dest.is_file() else None
merged = merge_tables(shipped, json.load(open(sys.argv[1])))
tables = parse_tables(merged)
open(sys.argv[2], "w").write(json.dumps(merged, indent=2))
if torch.cuda.is_available():
    dest.write_text(json.dumps(merged, indent=2))
print("installed", sys.argv[1], "merged into", dest, "; head dims", sorted(t.head_dim for t in tables))' \
                    "$OUT/splits.json" "$OUT/splits_installed.json"
            fi ;;
        kernels_table)  # #17's decode rows again, with the split table install_splits
            # merged in this call (kernels' own rows ran with the table shipped before);
            # queued behind install_splits when that is (and run now if it ran)
            queued=0
            queued_after kernels_table install_splits && queued=1
            if [[ $DRY == 1 ]]; then
                run_step kernels_table 10 60 bash -c 'python3 scripts/bench_kernels.py --help \
                    | grep -q -- --prefill-tokens && echo flags ok'
            elif [[ ${STATUS[install_splits]:-} != ok* ]]; then
                (( queued )) \
                    || STATUS[kernels_table]="skipped (install_splits did not run in this call)"
            else
                run_step kernels_table 25 180 python3 scripts/bench_kernels.py --tune off \
                    --prefill-tokens --mixed --batches 1 8 64 --contexts 512 2048 8192 \
                    --json "$OUT/kernels_table.json" --markdown "$OUT/kernels_table.md"
            fi ;;
        diag)  # what the full graph launches: kernels per step and Inductor's code
            rm -rf "$OUT/traces"
            run_step diag 60 240 env TORCH_LOGS=output_code \
                TORCH_LOGS_OUT="$OUT/inductor_output_code.log" \
                python3 scripts/bench_modes.py --model "$MODEL" --dtype "$DTYPE" "${DEV[@]}" \
                --batch-sizes 1,64 --modes full,linears --iters 20 \
                --trace-dir "$OUT/traces" --json "$OUT/diag_modes.json" ;;
        decode_configs)  # BLOCK_N x stages x min split tiles at the full graph's launch
            if [[ $DRY == 1 ]]; then
                run_step decode_configs 10 60 bash -c 'python3 scripts/sweep_decode_configs.py \
                    --help | grep -q -- --loops && echo flags ok'
            else
                run_step decode_configs 100 300 bash -c 'set -e
                    python3 scripts/sweep_decode_configs.py --head-dim 64 --stages 3 \
                        --json "$1/decode_configs64.json"
                    python3 scripts/sweep_decode_configs.py --head-dim 128 --batches 1 8 \
                        --stages 3 --contexts 512 8192 --json "$1/decode_configs128.json"' \
                    _ "$OUT"
            fi ;;
        decode_stages)  # decode pipeline stages 3 vs 5 x split counts (#17)
            if [[ $DRY == 1 ]]; then
                run_step decode_stages 10 60 bash -c 'python3 scripts/sweep_decode_configs.py \
                    --help | grep -q -- --splits && echo flags ok'
            else
                run_step decode_stages 40 200 bash -c 'set -e
                    common=(--block-n 128 --stages 3 5 --warps 4 --min-split-tiles 2 --loops 1
                            --iters 20)
                    python3 scripts/sweep_decode_configs.py --head-dim 64 --batches 1 8 64 \
                        --contexts 512 8192 --splits 1 2 4 8 12 16 "${common[@]}" \
                        --json "$1/decode_stages64.json"
                    python3 scripts/sweep_decode_configs.py --head-dim 128 --batches 1 8 64 \
                        --contexts 512 --splits 1 2 3 4 8 16 "${common[@]}" \
                        --json "$1/decode_stages128.json"' _ "$OUT"
            fi ;;
        decode_tiles)  # warps x stages x BLOCK_N x split counts, head dim 128 (#17)
            if [[ $DRY == 1 ]]; then
                run_step decode_tiles 10 60 bash -c 'python3 scripts/sweep_decode_configs.py \
                    --help | grep -q -- --warps && echo flags ok'
            else
                run_step decode_tiles 150 330 python3 scripts/sweep_decode_configs.py \
                    --head-dim 128 --batches 1 8 64 --contexts 2048 8192 --block-n 64 128 \
                    --stages 2 3 4 5 --warps 4 8 --min-split-tiles 2 --loops 1 \
                    --splits 1 2 3 4 6 8 12 16 --iters 20 --json "$OUT/decode_tiles.json"
            fi ;;
        decode_gap)  # llmfast vs SDPA decode: paged vs in-order layout, L2 flush (#17)
            if [[ $DRY == 1 ]]; then
                run_step decode_gap 10 60 bash -c 'python3 scripts/bench_decode_gap.py \
                    --help | grep -q -- --shapes && echo flags ok'
            else
                run_step decode_gap 60 200 python3 scripts/bench_decode_gap.py \
                    --json "$OUT/decode_gap.json"
            fi ;;
        launch_host)  # where an eager attention call's host time goes (#17)
            if [[ $DRY == 1 ]]; then
                run_step launch_host 10 60 bash -c 'python3 scripts/bench_launch_device.py \
                    --help | grep -q -- --context && echo flags ok'
            else
                run_step launch_host 30 120 bash -c 'set -e
                    python3 scripts/bench_launch_device.py --batch 8 --context 2048 \
                        --json "$1/launch_host_b8.json"
                    python3 scripts/bench_launch_device.py --batch 1 --context 8192 \
                        --json "$1/launch_host_b1.json"' _ "$OUT"
            fi ;;
        modes)
            run_step modes "$MODES_EST" 560 python3 scripts/bench_modes.py --model "$MODEL" \
                --dtype "$DTYPE" "${DEV[@]}" "${MODES_ARGS[@]}" --json "$OUT/modes.json" ;;
        async)
            run_step async "$ASYNC_EST" 330 python3 scripts/bench_async.py --model "$MODEL" \
                --dtype "$DTYPE" "${DEV[@]}" "${ASYNC_ARGS[@]}" --json "$OUT/async.json" ;;
        profile)
            rm -rf "$OUT/profile-sync" "$OUT/profile-async"
            run_step profile 80 260 bash -c 'set -e; out=$1; shift
                python3 -m llmfast profile "$@" --tracer torch --no-async-scheduling \
                    --out "$out/profile-sync"
                python3 -m llmfast profile "$@" --tracer torch --async-scheduling \
                    --out "$out/profile-async"' _ "$OUT" --model "$MODEL" --dtype "$DTYPE" \
                "${DEV[@]}" "${PROFILE_ARGS[@]}" ;;
        load)
            run_step load 45 150 python3 scripts/bench_load.py --dtype "$DTYPE" \
                --device "${DEV[1]:-cuda}" "${LOAD_ARGS[@]}" --json "$OUT/load.json" ;;
        startup)  # with the model's prefill tiles shipped, as a user gets them once they
            # ship (tuned here first if this machine has not yet: ~20-60 s, not timed),
            # and tuning on its default (auto), as a user runs
            run_step startup 120 300 bash -c 'model=$1 dtype=$2 out=$3; shift 3
                python3 scripts/ship_prefill_tiles.py --model "$model" --dtype "$dtype" \
                    --copy-to "$out/prefill_tiles_model.json" || exit 1
                LLMFAST_ATTENTION_TUNING=auto python3 -m llmfast bench --model "$model" \
                    --dtype "$dtype" "$@" --startup --json "$out/startup.json"' \
                _ "$MODEL" "$DTYPE" "$OUT" "${DEV[@]}" ;;
        startup_thin)  # the same start-up with piecewise graphs at 10 sizes, not 51
            run_step startup_thin 120 300 bash -c 'model=$1 dtype=$2 out=$3; shift 3
                LLMFAST_ATTENTION_TUNING=auto python3 -m llmfast bench --model "$model" \
                    --dtype "$dtype" "$@" --piecewise-graph-sizes 1..512 --startup \
                    --json "$out/startup_thin.json"' _ "$MODEL" "$DTYPE" "$OUT" "${DEV[@]}" ;;
        startup_serial)  # the cold start compiling as before session 19: Triton
            # variants at their launches, Inductor's workers started by its first kernel
            run_step startup_serial 100 300 bash -c 'model=$1 dtype=$2 out=$3; shift 3
                LLMFAST_KERNEL_PRECOMPILE=0 TORCH_WARM_POOL=0 LLMFAST_ATTENTION_TUNING=auto \
                python3 -m llmfast bench --model "$model" --dtype "$dtype" "$@" --startup \
                    --json "$out/startup_serial.json"' _ "$MODEL" "$DTYPE" "$OUT" "${DEV[@]}" ;;
        startup_profile)  # what the seconds of a warm start no stage claims ran
            run_step startup_profile 90 300 python3 scripts/profile_startup.py \
                --model "$MODEL" --dtype "$DTYPE" "${DEV[@]}" --out "$OUT" ;;
        sweep)
            run_step sweep 40 240 python3 -m llmfast bench --model "$MODEL" \
                --dtype "$DTYPE" "${DEV[@]}" "${SWEEP_ARGS[@]}" --json "$OUT/sweep.json" ;;
        throughput)
            run_step throughput 110 330 python3 -m llmfast bench --model "$MODEL" \
                --dtype "$DTYPE" "${DEV[@]}" --mode throughput "${THROUGHPUT_ARGS[@]}" \
                --baseline hf --json "$OUT/throughput.json" ;;
        defaults)
            for budget in $BUDGETS; do  # "default": the engine's own CUDA step limits
                budget_flag=(--max-num-batched-tokens "$budget")
                [[ $budget == default ]] && budget_flag=()
                run_step "defaults_$budget" 100 110 python3 -m llmfast bench \
                    --model "$MODEL" --dtype "$DTYPE" "${DEV[@]}" --mode throughput \
                    "${DEFAULTS_ARGS[@]}" "${budget_flag[@]}" \
                    --json "$OUT/defaults_$budget.json"
            done ;;
        serve)
            run_step serve "$([[ -n ${GPU_CHECK_SERVE_RATES:-} ]] && echo 120 || echo 250)" 400 \
                bash -c 'out=$1 model=$2 dtype=$3; shift 3
                dev=(); [[ $1 == --device ]] && { dev=("$1" "$2"); shift 2; }
                python3 -m llmfast serve --model "$model" --dtype "$dtype" "${dev[@]}" \
                    --port 8011 > "$out/serve-server.log" 2>&1 &
                pid=$!
                for _ in $(seq 300); do
                    python3 -c "import urllib.request as u; u.urlopen(\"http://127.0.0.1:8011/health\", timeout=2)" \
                        2>/dev/null && break
                    kill -0 $pid 2>/dev/null || { echo "server died"; tail "$out/serve-server.log"; exit 1; }
                    sleep 1
                done
                python3 scripts/bench_serve.py --url http://127.0.0.1:8011 "$@" \
                    --json "$out/serve.json"
                rc=$?; kill -TERM $pid; wait $pid; exit $rc' _ "$OUT" "$MODEL" "$DTYPE" \
                "${DEV[@]}" "${SERVE_ARGS[@]}" ;;
        serve_procs)  # HTTP in the engine's process vs in 1 and 2 of its own, same load
            run_step serve_procs 300 540 bash -c 'out=$1 model=$2 dtype=$3; shift 3
                dev=(); [[ $1 == --device ]] && { dev=("$1" "$2"); shift 2; }
                python3 scripts/bench_serve.py --launch "$model" --api-servers 0,1,2 \
                    --serve-args "--dtype $dtype ${dev[*]}" "$@" \
                    --json "$out/serve_procs.json"' _ "$OUT" "$MODEL" "$DTYPE" \
                "${DEV[@]}" "${SERVE_PROCS_ARGS[@]}" ;;
        serve_gil)  # the server at GIL switch intervals GPU_CHECK_GIL_MS (in that order)
            run_step serve_gil 120 330 bash -c 'out=$1 model=$2 dtype=$3 order=$4; shift 4
                dev=(); [[ $1 == --device ]] && { dev=("$1" "$2"); shift 2; }
                i=0
                for ms in $order; do
                    i=$((i + 1))
                    echo "## LLMFAST_SWITCH_INTERVAL_MS=$ms (run $i)"
                    LLMFAST_SWITCH_INTERVAL_MS=$ms python3 scripts/bench_serve.py \
                        --launch "$model" --serve-args "--dtype $dtype ${dev[*]}" "$@" \
                        --json "$out/serve_gil_${i}_$ms.json" || exit
                done' _ "$OUT" "$MODEL" "$DTYPE" "${GPU_CHECK_GIL_MS:-5 0.5}" "${DEV[@]}" \
                "${SERVE_GIL_ARGS[@]}" ;;
        serve_stall)  # the engine loop's stall while a long prompt / 100k choices go in
            run_step serve_stall 90 240 python3 scripts/bench_serve_stall.py --model "$MODEL" \
                --dtype "$DTYPE" "${DEV[@]}" --max-num-seqs 256 --prompts 2000 --n 50 \
                --json "$OUT/serve_stall.json" ;;
        presets)
            for preset in $PRESETS; do
                run_step "preset-$preset" 100 110 python3 -m llmfast bench \
                    --model "random:$preset" --dtype "$DTYPE" "${DEV[@]}" \
                    "${PRESET_ARGS[@]}" --json "$OUT/preset-$preset.json"
            done ;;
        executor)  # issue 21: engine step uni vs mp with one rank (the executor's IPC per step;
                   # mp-2msg: the collect as its own message, the protocol before 2026-11-23)
            run_step executor 150 400 python3 scripts/bench_executor.py --model "$MODEL" \
                "${DEV[@]}" "${EXECUTOR_ARGS[@]}" --json "$OUT/executor.json" ;;
        kvfp8)
            if [[ $DRY == 1 ]]; then  # the tests' collection; the bench's flag exists
                run_step kvfp8 10 120 bash -c '"$@" tests/test_kv_cache_fp8_gpu.py \
                    && python3 scripts/bench_kernels.py --help | grep -q -- --kv-cache-dtype \
                    && echo flags ok' _ "${PYTEST[@]}"
            else
                run_step kvfp8 210 360 bash -c 'out=$1; shift; rc=0
                    "$@" -s tests/test_kv_cache_fp8_gpu.py || rc=1
                    python3 scripts/bench_kernels.py --kv-cache-dtype fp8 --tune off \
                        --prefill-tokens --mixed --batches 1 8 64 256 --contexts 2048 8192 \
                        --iters 30 --json "$out/kernels_kvfp8.json" \
                        --markdown "$out/kernels_kvfp8.md" || rc=1
                    exit $rc' _ "$OUT" "${PYTEST[@]}"
            fi ;;
        fp8)
            run_step fp8 280 400 bash -c 'out=$1; shift; n=$1; shift; pytest=("${@:1:n}")
                shift "$n"; rc=0
                "${pytest[@]}" tests/test_fp8_gpu.py || rc=1
                for q in bf16 fp8; do
                    flag=(); [[ $q == fp8 ]] && flag=(--quantization fp8)
                    python3 scripts/bench_modes.py "$@" "${flag[@]}" \
                        --json "$out/modes_$q.json" || rc=1
                done
                exit $rc' _ "$OUT" "${#PYTEST[@]}" "${PYTEST[@]}" --model "$MODEL" \
                --dtype "$DTYPE" "${DEV[@]}" "${FP8_MODES_ARGS[@]}" ;;
        tp)  # issue 21: TP=2 over NCCL with CUDA graphs and async; needs >= 2 GPUs (skips on 1)
            run_step tp 120 400 "${PYTEST[@]}" -rs tests/test_tensor_parallel.py \
                tests/test_executor_gpu.py ;;
        *) echo "unknown step $step (steps: $(echo $ALL_STEPS))" | tee -a "$OUT/verdicts.txt"
           STATUS[$step]="unknown step" ;;
    esac
done

printf '%s\n' "${SKIPPED_STEPS[@]}" | awk 'NF && !seen[$0]++' > "$STATE/skipped"

echo
echo "================ llmfast gpu_check summary ================"
cat "$OUT/device.txt"
for step in $STEPS; do
    case $step in
        presets) for p in $PRESETS; do printf '%-18s %s\n' "preset-$p" "${STATUS[preset-$p]:-not run}"; done ;;
        defaults) for b in $BUDGETS; do printf '%-18s %s\n' "defaults_$b" "${STATUS[defaults_$b]:-not run}"; done ;;
        *) printf '%-18s %s\n' "$step" "${STATUS[$step]:-not run}" ;;
    esac
done
if (( ${#SKIPPED_STEPS[@]} )); then
    echo "--- skipped for lack of time: $(tr '\n' ' ' < "$STATE/skipped")(the step" \
        "\`skipped\` of this machine's next call runs them)"
fi
if [[ -f "$OUT/verdicts.txt" ]]; then
    echo "--- verdicts of this call: $OUT/verdicts.txt"
    grep -E '^(PASS|FAIL|MISSING|SKIPPED|QUEUED|DRY-PASS|DRY-FAIL) ' "$OUT/verdicts.txt" | tail -n 60
fi
ran() { [[ " $(echo $STEPS) " == *" $1 "* ]]; }
ran defaults && for budget in $BUDGETS; do
    if [[ -f "$OUT/defaults_$budget.log" ]]; then
        echo "--- defaults, budget $budget tokens:"
        grep -E '│ llmfast ' "$OUT/defaults_$budget.log" | tail -n 1
    fi
done
if ran serve && [[ -f "$OUT/serve.log" ]]; then
    echo "--- serve (llmfast serve under load, ms):"
    tail -n 7 "$OUT/serve.log"
fi
if ran presets && compgen -G "$OUT/preset-*.json" > /dev/null; then
    echo "--- presets (step ms p50, decode tok/s, load s):"
    python3 - "$OUT"/preset-*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    run = next(iter(json.load(open(path))["runs"].values()))
    rows = "  ".join(f"b{r['batch_size']}: {r['step_latency']['median'] * 1e3:.2f} ms "
                     f"{r['decode_tokens_per_s']:.0f} tok/s" for r in run["sweep"])
    print(f"{run['model']:<22} {rows}  load {run['startup'].get('load', float('nan')):.1f} s")
PY
fi
if ran kernels && [[ -f "$OUT/kernels.json" ]]; then
    echo "--- kernels: see $OUT/kernels.log / kernels.md (prefill, mixed, tuning first):"
    grep -A 30 '^Prefill (one request' "$OUT/kernels.log" | head -n 30
fi
python3 scripts/gpu_report.py "$OUT" > "$OUT/report.md" \
    && echo "--- $OUT/report.md: commands, outcomes, verdicts and tables (for profiles/)"

# The device tool brings back at most 8 files of 16 MiB from $OUT, so everything but
# report.md and verdicts.txt is packed into results.tar.gz and leaves $OUT (the kernels
# step's prefill_tiles.json and splits.json are in it: `tar -xzf results.tar.gz`).
# torch-profiler traces are left out when they would push it past 15 MiB.
# GPU_CHECK_PACK=0 keeps the files as they are (the default in a dry run).
pack_results() {
    local items=()
    mapfile -t items < <(cd "$OUT" && ls -A | grep -v -x -E 'report\.md|verdicts\.txt|results\.tar\.gz')
    (( ${#items[@]} )) || return 0
    (cd "$OUT" && tar -czf results.tar.gz "${items[@]}") || return 1
    if (( $(stat -c %s "$OUT/results.tar.gz") > 15 * 1024 * 1024 )); then
        echo "--- results.tar.gz over 15 MiB: packed again without the profiler traces"
        (cd "$OUT" && tar -czf results.tar.gz --exclude='trace.json' "${items[@]}") || return 1
    fi
    (cd "$OUT" && rm -rf "${items[@]}")
    echo "--- $OUT/results.tar.gz: every other file of this call ($(du -h "$OUT/results.tar.gz" | cut -f1))"
}
if [[ ${GPU_CHECK_PACK:-$(( DRY == 1 ? 0 : 1 ))} == 1 ]]; then
    pack_results || echo "packing the results failed: the device tool brings back 8 files at most"
fi
# Non-zero when any step failed or missed a bar (the verdict lines say which); in a dry
# run only when a step itself failed (CPU figures miss the bars by design).
if [[ $DRY == 1 ]]; then failed='^FAIL '; else failed='^(FAIL|MISSING) '; fi
! grep -q -E "$failed" "$OUT/verdicts.txt" 2>/dev/null
