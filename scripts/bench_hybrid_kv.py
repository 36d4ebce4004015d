"""KV-cache bytes held with and without KV-cache groups (core/kv_cache_groups.py), for
Gemma 3 1B's layers (random:gemma-3-1b: 26 layers, every sixth global, window 512),
block 16, bfloat16 pages.

"groups": the engine's KV-cache manager for this model (7 groups of 4-layer pages; the
sliding groups free the blocks that left their window). "one group": the same model
with every layer keeping every block (26-layer pages), what llmfast did before the
groups. Both run the real scheduler and KV-cache manager with a stand-in runner (every
step samples token 7; the block accounting does not depend on the model's values), so
the figures are exact counts, not timings: held bytes = blocks held x page bytes.

1. One long generation: the bytes the request holds at each context length.
2. Admission: in one KV-cache budget (--kv-gib), how many long requests (--requests of
   --prompt tokens generating --gen) decode at once, and the steps the batch takes.

    python scripts/bench_hybrid_kv.py --json profiles/sliding/hybrid-kv-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import tree_stamp  # noqa: E402  (the measured tree, as every figure has)

from llmfast.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from llmfast.core.kv_cache_groups import KVCacheGroups, kv_cache_groups  # noqa: E402
from llmfast.core.request import Request  # noqa: E402
from llmfast.core.scheduler import Scheduler  # noqa: E402
from llmfast.core.scheduler_output import ModelRunnerOutput  # noqa: E402
from llmfast.models.sources.random_presets import RANDOM_PRESETS  # noqa: E402
from llmfast.sampling_params import SamplingParams  # noqa: E402
from llmfast.worker.startup.kv_cache_sizing import kv_block_bytes  # noqa: E402


def _step(sched: Scheduler) -> dict[str, int]:
    """schedule + a runner that samples 7 where a request's tokens reach the end."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
               else [] for r in ids]
    sched.update(out, ModelRunnerOutput(ids, sampled))
    return out.num_scheduled_tokens


def _scheduler(groups: KVCacheGroups | None, num_blocks: int, args, max_model_len: int,
               max_num_seqs: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=args.budget,
                                     max_model_len=max_model_len),
                     CacheConfig(block_size=args.block_size), num_blocks, kv_groups=groups)


def _request(rid: str, n_prompt: int, n_gen: int, first: int) -> Request:
    return Request(rid, list(range(first, first + n_prompt)),
                   SamplingParams(max_tokens=n_gen, ignore_eos=True), eos_token_ids=())


def long_generation(groups, page: int, args) -> tuple[list[dict], int]:
    """(per mark: the blocks and bytes held at the first decode step at or past that
    context, the most bytes held at any step)."""
    total = args.context + 3
    sched = _scheduler(groups, 4 * (total // args.block_size + 2) * 26, args, total, 1)
    kv = sched.kv_cache_manager
    sched.add_request(_request("a", args.long_prompt, args.context - args.long_prompt + 2,
                               1000))
    marks = sorted(c for c in args.marks if c <= args.context)
    rows: list[dict] = []
    peak = 0
    while sched.requests:
        scheduled = _step(sched)
        request = sched.requests.get("a")
        if request is None:
            break
        held = kv.num_held_blocks("a")
        peak = max(peak, held * page)
        if scheduled.get("a") != 1:  # a prefill chunk: its sliding blocks go next step
            continue
        while marks and request.num_computed_tokens >= marks[0]:
            rows.append(dict(context=marks.pop(0), held_blocks=held, held_bytes=held * page))
    return rows, peak


def admission(groups, page: int, args) -> dict:
    num_blocks = int(args.kv_gib * 2**30) // page
    sched = _scheduler(groups, num_blocks, args, args.prompt + args.gen + 1, args.requests)
    for i in range(args.requests):
        sched.add_request(_request(f"r{i}", args.prompt, args.gen, 100_000 * (i + 1)))
    most, steps, t0 = 0, 0, time.perf_counter()
    while sched.requests:
        scheduled = _step(sched)
        most = max(most, sum(1 for n in scheduled.values() if n == 1))
        steps += 1
    return dict(num_blocks=num_blocks, page_bytes=page, max_decoding_at_once=most,
                steps=steps, preemptions=sched.num_preemptions,
                host_seconds=round(time.perf_counter() - t0, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="max-num-batched-tokens")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--marks", type=int, nargs="+",
                        default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--kv-gib", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--gen", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    config: ModelConfig = RANDOM_PRESETS["gemma-3-1b"]
    flat = dataclasses.replace(config, sliding_window=None, layer_types=())
    modes = {"groups": (kv_cache_groups(config), kv_block_bytes(config, args.block_size,
                                                                 torch.bfloat16)),
             "one group": (None, kv_block_bytes(flat, args.block_size, torch.bfloat16))}
    result: dict = dict(model="random:gemma-3-1b", dtype="bfloat16", args=vars(args),
                        tree=tree_stamp(),
                        groups=[dict(window=g.window, layers=list(g.layers))
                                for g in modes["groups"][0].groups])
    for name, (groups, page) in modes.items():
        rows, peak = long_generation(groups, page, args)
        result[name] = dict(page_bytes=page, long_generation=rows, peak_bytes=peak,
                            admission=admission(groups, page, args))
    print(f"{'context':>8} {'one group MiB':>14} {'groups MiB':>11} {'ratio':>6}")
    for a, b in zip(result["one group"]["long_generation"], result["groups"]["long_generation"]):
        print(f"{a['context']:>8} {a['held_bytes'] / 2**20:>14.1f} "
              f"{b['held_bytes'] / 2**20:>11.1f} {a['held_bytes'] / b['held_bytes']:>6.2f}")
    print(f"peak MiB: one group {result['one group']['peak_bytes'] / 2**20:.1f}, "
          f"groups {result['groups']['peak_bytes'] / 2**20:.1f}")
    for name in modes:
        adm = result[name]["admission"]
        print(f"{name}: {args.requests} x ({args.prompt} + {args.gen}) tokens in "
              f"{args.kv_gib:g} GiB: {adm['num_blocks']} blocks of {adm['page_bytes']} B, "
              f"{adm['max_decoding_at_once']} decoding at once, {adm['steps']} steps, "
              f"{adm['preemptions']} preemptions")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
