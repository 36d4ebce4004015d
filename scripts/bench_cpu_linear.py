#!/usr/bin/env python3
"""CPU projections: F.linear (MKL) vs the row split and the oneDNN prepacked weights of
`llmfast/kernels/cpu/linear.py`.

Every projection of a model preset (qkv, o, gate_up, down per layer, and lm_head) at a
few token counts. Each layer gets its own weight copy, as in a real model, so weights
stream from DRAM instead of sitting in cache. Medians over --iters, side by side.

    python scripts/bench_cpu_linear.py --model random:smollm2-135m --tokens 1,8,32,256,2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmfast.bench.stats import median_call_ms
from llmfast.kernels.cpu.linear import (
    num_row_blocks,
    pack_weight,
    packed_linear,
    row_split_linear,
)
from llmfast.models.sources.model_source import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--tokens", default="1,2,4,8,32,128,512")
    parser.add_argument("--layers", type=int, default=0, help="weight copies (0: the model's)")
    parser.add_argument("--iters", type=int, default=7)
    args = parser.parse_args()
    cfg = resolve_model(args.model).config
    layers = args.layers or cfg.num_hidden_layers
    shapes = {
        "qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, layers),
        "o": (cfg.hidden_size, cfg.q_size, layers),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size, layers),
        "down": (cfg.hidden_size, cfg.intermediate_size, layers),
        "lm_head": (cfg.vocab_size, cfg.hidden_size, 1),
    }
    print(f"{args.model}, float32, {torch.get_num_threads()} threads, ms per step "
          f"(all layers), median of {args.iters}")
    print(f"{'proj':>8} {'tokens':>6} {'F.linear':>10} {'row split':>10} {'x':>6} "
          f"{'oneDNN':>10} {'x':>6}")
    totals: dict[int, list[float]] = {}
    for name, (rows, cols, copies) in shapes.items():
        weights = [torch.randn(rows, cols) for _ in range(copies)]
        blocks = num_row_blocks(rows)
        packed = [pack_weight(w) for w in weights]
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, cols)
            base = median_call_ms(lambda: [F.linear(x, w) for w in weights], args.iters)
            split = median_call_ms(lambda: [row_split_linear(x, w, blocks) for w in weights], args.iters)
            dnn = median_call_ms(lambda: [packed_linear(x, p, None) for p in packed], args.iters)
            total = totals.setdefault(tokens, [0.0, 0.0, 0.0])
            for i, value in enumerate((base, split, dnn)):
                total[i] += value
            print(f"{name:>8} {tokens:>6} {base:>10.2f} {split:>10.2f} {base / split:>6.2f} "
                  f"{dnn:>10.2f} {base / dnn:>6.2f}")
    for tokens, (base, split, dnn) in totals.items():
        print(f"{'all':>8} {tokens:>6} {base:>10.2f} {split:>10.2f} {base / split:>6.2f} "
              f"{dnn:>10.2f} {base / dnn:>6.2f}")


if __name__ == "__main__":
    main()
