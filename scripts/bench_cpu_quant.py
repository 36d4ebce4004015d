"""Packed GGUF weights against the dequantized float32 path on the CPU, same run: the
default model at batch 1, `llmfast bench` in fresh processes, the two variants
interleaved for --rounds rounds (their weight bytes, start-up, step latency); then both
in one process, their decodes alternating for --interleaved-rounds rounds, so that a
shared machine's load falls on both alike; medians, ratios and every run to --out.
With --llama-bench PATH, llama.cpp's `llama-bench` on the same GGUF file with the same
thread count joins each round (decode of 32 tokens after a 128-token prompt, as ours).

    python scripts/bench_cpu_quant.py --rounds 3 --out profiles/cpu/cpu-quant-smollm2.json \
        [--llama-bench /path/to/llama-bench]

With --prefill, prompts instead: the packed model with the int4 kernel at every length
against the dequantized float32 GEMM at every length (what DEQUANTIZE_MIN_TOKENS in
kernels/cpu/int4_linear.py chooses between), optionally the prefill path as git
revision --before had it, and the float32 model, in one process, side by side at each
length in an order rotated each round (--rounds of them after a warm-up); each round a
fresh prompt (no prefix-cache hits) of each of --lengths, one output token. Wall time
and the process's CPU time.

    python scripts/bench_cpu_quant.py --prefill --lengths 16,32,40,48,64,96,128,512 --rounds 5 \
        --before d321b96 --out profiles/cpu/cpu-quant-prefill.json

With --unpack, that path's parts per projection shape (a micro-benchmark, in turn round
by round): the weight's unpack alone, unpack + GEMM, --before's, the int4 kernel and the
float32 GEMM alone, at --lengths token counts.

    python scripts/bench_cpu_quant.py --unpack --lengths 16,32,64,128 --rounds 30 \
        --threads 1 --before d321b96 --out profiles/cpu/cpu-int4-unpack.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = ("gguf", "none")
# A variant: `--quantization` value, "+compile" for torch.compile (eager otherwise).
COMPILED = "+compile"


def engine_kwargs(variant: str) -> dict:
    quantization, compiled = variant.removesuffix(COMPILED), variant.endswith(COMPILED)
    return {"quantization": quantization, "compile": compiled}


def cli_flags(variant: str) -> list[str]:
    kwargs = engine_kwargs(variant)
    return ["--quantization", kwargs["quantization"],
            "--compile" if kwargs["compile"] else "--no-compile"]


def llmfast_run(variant: str, steps: int, context: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run([sys.executable, "-m", "llmfast", "bench", "--sizes", "1", "--steps",
                        str(steps), "--context", str(context), *cli_flags(variant),
                        "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
        data = json.loads(out.read_text())
    run = data["runs"]["default"]
    sweep = run["sweep"][0]
    return {
        "step_ms_p50": sweep["step_latency"]["median"] * 1e3,
        # Batch 1: one token per step, at the median step's latency (the sweep's own
        # decode_tokens_per_s is total tokens over total time, outliers included).
        "decode_tok_s": 1e3 / (sweep["step_latency"]["median"] * 1e3),
        "sweep_decode_tok_s": sweep["decode_tokens_per_s"],
        "weight_bytes": sweep["weight_bytes"],
        "threads": data["environment"]["cpu_threads"],
        "load": run["startup"]["load"],
        "loadavg_1m": os.getloadavg()[0],
    }


def interleaved_decode(variants: list[str], rounds: int, steps: int, context: int) -> dict:
    """Both variants in this one process, their decodes alternating round by round, so
    that a shared machine's load falls on both alike: per round and variant, the time of
    `steps` decode tokens = a (steps + 1)-token generation less a 1-token one (the same
    prompt, prefix-cached after the first round)."""
    import time

    import torch

    from llmfast import LLM, SamplingParams

    prompt = list(range(1000, 1000 + context))
    llms = {v: LLM(**engine_kwargs(v), max_model_len=context + steps + 8) for v in variants}
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for llm in llms.values():  # warm-up
        llm.generate({"prompt_token_ids": prompt}, many)
    for _ in range(rounds):
        for variant, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt}, one)
            t1 = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt}, many)
            t2 = time.perf_counter()
            times[variant].append(((t2 - t1) - (t1 - t0)) / steps)
    return {v: {"step_ms": [t * 1e3 for t in ts],
                "step_ms_median": statistics.median(ts) * 1e3,
                "decode_tok_s": 1 / statistics.median(ts),
                "threads": torch.get_num_threads()} for v, ts in times.items()}


def llama_bench_run(binary: str, gguf: Path, threads: int, steps: int, context: int) -> dict:
    result = subprocess.run([binary, "-m", str(gguf), "-t", str(threads), "-p", str(context),
                             "-n", str(steps), "-r", "1", "-o", "json"],
                            check=True, capture_output=True, text=True)
    rows = json.loads(result.stdout)
    tg = next(r for r in rows if r["n_gen"] > 0)
    return {"decode_tok_s": tg["avg_ts"], "threads": threads,
            "loadavg_1m": os.getloadavg()[0]}


def revision_prefill_impl(rev: str) -> dict:
    """kernels/cpu/int4_linear.py's prefill path as git revision `rev` had it: its
    `int4_linear_impl` and `dequantize_packed` (the op and class definitions left out,
    which cannot be defined twice) and its constants (DEQUANTIZE_MIN_TOKENS), in a
    namespace: the "before" of a change to that path, run in this process beside the
    current code."""
    import ast

    import torch

    from llmfast.kernels.cpu import int4_linear

    source = subprocess.run(["git", "show", f"{rev}:llmfast/kernels/cpu/int4_linear.py"],
                            check=True, capture_output=True, text=True).stdout
    tree = ast.parse(source)
    wanted = ("dequantize_packed", "int4_linear_impl")
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in
            wanted]
    if len(body) != len(wanted):  # the unpack moved to int4_dequant.py after d321b96
        raise SystemExit(f"--before {rev}: its int4_linear.py lacks {' or '.join(wanted)}; "
                         "give a revision from before the scratch unpack, e.g. d321b96")
    body += [node for node in tree.body  # its constants
             if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)]
    namespace = {"torch": torch, "GROUP": int4_linear.GROUP, "ACT_DTYPE": int4_linear.ACT_DTYPE,
                 "_INT4_MM": int4_linear._INT4_MM, "packed_layout_known": lambda: True}
    exec(compile(ast.Module(body=body, type_ignores=[]), f"{rev}:int4_linear.py", "exec"),
         namespace)
    return namespace


def unpack_rounds(rounds: int, before: str | None, token_counts: list[int]) -> dict:
    """Per projection shape of the default model (Q4_1 codes, random): the prefill path's
    unpack alone and with its GEMM, against `before`'s and the int4 kernel's, and the
    float32 GEMM alone, every candidate once a round in turn; medians and minima in ms."""
    import time

    import numpy as np
    import torch

    from llmfast.kernels.cpu import int4_dequant
    from llmfast.kernels.cpu.affine_codes import AffineCodes
    from llmfast.kernels.cpu.int4_linear import ACT_DTYPE, GROUP, Int4Linear

    old = revision_prefill_impl(before) if before else None
    rng = np.random.default_rng(0)
    results = {}
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:  # qkv, o, gate_up, down
        layer = Int4Linear.from_codes(AffineCodes(
            rng.integers(0, 16, (n, k), dtype=np.uint8),
            rng.normal(0, 0.01, (n, k // 32)).astype(np.float32),
            rng.normal(0, 0.01, (n, k // 32)).astype(np.float32), 4, 32))
        packed, sz = layer.weight_packed, layer.scales_and_zeros
        weight = int4_dequant.dequantize_packed(packed, sz, None, k, n)
        scale, offset = int4_dequant.affine_maps(sz)
        scratch = int4_dequant._Scratch().buffers(n * k)
        cases = {"unpack": lambda: int4_dequant.unpack_rows(packed, scale, offset, 0, n,
                                                            *scratch)}
        if old:
            cases[f"unpack at {before}"] = lambda: old["dequantize_packed"](packed, sz, None,
                                                                            k, n)
        for m in token_counts:
            x = torch.randn(m, k)
            cases[f"{m}: unpack + GEMM"] = lambda x=x: int4_dequant.dequantized_linear(
                x, packed, sz, None, False, n)
            if old:
                cases[f"{m}: at {before}"] = lambda x=x: torch.nn.functional.linear(
                    x, old["dequantize_packed"](packed, sz, None, k, n))
            cases[f"{m}: int4 kernel"] = lambda x=x: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(ACT_DTYPE), packed, GROUP, sz).float()
            cases[f"{m}: float32 GEMM"] = lambda x=x: torch.nn.functional.linear(x, weight)
        times = {case: [] for case in cases}
        for round_ in range(rounds + 1):  # round 0: warm-up
            for case, fn in cases.items():
                start = time.perf_counter()
                fn()
                if round_:
                    times[case].append((time.perf_counter() - start) * 1e3)
        results[f"{n}x{k}"] = {case: {"median_ms": statistics.median(ts), "min_ms": min(ts)}
                               for case, ts in times.items()}
    return {"threads": torch.get_num_threads(), "unpack_ms": results}


def prefill_rounds(lengths: list[int], rounds: int, before: str | None) -> dict:
    """Prefill tok/s per variant and prompt length (module doc), medians of `rounds`:
    the packed model with the int4 kernel at every length, with the dequantized GEMM at
    every length, as the revision `before` had its prefill path (optional), and the
    float32 model."""
    import time

    import torch

    from llmfast import LLM, SamplingParams
    from llmfast.kernels.cpu import int4_linear

    limit = max(lengths) + 8
    llms = {"gguf": LLM(quantization="gguf", max_model_len=limit),
            "none": LLM(quantization="none", max_model_len=limit)}
    current = (int4_linear.int4_linear_impl, int4_linear.DEQUANTIZE_MIN_TOKENS)
    # variant -> (model, (prefill impl, threshold) or None: the float32 model)
    variants = {"gguf kernel only": ("gguf", (current[0], 10**9)),
                # From the shortest prompt: every prompt's layers, not the lm_head's one row.
                "gguf dequantize": ("gguf", (current[0], min(lengths)))}
    if before:
        old = revision_prefill_impl(before)
        variants[f"gguf at {before}"] = ("gguf", (old["int4_linear_impl"],
                                                  old["DEQUANTIZE_MIN_TOKENS"]))
    variants["none"] = ("none", None)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times: dict[str, dict[int, list[float]]] = {v: {n: [] for n in lengths} for v in variants}
    cpu_times: dict[str, dict[int, list[float]]] = {v: {n: [] for n in lengths}
                                                    for v in variants}
    names = list(variants)
    start = 1000
    try:
        for round_ in range(rounds + 1):  # round 0: warm-up
            for n in lengths:
                # The variants side by side at each length, their order rotated each
                # round: a shared machine's load shifts within seconds.
                for i in range(len(names)):
                    variant = names[(i + round_) % len(names)]
                    llm, path = variants[variant]
                    if path is not None:
                        int4_linear.int4_linear_impl, int4_linear.DEQUANTIZE_MIN_TOKENS = path
                    prompt = list(range(start, start + n))
                    start += n
                    t0, c0 = time.perf_counter(), time.process_time()
                    llms[llm].generate({"prompt_token_ids": prompt}, one)
                    if round_:
                        times[variant][n].append(time.perf_counter() - t0)
                        cpu_times[variant][n].append(time.process_time() - c0)
    finally:
        int4_linear.int4_linear_impl, int4_linear.DEQUANTIZE_MIN_TOKENS = current
    return {
        "threads": torch.get_num_threads(),
        "dequantize_min_tokens": current[1],
        "before_dequantize_min_tokens": variants[f"gguf at {before}"][1][1] if before else None,
        "prefill_tok_s": {v: {n: n / statistics.median(ts) for n, ts in per.items()}
                          for v, per in times.items()},
        # Per second of this process's CPU time (all its threads): what a shared
        # machine's waits for a core leave out.
        "prefill_tok_per_cpu_s": {v: {n: n / statistics.median(ts) for n, ts in per.items()}
                                  for v, per in cpu_times.items()},
        "times_s": times,
        "cpu_times_s": cpu_times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--interleaved-rounds", type=int, default=9,
                        help="rounds of the in-process interleaved decode timing")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated --quantization values, each optionally with "
                        f"'{COMPILED}' (torch.compile); the first two make the ratios")
    parser.add_argument("--prefill", action="store_true",
                        help="time prompts (int4 kernel, dequantize + GEMM, float32) instead "
                        "of decode; --rounds then counts prefill rounds")
    parser.add_argument("--lengths", default="32,64,128,512",
                        help="--prefill: comma-separated prompt lengths (--unpack: token "
                        "counts of the GEMMs)")
    parser.add_argument("--unpack", action="store_true",
                        help="time the prefill path's weight unpack per projection shape "
                        "(micro-benchmark) instead; --rounds then counts its rounds")
    parser.add_argument("--threads", type=int, default=None, help="--unpack: torch threads")
    parser.add_argument("--before", default=None,
                        help="--prefill, --unpack: also time the packed prefill path as "
                        "git revision BEFORE had it (e.g. main), in this process")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.unpack:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        report = {"command": " ".join(sys.argv), "torch": torch.__version__,
                  **unpack_rounds(args.rounds, args.before,
                                  [int(n) for n in args.lengths.split(",")]),
                  "loadavg_end": os.getloadavg()}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        for shape, cases in report["unpack_ms"].items():
            print(shape, "  ".join(f"{c} {t['median_ms']:.2f}/{t['min_ms']:.2f}"
                                   for c, t in cases.items()))
        return
    if args.prefill:
        import torch

        report = {"command": " ".join(sys.argv), "torch": torch.__version__,
                  **prefill_rounds([int(n) for n in args.lengths.split(",")], args.rounds,
                                    args.before),
                  "loadavg_end": os.getloadavg()}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        for key in ("prefill_tok_s", "prefill_tok_per_cpu_s"):
            print(key, json.dumps(report[key], indent=2))
        return

    from llmfast.models.sources.default_model import default_model_gguf, ensure_default_model

    gguf = default_model_gguf(ensure_default_model())
    variants = args.variants.split(",")
    packed, base = variants[0], variants[1]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    if args.llama_bench:
        runs["llama.cpp"] = []
    for round_ in range(args.rounds):
        for variant in variants:
            runs[variant].append(llmfast_run(variant, args.steps, args.context))
            print(round_, variant, runs[variant][-1], file=sys.stderr)
        if args.llama_bench:
            threads = runs[packed][-1]["threads"]
            runs["llama.cpp"].append(llama_bench_run(args.llama_bench, gguf, threads,
                                                     args.steps, args.context))
            print(round_, "llama.cpp", runs["llama.cpp"][-1], file=sys.stderr)
    medians = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for v, rs in runs.items() if rs}
    ratios = {}
    if runs[packed]:
        ratios[f"decode_tok_s {packed} / {base}"] = (medians[packed]["decode_tok_s"]
                                                     / medians[base]["decode_tok_s"])
        ratios[f"weight_bytes {packed} / {base}"] = (medians[packed]["weight_bytes"]
                                                     / medians[base]["weight_bytes"])
    if args.llama_bench and runs[packed]:
        ratios[f"decode_tok_s {packed} / llama.cpp"] = (medians[packed]["decode_tok_s"]
                                                        / medians["llama.cpp"]["decode_tok_s"])
    interleaved = interleaved_decode(variants, args.interleaved_rounds, args.steps,
                                     args.context)
    for variant in variants[1:]:
        ratios[f"interleaved decode_tok_s {packed} / {variant}"] = (
            interleaved[packed]["decode_tok_s"] / interleaved[variant]["decode_tok_s"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    import torch

    report = {"commit": commit, "torch": torch.__version__, "gguf": gguf.name,
              "command": " ".join(sys.argv), "steps": args.steps, "context": args.context,
              "medians": medians, "ratios": ratios, "interleaved": interleaved,
              "runs": runs, "loadavg_end": os.getloadavg()}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"medians": medians, "ratios": ratios,
                      "interleaved": {v: {k: x for k, x in r.items() if k != "step_ms"}
                                      for v, r in interleaved.items()}}, indent=2))


if __name__ == "__main__":
    main()
