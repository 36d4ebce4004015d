#!/usr/bin/env python3
"""Tensor parallelism on CPU: model step time at TP=1 and TP=2, with the collectives'
share shown separately.

One step = the eager model forward over the step's tokens plus the lm_head (logits
gathered to the full vocabulary at TP=2) on the sampled rows, from persistent buffers
(llmfast/bench/static_batch.py). Shapes: decode batches (B requests, one token each,
context --context-len) and one prefill of --prefill-len tokens. TP=1 runs in one
process with --threads threads, TP=2 in two processes (gloo) with --threads / 2 each,
so both use the same cores.

The collectives' time is measured on the side: at TP=2 the ranks also run, alone, the
collectives one step makes, at the step's shapes (an all-reduce of [T, hidden] after the
embedding and after each layer's o_proj and down_proj, and the all-gather of the
[B, V / 2] logits). On 2 cores expect no gain: the point is the plumbing.

    python scripts/bench_tp.py --model random:qwen3-0.6b --layers 4 --out profiles/tp-cpu.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch
import torch.multiprocessing as mp

from llmfast.bench.environment import cpu_name
from llmfast.bench.stats import median_call_ms
from llmfast.utils.ports import free_port


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--layers", type=int, default=4, help="keep the first N layers (0: all)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="CPU threads in all, per TP size")
    p.add_argument("--out", type=Path, default=None, help="markdown report")
    return p.parse_args()


def _shapes(args) -> list[tuple[str, int, int]]:
    """(label, tokens, requests) per measured step."""
    decode = [(f"decode B={b}", b, b) for b in (int(x) for x in args.batch_sizes.split(","))]
    return [*decode, (f"prefill {args.prefill_len}", args.prefill_len, 1)]


def _fill(static, tokens: int, requests: int, context_len: int) -> None:
    """Buffers for `requests` requests with tokens // requests new tokens each, ending
    at position context_len - 1 (a decode: one token; a prefill: the whole context)."""
    per_req = tokens // requests
    bs = static.block_size
    pos = torch.arange(context_len - per_req, context_len).repeat(requests)  # [T]
    req = torch.arange(requests).repeat_interleave(per_req)  # [T]
    rows = static.block_table[:requests].long()
    static.input_ids[:tokens] = 1
    static.positions[:tokens] = pos
    static.slot_mapping[:tokens] = rows[req, pos // bs] * bs + pos % bs
    static.table[:requests].copy_(static.block_table[:requests])
    static.query_start_loc[: requests + 1] = torch.arange(requests + 1, dtype=torch.int32) * per_req
    static.seq_lens[:requests] = context_len


def _rank(rank: int, world: int, port: int, args, out_path: str) -> None:
    from llmfast.bench.static_batch import StaticBatch
    from llmfast.distributed import (
        TensorParallelGroup,
        all_gather_last_dim,
        all_reduce,
        init_tensor_parallel,
    )
    from llmfast.kernels.cpu.linear import prepack_linears
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import ModelSource, resolve_model

    torch.set_num_threads(max(args.threads // world, 1))
    group = (init_tensor_parallel(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
             if world > 1 else TensorParallelGroup.single())
    source = resolve_model(args.model)
    if args.layers:
        source = ModelSource(source.spec, source.path,
                             dataclasses.replace(source.config, num_hidden_layers=args.layers))
    model = build_model(source, torch.float32, "cpu", max_positions=args.context_len + 16,
                        tp=group)
    prepack_linears(model, None)  # as the runner does for eager CPU runs
    shapes = _shapes(args)
    max_tokens = max(t for _, t, _ in shapes)
    max_reqs = max(r for _, _, r in shapes)
    static = StaticBatch(model, max_reqs, args.context_len, max_num_tokens=max_tokens)
    cfg = model.config
    results = {}
    for label, tokens, requests in shapes:
        _fill(static, tokens, requests, args.context_len)

        def step(tokens: int = tokens, requests: int = requests) -> None:
            hidden = static.run(model, tokens, requests)
            with torch.inference_mode():
                model.compute_logits(hidden[static.query_start_loc[1:requests + 1].long() - 1])

        row = {"step_ms": median_call_ms(step, args.iters, args.warmup)}
        if world > 1:
            # Zeros: summed in place over and over, they stay finite.
            hidden = torch.zeros(tokens, cfg.hidden_size)
            logits = torch.zeros(requests, model.lm_head.out_features)

            def collectives(hidden: torch.Tensor = hidden, logits: torch.Tensor = logits) -> None:
                for _ in range(2 * cfg.num_hidden_layers + 1):
                    all_reduce(hidden, group)
                all_gather_last_dim(logits, group)

            row["comm_ms"] = median_call_ms(collectives, args.iters, args.warmup)
            row["num_collectives"] = 2 * cfg.num_hidden_layers + 2
        results[label] = row
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _run(world: int, args) -> dict:
    port = free_port()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(_rank, args=(world, port, args, f.name), nprocs=world)
        return json.loads(Path(f.name).read_text())


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()[0]
    tp1, tp2 = _run(1, args), _run(2, args)
    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    lines = [
        "| step | TP=1 ms | TP=2 ms | TP=2 / TP=1 | TP=2 collectives alone ms | share of TP=2 step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, _, _ in _shapes(args):
        one, two = tp1[label], tp2[label]
        lines.append(
            f"| {label} | {one['step_ms']:.2f} | {two['step_ms']:.2f} | "
            f"{two['step_ms'] / one['step_ms']:.2f}x | {two['comm_ms']:.2f} "
            f"({two['num_collectives']} ops) | {two['comm_ms'] / two['step_ms']:.0%} |")
    table = "\n".join(lines)
    print(table)
    print(load)
    if args.out is not None:
        command = "python scripts/bench_tp.py " + " ".join(sys.argv[1:])
        args.out.write_text(
            "# Tensor parallelism on CPU: TP=1 vs TP=2 step time\n\n"
            f"Machine: {cpu_name()}, {mp.cpu_count()} cores; torch {torch.__version__}; "
            f"{time.strftime('%Y-%m-%d')}.\n\nCommand: `{command}`\n\n"
            f"Model {args.model}" + (f" cut to {args.layers} layers" if args.layers else "")
            + f", float32, eager; decode context {args.context_len}; medians of "
            f"{args.iters} steps; {args.threads} threads in all (TP=2: "
            f"{max(args.threads // 2, 1)} per rank, gloo); {load}.\n\n{table}\n")


if __name__ == "__main__":
    main()
