#!/usr/bin/env python3
"""The GPU check: a table of steps, each a benchmark or test command run here with a time
limit, its timed figures sampled 3 times (median and spread), judged against the issues'
bars, all in one JSON stamped with the tree measured (see /work/shared/DEVICE.md).

Here, before the device call (the device copy's git metadata lags, so the tree's id
travels as a file; carry it with the wheels):

    python3 scripts/gpu_check.py stamp            # writes .tree-stamp (git-ignored)
    # device tool: carry [".whl", ".tree-stamp"], command:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \\
        PYTHONUNBUFFERED=1 || exit; python3 scripts/gpu_check.py headline

`headline` = sweep modes throughput kernels startup serve tests: the figures first (~7.5
min estimated from the 2026-11-27 H100 steps' times, the machine's first compiles
included), then `pytest -m gpu` whole with the time left. The whole GPU suite took ~15
min in parts on the H100 (full 130 s, async 220, families 300, fp8 90, the rest ~250), so
one 600 s call does not finish it: the files it did not reach are listed in the JSON and
the report, for `GPU_CHECK_TESTS="<files>" gpu_check.py tests` in the next calls.
Other steps: `moe` and `moe_decode` (#52: scripts/bench_moe.py, and the decode sweep of
random:qwen3-30b-a3b), `kernels_sweep` (bench_kernels' split sweep for this GPU's table),
`decode_configs` (bench_kernels.py decode-configs), `serve_procs` (--api-servers 0, 1, 2 under one
load), `executor` (uni vs mp), `spec` = `spec_decode` + `spec_decode_8b` (#50: the verify
step's cost at K = 1..8 and the forced-acceptance speed-up, 1B and 8B). #49
(profiles/decode-bw.md), in the order of its worth: `decode_bw_first` (--gemv auto's
start-up table for 1B and 8B, bf16 and fp8, then the sweeps its three bars judge),
`decode_bw_second` (the GEMV's GPU tests, the 8B cuBLAS baseline, the per-kind tables of
--gemv auto); further: `decode_bw` (1B: the per-layer-kind tables and the 1..512 sweep
with the GEMV off and on, bench_gemv's shapes), `decode_bw_8b`, `decode_bw_kinds_8b`,
`decode_bw_fused` (--gemv-fuse), `tune_bf16` / `tune_fp8` (the GEMV's launch table
tuned, installed, then swept), `tune_startup` / `tune_startup_8b` (the start-up
measurement of --gemv auto on both presets, bf16 and fp8, its table for shipping, then
swept against cuBLAS).

Under $OUT (default /tmp/llmfast_gpu_check): gpu_check.json (the one result: tree, device,
versions, command, date, per step its commands, samples, figures with median and spread,
verdicts), report.md (scripts/gpu_verdicts.py's report), and results.tar.gz (every log and
sample JSON). Back here: `python3 scripts/gpu_verdicts.py report gpu_check.json --pages
profiles` writes the figures into the topic pages and keeps the JSON under profiles/gpu/.

Dry run on the CPU (`--dry-run`): the same steps with random:tiny, float32 and tiny sizes
(pytest: --collect-only; bench_kernels: its flags), judged the same way (DRY-PASS /
DRY-FAIL: CPU figures, not the bars). It catches bad flags and parse errors before GPU
minutes are spent.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_verdicts  # noqa: E402

STAMP = REPO / ".tree-stamp"
GPU_MODEL, GPU_DTYPE = "random:llama-3.2-1b", "bfloat16"
DRY_MODEL, DRY_DTYPE = "random:tiny", "float32"
PY = sys.executable


@dataclass(frozen=True)
class Step:
    """One row of the table. `gpu` / `dry`: argv with {json} (this sample's JSON path),
    {model}, {dtype}, {out}; `samples`: runs of the command (1 where the command takes
    its samples in-process: `extract` then finds them all in its one JSON)."""

    name: str
    topic: str  # the profiles/ page its figures go to
    # All samples on an H100 with the compile caches of the first sample's start (from
    # the 2026-11-27 steps' times: sweep 14 s a run, modes 27, throughput 68 with HF's
    # batch probe, kernels 60-76 with tuning, startup 62 with the bytecode priming, serve
    # 56 for two rates); what budgeting skips by.
    est_s: int
    limit_s: int  # all its samples together
    gpu: tuple[str, ...]
    dry: tuple[str, ...]
    samples: int = 3
    extract: str | None = None  # gpu_verdicts.EXTRACT key; None: no figures
    env: dict = field(default_factory=dict)


_BENCH = (PY, "-m", "llmfast", "bench", "--model", "{model}", "--dtype", "{dtype}")
_INF3 = "inf,inf,inf"  # bench_serve: three samples at one server start

STEPS = {s.name: s for s in (
    Step("sweep", "decode", 60, 200,
         _BENCH + ("--sizes", "1,8,64,256,512", "--context", "128", "--steps", "32",
                   "--json", "{json}"),
         _BENCH + ("--device", "cpu", "--sizes", "1,2", "--context", "16", "--steps", "4",
                   "--json", "{json}"),
         extract="sweep"),
    Step("modes", "decode", 70, 240,
         (PY, "scripts/bench_modes.py", "--model", "{model}", "--dtype", "{dtype}",
          "--batch-sizes", "1,64", "--modes", "eager,full,linears", "--iters", "30",
          "--json", "{json}"),
         (PY, "scripts/bench_modes.py", "--model", "{model}", "--dtype", "{dtype}",
          "--device", "cpu", "--batch-sizes", "1,64", "--modes", "eager,full,linears",
          "--iters", "2", "--warmup", "1", "--max-model-len", "256", "--json", "{json}"),
         extract="modes"),
    # HF's batch fixed at its fastest on the H100 (256 of 8..256, probed 2026-11-27).
    Step("throughput", "throughput", 80, 200,
         _BENCH + ("--mode", "throughput", "--num-prompts", "256", "--input-len", "256",
                   "--output-len", "128", "--gpu-memory-utilization", "0.5",
                   "--baseline", "hf", "--hf-batch-size", "256", "--json", "{json}"),
         _BENCH + ("--device", "cpu", "--mode", "throughput", "--num-prompts", "4",
                   "--input-len", "16", "--output-len", "8", "--baseline", "hf",
                   "--json", "{json}"),
         extract="throughput"),
    Step("kernels", "kernels", 70, 240,
         (PY, "scripts/bench_kernels.py", "--tune", "off", "--batches", "1", "8", "64", "256",
          "--contexts", "512", "2048", "8192", "--prefill-tokens", "2048", "8192",
          "--mixed", "2048,2048,64,2048", "--iters", "20", "--eager-iters", "100",
          "--samples", "3", "--json", "{json}", "--markdown", "{out}/kernels.md"),
         (PY, "scripts/bench_kernels.py", "--help"),
         samples=1, extract="kernels"),
    # Cold (empty caches) then warm, in fresh processes; tuning as a user gets it.
    Step("startup", "startup", 110, 200,
         _BENCH + ("--startup", "--json", "{json}"),
         _BENCH + ("--device", "cpu", "--startup", "--json", "{json}"),
         extract="startup", env={"LLMFAST_ATTENTION_TUNING": "auto"}),
    # The same prompts on the engine in-process, then through the server.
    Step("serve", "serving", 50, 300,
         (PY, "scripts/bench_serve.py", "--launch", "{model}", "--engine-baseline",
          "--serve-args", "--dtype {dtype}", "--num-prompts", "256", "--input-len", "256",
          "--output-len", "128", "--vocab-size", "32000", "--request-rate", _INF3,
          "--json", "{json}"),
         (PY, "scripts/bench_serve.py", "--launch", "{model}", "--engine-baseline",
          "--serve-args", "--dtype {dtype} --device cpu", "--num-prompts", "4",
          "--input-len", "16", "--output-len", "8", "--vocab-size", "512",
          "--request-rate", _INF3, "--json", "{json}"),
         samples=1, extract="serve"),
    # Not in `headline`: HTTP in the engine's process vs in 1 and 2 of its own, same load
    # (decides --api-servers' default; never run on a GPU).
    Step("serve_procs", "serving", 200, 540,
         (PY, "scripts/bench_serve.py", "--launch", "{model}", "--api-servers", "0,1,2",
          "--serve-args", "--dtype {dtype}", "--num-prompts", "512", "--input-len", "128",
          "--output-len", "128", "--vocab-size", "32000", "--request-rate", _INF3,
          "--json", "{json}"),
         (PY, "scripts/bench_serve.py", "--launch", "{model}", "--api-servers", "0,1",
          "--serve-args", "--dtype {dtype} --device cpu", "--num-prompts", "4",
          "--input-len", "16", "--output-len", "8", "--vocab-size", "512",
          "--request-rate", "inf", "--json", "{json}"), samples=1),
    # Whole, with the time left (its limit is what remains of the budget).
    Step("tests", "tests", 100, 0,
         (PY, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rA",
          "--durations=15"),
         (PY, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"),
         samples=1),
    # Not in `headline`: this GPU's split table (kernels/tuning/split_tables/<gpu>.json).
    Step("kernels_sweep", "kernels", 120, 400,
         (PY, "scripts/bench_kernels.py", "--tune", "off", "--prefill-tokens", "--mixed",
          "--batches", "1", "2", "4", "8", "16", "32", "64", "128", "256",
          "--contexts", "512", "2048", "8192", "--iters", "20",
          "--sweep-splits", "{out}/splits.json", "--json", "{json}"),
         (PY, "scripts/bench_kernels.py", "--help"), samples=1),
    # Sliding-window attention (profiles/sliding.md): the windowed layers' decode
    # attention against the context, window on and off; a whole Gemma 3 1B (random
    # weights) decode sweep at 8k and 32k tokens of context.
    Step("sliding_kernels", "sliding", 60, 300,
         (PY, "scripts/bench_sliding.py", "--contexts", "8192", "32768", "--batches", "1",
          "16", "--samples", "3", "--json", "{json}"),
         (PY, "scripts/bench_sliding.py", "--help"), samples=1),
    Step("sliding_decode", "sliding", 120, 500,
         (PY, "-m", "llmfast", "bench", "--model", "random:gemma-3-1b", "--dtype", "{dtype}",
          "--sizes", "1,16", "--context", "32768", "--steps", "32",
          "--max-model-len", "32832", "--json", "{json}"),
         (PY, "-m", "llmfast", "bench", "--model", "random:tiny", "--device", "cpu",
          "--sizes", "1,2", "--context", "16", "--steps", "4", "--json", "{json}"), samples=1),
    Step("decode_configs", "kernels", 150, 400,
         (PY, "scripts/bench_kernels.py", "decode-configs", "--json", "{json}"),
         (PY, "scripts/bench_kernels.py", "decode-configs", "--help"), samples=1),
    Step("executor", "executor", 150, 400,
         (PY, "scripts/bench_executor.py", "--model", "{model}", "--device", "cuda",
          "--configs", "uni:1,mp:1", "--sizes", "1,64", "--json", "{json}"),
         (PY, "scripts/bench_executor.py", "--model", "{model}", "--device", "cpu",
          "--configs", "uni:1,mp:1", "--sizes", "1,2", "--steps", "8", "--repeats", "1",
          "--json", "{json}"), samples=1),
    # Not in `headline` (#50, profiles/spec_decode.md): the verify step of K = 1, 2, 4, 8
    # drafts against a plain decode step, batch 1 and 8, with a proposer replaying the
    # target's own greedy tokens (every draft accepted: the speed-up's upper bound), and
    # the speed-ups the CPU's measured acceptance rates imply; the 1B then the 8B preset.
    Step("spec_decode", "spec_decode", 150, 420,
         (PY, "scripts/bench_spec_decode.py", "--mode", "verify-cost", "--model", "{model}",
          "--dtype", "{dtype}", "--device", "cuda", "--k", "1,2,4,8", "--batch-sizes", "1,8",
          "--context", "512", "--max-tokens", "96", "--acceptance", "0.5,0.7,0.9",
          "--json", "{json}"),
         (PY, "scripts/bench_spec_decode.py", "--mode", "verify-cost", "--model", "{model}",
          "--dtype", "{dtype}", "--device", "cpu", "--k", "1,2", "--batch-sizes", "1,2",
          "--context", "16", "--max-tokens", "8", "--json", "{json}"), samples=1),
    Step("spec_decode_8b", "spec_decode", 240, 540,
         (PY, "scripts/bench_spec_decode.py", "--mode", "verify-cost", "--model",
          "random:llama-3.1-8b", "--dtype", "{dtype}", "--device", "cuda", "--k", "1,2,4,8",
          "--batch-sizes", "1,8", "--context", "512", "--max-tokens", "96",
          "--gpu-memory-utilization", "0.8", "--acceptance", "0.5,0.7,0.9",
          "--json", "{json}"),
         (PY, "scripts/bench_spec_decode.py", "--help"), samples=1),
    # Not in `headline` (#52): the fused MoE layer against a per-expert loop and a dense
    # bmm at 1, 64 and 512 tokens (the presets' layer shapes); then batch-1..256 decode
    # of random:qwen3-30b-a3b in bf16 against the active-weight roofline (61 GB of
    # random weights: an 80 GB GPU holds them).
    Step("moe", "moe", 90, 300,
         (PY, "scripts/bench_moe.py", "--tokens", "1", "64", "512", "--json", "{json}"),
         (PY, "scripts/bench_moe.py", "--help"), extract="moe"),
    Step("moe_decode", "moe", 200, 480,
         (PY, "-m", "llmfast", "bench", "--model", "random:qwen3-30b-a3b", "--dtype",
          "bfloat16", "--sizes", "1,2,4,8,16,32,64,128,256", "--context", "128",
          "--steps", "32", "--json", "{json}"),
         _BENCH + ("--device", "cpu", "--sizes", "1,2", "--context", "16", "--steps", "4",
                   "--json", "{json}"),
         samples=1, extract="sweep"),
)}


# #49 (profiles/decode-bw.md): batch-1 decode against the HBM limit, 1B and 8B, bf16 and
# fp8, cuBLAS (--gemv cublas) vs the Triton GEMV (gemv: --gemv triton, the heuristic's
# configs; table: --gemv auto after `gemv_tune` installed a shipped table in the device's
# copy; auto: --gemv auto after `gemv_startup` left its start-up timings in the cache
# dir, or timing at the bench's own start). One sample of a 32-step sweep each (the
# sweep's own median over steps): the device's minutes are few.
_BW_MODELS = {"1b": "random:llama-3.2-1b", "8b": "random:llama-3.1-8b"}
# fused: the decoder layers' projections with their norms, SiLU-and-mul and residual
# adds (models/fused_layer.py), on the heuristic's configs.
_BW_GEMV = {"cublas": ("--gemv", "cublas"), "gemv": ("--gemv", "triton"),
            "table": ("--gemv", "auto"), "auto": ("--gemv", "auto"),
            "fused": ("--gemv", "triton", "--gemv-fuse")}


def _bw_step(size: str, fp8: bool, gemv: str) -> Step:
    quant = ("--quantization", "fp8") if fp8 else ()
    est, limit = (90, 240) if size == "1b" else (150, 360)
    return Step(f"bw_{size}{'_fp8' if fp8 else ''}_{gemv}", "decode-bw", est, limit,
                (PY, "-m", "llmfast", "bench", "--model", _BW_MODELS[size], "--dtype",
                 "bfloat16", *quant, *_BW_GEMV[gemv], "--sizes", "1..512", "--context",
                 "128", "--steps", "32", "--json", "{json}"),
                _BENCH + ("--device", "cpu", *quant, *_BW_GEMV[gemv], "--sizes", "1,2",
                          "--context", "16", "--steps", "4", "--json", "{json}"),
                samples=1, extract="sweep")


def _kinds_step(size: str, fp8: bool, gemv: str) -> Step:
    """The per-layer-kind table of the full-graph step at batch 1 and 64 (bench_modes
    --kinds-json: bytes, µs and % of HBM per qkv, o, gate_up, down, lm_head, attention,
    other), its raw JSON and markdown under $OUT."""
    quant = ("--quantization", "fp8") if fp8 else ()
    name = f"kinds_{size}{'_fp8' if fp8 else ''}_{gemv}"
    return Step(name, "decode-bw", 90 if size == "1b" else 150, 300,
                (PY, "scripts/bench_modes.py", "--model", _BW_MODELS[size], "--dtype",
                 "bfloat16", *quant, *_BW_GEMV[gemv], "--batch-sizes", "1,64", "--modes",
                 "full,linears", "--iters", "30", "--json", "{json}", "--kinds-json",
                 "{out}/" + name + ".json"),
                (PY, "scripts/bench_modes.py", "--model", "{model}", "--dtype", "{dtype}",
                 "--device", "cpu", *quant, *_BW_GEMV[gemv], "--batch-sizes", "1", "--modes",
                 "eager,linears", "--iters", "2", "--warmup", "1", "--max-model-len", "256",
                 "--json", "{json}", "--kinds-json", "{out}/" + name + ".json"),
                samples=1, extract="modes")


def _gemv_step(fp8: bool, tune: bool) -> Step:
    """bench_gemv.py at both presets' shapes: cuBLAS vs the heuristic's GEMV, or with
    tuning every candidate, the winners installed into the device copy's shipped table
    (for the `_table` steps after it) and copied to $OUT for committing."""
    kind = "fp8" if fp8 else "bf16"
    flags = ("--tune", "--install", "--copy-to", f"{{out}}/gemv_table_{kind}.json",
             "--rows", "1,4,16") if tune else ("--rows", "1,2,4,8,16")
    return Step(f"gemv_{'tune' if tune else 'shapes'}_{kind}", "decode-bw",
                200 if tune else 60, 480 if tune else 200,
                (PY, "scripts/bench_gemv.py", "--models",
                 ",".join(_BW_MODELS.values()), *(("--fp8",) if fp8 else ()), *flags,
                 "--json", "{json}"),
                (PY, "scripts/bench_gemv.py", "--help"), samples=1)


# The start-up measurement (--gemv auto) of both presets in bf16 and fp8, every shape
# timed whatever is shipped, into the cache dir the `_auto` sweeps then read (same
# machine) and as a launch table under $OUT: `gemv_startup_table.json`, shipped by
# copying it to llmfast/kernels/gemv/tables/<gpu slug>.json (profiles/decode-bw.md).
# Estimate: ~40 Triton variants a preset and dtype compiled in 8 threads (~5 s), ~125
# graph timings a preset (~20 s), four presets built with random weights.
_STARTUP = Step("gemv_startup", "decode-bw", 180, 480,
                (PY, "scripts/bench_gemv.py", "--startup", "--models",
                 ",".join(_BW_MODELS.values()), "--quantizations", "none,fp8",
                 "--rows", "1,2,4,8,16", "--copy-to", "{out}/gemv_startup_table.json",
                 "--json", "{json}"),
                (PY, "scripts/bench_gemv.py", "--help"), samples=1)
STEPS[_STARTUP.name] = _STARTUP
# The GEMV's own GPU tests: each kernel and fusion against float64 at the presets'
# shapes, split-K in a CUDA graph, the op under Inductor, the start-up measurement with
# its real timer (tests/test_gemv_gpu.py; ~40 variants compiled).
_GEMV_TESTS = Step("gemv_tests", "decode-bw", 120, 300,
                   (PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rA",
                    "tests/test_gemv_gpu.py"),
                   (PY, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p",
                    "no:cacheprovider", "tests/test_gemv_gpu.py"), samples=1)
STEPS[_GEMV_TESTS.name] = _GEMV_TESTS

for _step in ([_bw_step(size, fp8, gemv) for size in _BW_MODELS for fp8 in (False, True)
               for gemv in _BW_GEMV]
              + [_kinds_step(size, fp8, gemv) for size in _BW_MODELS for fp8 in (False, True)
                 for gemv in ("cublas", "gemv", "fused", "auto")]
              + [_gemv_step(fp8, tune) for fp8 in (False, True) for tune in (False, True)]):
    STEPS[_step.name] = _step

GROUPS = {"headline": ("sweep", "modes", "throughput", "kernels", "startup", "serve", "tests"),
          "sliding": ("sliding_kernels", "sliding_decode"),
          # #49 in the order of its worth, for a lease of 15 minutes in all: the first
          # call (~560 s of estimates, the machine's start besides) measures what ships
          # (--gemv auto's table for 1B and 8B, bf16 and fp8) and the three bars with it
          # (1B, 8B % of HBM at batch 1, fp8 over bf16); the budget skips what does not
          # fit, in this order. The second, if time is left: the GEMV's GPU tests, the 8B
          # cuBLAS baseline, the per-kind tables of what ships.
          "decode_bw_first": ("gemv_startup", "bw_1b_cublas", "bw_1b_auto", "bw_8b_auto",
                              "bw_8b_fp8_auto"),
          "decode_bw_second": ("gemv_tests", "bw_8b_cublas", "kinds_1b_auto", "kinds_8b_auto",
                               "kinds_8b_fp8_auto"),
          # Further #49 steps (estimates: nothing of it has run on a GPU yet).
          "decode_bw": ("kinds_1b_cublas", "bw_1b_cublas", "bw_1b_gemv", "gemv_shapes_bf16",
                        "kinds_1b_gemv"),
          "decode_bw_8b": ("bw_8b_cublas", "bw_8b_gemv", "bw_8b_fp8_gemv"),
          "decode_bw_kinds_8b": ("kinds_8b_cublas", "kinds_8b_gemv", "kinds_8b_fp8_gemv"),
          "decode_bw_fused": ("bw_1b_fused", "kinds_1b_fused", "bw_8b_fused",
                              "bw_8b_fp8_fused"),
          # The tables are installed into the device copy: the `_table` sweeps that read
          # them run in the same call.
          "tune_bf16": ("gemv_tune_bf16", "bw_1b_table", "bw_8b_table"),
          "tune_fp8": ("gemv_tune_fp8", "bw_8b_fp8_table", "bw_8b_fp8_cublas"),
          # The cuBLAS sweeps before the `_auto` ones: the cross bars judge against them.
          "tune_startup": ("gemv_startup", "bw_1b_cublas", "bw_1b_auto"),
          "tune_startup_8b": ("bw_8b_cublas", "bw_8b_auto", "bw_8b_fp8_auto"),
          "spec": ("spec_decode", "spec_decode_8b")}


# ------------------------------------------------------------------ the tree stamp


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout


def tree_stamp() -> dict:
    """HEAD, whether the tree differs from it, and a hash of the difference (tracked
    changes and untracked files' names), so two dirty trees can be told apart."""
    diff = _git("diff", "HEAD")
    untracked = _git("ls-files", "--others", "--exclude-standard")
    dirty = bool(diff or untracked)
    return dict(commit=_git("rev-parse", "HEAD").strip(), dirty=dirty,
                diff_sha256=hashlib.sha256((diff + untracked).encode()).hexdigest()
                if dirty else None,
                diff_stat=_git("diff", "HEAD", "--shortstat").strip(),
                untracked=untracked.split(), stamped=datetime.datetime.now(
                    datetime.timezone.utc).isoformat(timespec="seconds"))


def read_stamp(dry_run: bool) -> dict:
    if STAMP.is_file():
        return {**json.loads(STAMP.read_text()), "source": ".tree-stamp"}
    try:
        stamp = tree_stamp()
    except (OSError, subprocess.CalledProcessError):
        return dict(commit="unknown", source="no .tree-stamp and no git")
    # Here (a dry run) git is this tree's; on the device its metadata can lag the copy.
    return {**stamp, "source": "git here" if dry_run else
            "device copy's git (may lag: run `gpu_check.py stamp` and carry .tree-stamp)"}


def environment(dry_run: bool) -> dict:
    def out(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    versions = out([PY, "-c", "import torch, triton; print(torch.__version__, "
                    "torch.version.cuda, triton.__version__)"]).split()
    return dict(device=out(["nvidia-smi", "-L"]) or ("cpu (dry run)" if dry_run else "none"),
                torch=versions[0] if versions else None,
                cuda=versions[1] if len(versions) > 1 else None,
                triton=versions[2] if len(versions) > 2 else None,
                host=os.uname().nodename, cpus=os.cpu_count())


# ------------------------------------------------------------------ running steps


def _argv(template: tuple[str, ...], json_path: Path, out: Path, dry: bool) -> list[str]:
    model, dtype = (DRY_MODEL, DRY_DTYPE) if dry else (GPU_MODEL, GPU_DTYPE)
    return [a.format(json=json_path, out=out, model=model, dtype=dtype) for a in template]


def run(argv: list[str], log: Path, limit: float, env: dict) -> tuple[int, float]:
    """Runs argv with its output into log (and ours); its process group is killed after
    `limit` s (rc 124), whether or not it prints meanwhile."""
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, **env},
                                start_new_session=True)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(max(1.0, limit), kill)
        timer.start()
        try:
            for line in proc.stdout:
                f.write(line)
                sys.stdout.write(line)
            rc = proc.wait()
        finally:
            timer.cancel()
    return (124 if killed.is_set() else rc), time.monotonic() - t0


_FLAG = re.compile(r"^--[a-z][a-z0-9-]*$")


def missing_flags(template: tuple[str, ...]) -> list[str]:
    """The flags of a command its program's help does not list (llmfast's CLI lists
    them all under --help-all, a script under --help)."""
    argv = _argv(template, Path("x.json"), Path("."), dry=False)
    flags = [a for a in argv if _FLAG.match(a)]
    program = argv[:argv.index(flags[0])] if flags else argv
    program += ["--help-all" if program[1:3] == ["-m", "llmfast"] else "--help"]
    text = subprocess.run(program, cwd=REPO, capture_output=True, text=True,
                          timeout=120).stdout
    listed = set(re.findall(r"--[a-z][a-z0-9-]*", text))
    return [f for f in dict.fromkeys(flags) if f not in listed]


def run_step(step: Step, out: Path, left: float, dry: bool) -> dict:
    limit = left if step.limit_s == 0 else min(step.limit_s, left)
    env = {"LLMFAST_CACHE": os.environ.get("LLMFAST_CACHE", "/tmp/llmfast_cache"),
           # No tuning inside the benchmarks unless a step asks (startup: as a user).
           "LLMFAST_ATTENTION_TUNING": os.environ.get("LLMFAST_ATTENTION_TUNING", "off"),
           **step.env}
    template = step.dry if dry else step.gpu
    if step.name == "tests" and os.environ.get("GPU_CHECK_TESTS"):
        template += tuple(os.environ["GPU_CHECK_TESTS"].split())
    record: dict = dict(topic=step.topic, runs=[], env=env)
    samples: list = []
    collected: list[str] = []
    if step.name == "tests" and not dry:  # which files exist, to name those not reached
        t0 = time.monotonic()
        collected = subprocess.run(list(step.dry) + list(template[len(step.gpu):]), cwd=REPO,
                                   capture_output=True, text=True, env={**os.environ, **env},
                                   timeout=limit).stdout.splitlines()
        limit -= time.monotonic() - t0
    for i in range(1 if dry and step.extract is None else step.samples):
        json_path = out / f"{step.name}-{i + 1}.json"
        argv = _argv(template, json_path, out, dry)
        print(f"=== {step.name} sample {i + 1}/{step.samples} (limit {limit:.0f} s): "
              f"{shlex.join(argv)}", flush=True)
        rc, secs = run(argv, out / f"{step.name}-{i + 1}.log", limit, env)
        record["runs"].append(dict(command=shlex.join(argv), rc=rc, seconds=round(secs, 1),
                                   log=f"{step.name}-{i + 1}.log"))
        limit -= secs
        if rc == 0 and step.extract and json_path.is_file():
            if not (dry and step.name == "kernels"):  # --help wrote no JSON
                samples += gpu_verdicts.figures(step.extract, json.loads(json_path.read_text()))
        if rc != 0 or limit <= 0:
            break
    rcs = [r["rc"] for r in record["runs"]]
    record["status"] = ("ok" if all(rc == 0 for rc in rcs) else
                        "timed out" if 124 in rcs else f"failed rc={rcs[-1]}")
    summary = gpu_verdicts.summarize([f for f, _ in samples])
    record["figures"] = summary
    verdicts = gpu_verdicts.judge(step.name, summary, gpu_verdicts.merge_checks(
        [c for _, c in samples])) if step.extract else []
    if step.name == "tests":
        log = (out / "tests-1.log").read_text(errors="replace")
        record["outcome"] = gpu_verdicts.pytest_outcome(log, log.splitlines() if dry
                                                        else collected)
        verdicts = gpu_verdicts.judge_tests(record["outcome"], dry)
    if dry and step.name != "tests":  # the GPU command's own flags, which the CPU run
        # (other sizes, or only --help where it needs CUDA) may not pass
        missing = missing_flags(step.gpu)
        flags = dict(verdict="PASS" if not missing else "FAIL",
                     text=f"{step.name}: the GPU command's flags exist"
                          + (f" (not: {' '.join(missing)})" if missing else ""))
        verdicts = [flags] if step.dry[-1] == "--help" else verdicts + [flags]
    if record["status"] != "ok":
        verdicts.insert(0, dict(verdict="FAIL", text=f"{step.name}: {record['status']} "
                                                     f"(see {record['runs'][-1]['log']})"))
    if dry:
        for v in verdicts:
            v["verdict"] = "DRY-" + v["verdict"] if v["verdict"] in ("PASS", "FAIL") else \
                v["verdict"]
    record["verdicts"] = verdicts
    return record


def check(names: list[str], out: Path, budget: float, dry: bool) -> dict:
    result = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=shlex.join([PY, "scripts/gpu_check.py", *sys.argv[1:]]),
        tree=read_stamp(dry), environment=environment(dry), dry_run=dry,
        model=DRY_MODEL if dry else GPU_MODEL, dtype=DRY_DTYPE if dry else GPU_DTYPE,
        budget_s=budget, steps={})
    start = time.monotonic()
    for name in names:
        step = STEPS[name]
        left = budget - (time.monotonic() - start)
        if left < step.est_s:
            result["steps"][name] = dict(topic=step.topic, status=f"skipped: needs ~"
                                         f"{step.est_s} s, {left:.0f} s left", verdicts=[
                                             dict(verdict="SKIPPED", text=f"{name}: not run "
                                                  f"(needs ~{step.est_s} s)")])
            continue
        result["steps"][name] = run_step(step, out, left, dry)
        cross = gpu_verdicts.judge_cross(name, result["steps"])
        if dry:
            for v in cross:
                v["verdict"] = "DRY-" + v["verdict"] if v["verdict"] in ("PASS", "FAIL") \
                    else v["verdict"]
        result["steps"][name]["verdicts"] += cross
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))  # as it goes
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def pack(out: Path, keep: set[str]) -> None:
    """Everything but `keep` into results.tar.gz (the device tool returns 8 files)."""
    items = [p for p in sorted(out.iterdir()) if p.name not in keep | {"results.tar.gz"}]
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        for p in items:
            tar.add(p, arcname=p.name)
    for p in items:
        if p.is_dir():
            subprocess.run(["rm", "-rf", str(p)], check=False)
        else:
            p.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", nargs="+", help="stamp, or step names / groups: "
                    + ", ".join([*GROUPS, *STEPS]))
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get(
        "GPU_CHECK_DRY_RUN") == "1")
    ap.add_argument("--out", type=Path, default=os.environ.get("OUT"))
    ap.add_argument("--budget", type=float, default=float(os.environ.get(
        "GPU_CHECK_BUDGET_S", 560)), help="seconds for the whole call (default 560)")
    ap.add_argument("--no-pack", action="store_true")
    args = ap.parse_args()
    if args.steps == ["stamp"]:
        STAMP.write_text(json.dumps(tree_stamp(), indent=1) + "\n")
        print(STAMP.read_text(), end="")
        return 0
    names = [n for s in args.steps for n in GROUPS.get(s, (s,))]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; steps: {', '.join([*GROUPS, *STEPS])}")
    out = args.out or Path("/tmp/llmfast_gpu_check" + ("_dry" if args.dry_run else ""))
    out.mkdir(parents=True, exist_ok=True)
    result = check(names, out, args.budget, args.dry_run)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(gpu_verdicts.report(result))
    print("\n" + gpu_verdicts.verdict_lines(result))
    if not (args.no_pack or args.dry_run):
        pack(out, {"gpu_check.json", "report.md", "kernels.md"})
    # A dry run fails only when a step failed or a GPU-only command lacks a flag (CPU
    # figures miss the bars).
    if args.dry_run:
        failed = any(not s["status"].startswith(("ok", "skipped"))
                     or any("flags exist" in v["text"] and v["verdict"] == "DRY-FAIL"
                            for v in s.get("verdicts", []))
                     for s in result["steps"].values())
    else:
        failed = any(v["verdict"] in ("FAIL", "MISSING") for s in result["steps"].values()
                     for v in s.get("verdicts", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
