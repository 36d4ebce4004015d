"""Prefill of the packed GGUF path: the int4 kernel against dequantize + float32 GEMM
(kernels/cpu/int4_linear.py's DEQUANTIZE_MIN_TOKENS), and the float32 model, in one
process, alternating round by round (a shared machine's load falls on all alike); each
round a fresh prompt (no prefix-cache hits) of each length, one output token.

    python scripts/bench_cpu_quant_prefill.py --lengths 32,64,128,512 --rounds 5 \\
        --out profiles/cpu/cpu-quant-prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="32,64,128,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    import torch

    from llmfast import LLM, SamplingParams
    from llmfast.kernels.cpu import int4_linear

    limit = max(lengths) + 8
    llms = {"gguf": LLM(quantization="gguf", max_model_len=limit),
            "none": LLM(quantization="none", max_model_len=limit)}
    variants = {"gguf kernel only": ("gguf", 10**9),
                "gguf dequantize": ("gguf", int4_linear.DEQUANTIZE_MIN_TOKENS),
                "none": ("none", None)}
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times: dict[str, dict[int, list[float]]] = {v: {n: [] for n in lengths} for v in variants}
    default_threshold = int4_linear.DEQUANTIZE_MIN_TOKENS
    start = 1000
    for round_ in range(args.rounds + 1):  # round 0: warm-up
        for variant, (llm, threshold) in variants.items():
            if threshold is not None:
                int4_linear.DEQUANTIZE_MIN_TOKENS = threshold
            for n in lengths:
                prompt = list(range(start, start + n))
                start += n
                t0 = time.perf_counter()
                llms[llm].generate({"prompt_token_ids": prompt}, one)
                if round_:
                    times[variant][n].append(time.perf_counter() - t0)
    int4_linear.DEQUANTIZE_MIN_TOKENS = default_threshold
    report = {
        "command": " ".join(sys.argv), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "loadavg_end": os.getloadavg(),
        "prefill_tok_s": {v: {n: n / statistics.median(ts) for n, ts in per.items()}
                          for v, per in times.items()},
        "times_s": times,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["prefill_tok_s"], indent=2))


if __name__ == "__main__":
    main()
