"""Sliding-window layers against global ones, in two measurements (`--mode`):

- `attention` (the default): the decode cost against the context. One decode step's
  attention at each context, with the window on and off, on Gemma 3 1B's layer shapes
  (4 query heads, 1 KV head, head_dim 256; window 512). CUDA: the Triton kernel;
  `--device cpu`: the CPU op (attention/cpu.py), timed by the wall clock.
- `kv-groups`: the KV-cache bytes a request holds with and without KV-cache groups
  (core/kv_cache_groups.py), for Gemma 3 1B's layers, block 16, bfloat16 pages: exact
  block counts, no timing.

    python scripts/bench_sliding.py --contexts 8192 32768 --batches 1 16 --json OUT.json
    python scripts/bench_sliding.py --mode kv-groups --json profiles/sliding/hybrid-kv-cpu.json

`attention`: the windowed kernel skips the key tiles before the window
(attention/triton/kernels.py), so its time should stay flat as the context grows while
the full kernel's grows with it. Each figure is the median of `--iters` CUDA-event
timings (L2 flushed before each call), the window-on and window-off calls interleaved;
`--samples` repeats the whole table. The output is checked against the float64
reference for the smallest case first.

`kv-groups` (random:gemma-3-1b: 26 layers, every sixth global, window 512): "groups" is
the engine's KV-cache manager for this model (7 groups of 4-layer pages; the sliding
groups free the blocks that left their window); "one group" the same model with every
layer keeping every block (26-layer pages), what llmfast did before the groups. Both run
the real scheduler and KV-cache manager with a stand-in runner (every step samples token
7; the block accounting does not depend on the model's values), so held bytes = blocks
held x page bytes. 1. One long generation: the bytes the request holds at each context
length. 2. Admission: in one KV-cache budget (--kv-gib), how many long requests
(--requests of --prompt tokens generating --gen) decode at once, and the steps the batch
takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import tree_stamp  # noqa: E402  (the measured tree, as every figure has)

from llmfast.attention import ops  # noqa: E402
from llmfast.attention.triton import launch as attention  # noqa: E402
from llmfast.bench.kernels.attention_inputs import decode_case  # noqa: E402
from llmfast.bench.kernels.cuda_timing import L2_FLUSH_BYTES, time_us_interleaved  # noqa: E402
from llmfast.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from llmfast.core.kv_cache_groups import KVCacheGroups, kv_cache_groups  # noqa: E402
from llmfast.core.request import Request  # noqa: E402
from llmfast.core.scheduler import Scheduler  # noqa: E402
from llmfast.core.scheduler_output import ModelRunnerOutput  # noqa: E402
from llmfast.models.sources.random_presets import RANDOM_PRESETS  # noqa: E402
from llmfast.sampling_params import SamplingParams  # noqa: E402
from llmfast.worker.startup.kv_cache_sizing import kv_block_bytes  # noqa: E402


def _check(case, window: int, scale: float) -> float:
    """Max |error| of the windowed kernel against the float64 reference."""
    want = torch.zeros(case.q.shape, dtype=torch.float64, device=case.q.device)
    ops.paged_attention_reference(case.q.double(), case.k_cache.double(),
                                  case.v_cache.double(), case.block_table,
                                  case.query_start_loc, case.seq_lens, scale, want,
                                  compute_dtype=torch.float64, window=window)
    attention.unified_attention(case.q, case.k_cache, case.v_cache, case.block_table,
                                case.query_start_loc, case.seq_lens, scale, case.out,
                                window=window, uniform_decode=True)
    return (case.out.double() - want).abs().max().item()


def _cpu_figures(args) -> list[dict]:
    """The CPU op's medians (wall clock, `--iters` calls, window on and off in turn)."""
    from llmfast.attention.cpu import paged_attention_cpu
    from llmfast.attention.workspaces import AttentionWorkspaces

    gen = torch.Generator().manual_seed(0)
    scale = args.head_dim**-0.5
    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            blocks = -(-ctx // args.block_size)
            shape = (batch * blocks, args.block_size, args.kv_heads, args.head_dim)
            k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            table = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).int()
            q = torch.randn(batch, args.heads, args.head_dim, generator=gen)
            qsl = torch.arange(batch + 1, dtype=torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32)
            out = torch.empty_like(q)
            # The cache's owner, as the runner's: plans memoised, gather buffers reused.
            owner = AttentionWorkspaces([k_cache])  # noqa: F841 (held while timing)
            timings: dict = {args.window: [], None: []}
            for _ in range(args.iters):
                for window in timings:
                    start = time.perf_counter()
                    paged_attention_cpu(q, k_cache, v_cache, table, qsl, lens, scale, out,
                                        window)
                    timings[window].append(1e6 * (time.perf_counter() - start))
            rows.append(dict(batch=batch, context=ctx, window=args.window,
                             windowed_us=statistics.median(timings[args.window]),
                             full_us=statistics.median(timings[None])))
            print(f"batch {batch:3d}  context {ctx:6d}  window {args.window}: "
                  f"{rows[-1]['windowed_us']:9.1f} us   full: {rows[-1]['full_us']:9.1f} us")
    return rows


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


def attention_figures(args) -> dict:
    """`--mode attention` on CUDA: the windowed and full kernel's medians per case."""
    if not torch.cuda.is_available():
        sys.exit("bench_sliding.py needs a CUDA GPU (or --device cpu, or --mode kv-groups)")
    gen = torch.Generator("cuda").manual_seed(0)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    scale = args.head_dim**-0.5
    cases = {(b, c): decode_case(b, c, args.heads, args.kv_heads, args.head_dim,
                                 args.block_size, gen)
             for b in args.batches for c in args.contexts}
    small = cases[(min(args.batches), min(args.contexts))]
    error = _check(small, args.window, scale)
    rows = []
    for (batch, ctx), case in cases.items():
        def run(window, case=case):
            return lambda: attention.unified_attention(
                case.q, case.k_cache, case.v_cache, case.block_table, case.query_start_loc,
                case.seq_lens, scale, case.out, window=window, uniform_decode=True)

        samples = [time_us_interleaved([run(args.window), run(None)], args.iters, flush)
                   for _ in range(args.samples)]
        windowed = [s[0] for s in samples]
        full = [s[1] for s in samples]
        rows.append(dict(batch=batch, context=ctx, window=args.window,
                         windowed_us=statistics.median(windowed), full_us=statistics.median(full),
                         windowed_samples=windowed, full_samples=full))
        print(f"batch {batch:3d}  context {ctx:6d}  window {args.window}: "
              f"{rows[-1]['windowed_us']:8.1f} us   full: {rows[-1]['full_us']:8.1f} us")
    print(f"max |error| vs float64 (batch {min(args.batches)}, context "
          f"{min(args.contexts)}): {error:.2e}")
    return dict(device=torch.cuda.get_device_name(), dtype="bfloat16", heads=args.heads,
                kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                iters=args.iters, max_abs_error=error, rows=rows)


def kv_groups_figures(args) -> dict:
    """`--mode kv-groups`: held bytes and admission, with the groups and with one."""
    config: ModelConfig = RANDOM_PRESETS["gemma-3-1b"]
    flat = dataclasses.replace(config, sliding_window=None, layer_types=())
    modes = {"groups": (kv_cache_groups(config), kv_block_bytes(config, args.block_size,
                                                                 torch.bfloat16)),
             "one group": (None, kv_block_bytes(flat, args.block_size, torch.bfloat16))}
    used = ("block_size", "budget", "context", "long_prompt", "marks", "kv_gib", "requests",
            "prompt", "gen")
    result: dict = dict(model="random:gemma-3-1b", dtype="bfloat16",
                        args={k: getattr(args, k) for k in used}, tree=tree_stamp(),
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
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("attention", "kv-groups"), default="attention")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", type=Path)
    att = ap.add_argument_group("--mode attention")
    att.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    att.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    att.add_argument("--window", type=int, default=512)
    att.add_argument("--heads", type=int, default=4)
    att.add_argument("--kv-heads", type=int, default=1)
    att.add_argument("--head-dim", type=int, default=256)
    att.add_argument("--iters", type=int, default=50)
    att.add_argument("--samples", type=int, default=3)
    att.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    kv = ap.add_argument_group("--mode kv-groups")
    kv.add_argument("--budget", type=int, default=2048, help="max-num-batched-tokens")
    kv.add_argument("--context", type=int, default=32768,
                    help="the long generation's last context")
    kv.add_argument("--long-prompt", type=int, default=1024)
    kv.add_argument("--marks", type=int, nargs="+",
                    default=[1024, 2048, 4096, 8192, 16384, 32768])
    kv.add_argument("--kv-gib", type=float, default=2.0)
    kv.add_argument("--requests", type=int, default=32)
    kv.add_argument("--prompt", type=int, default=8192)
    kv.add_argument("--gen", type=int, default=256)
    args = ap.parse_args()
    if args.mode == "kv-groups":
        result = kv_groups_figures(args)
    elif args.device == "cpu":
        result = dict(device="cpu", dtype="float32", torch=torch.__version__,
                      threads=torch.get_num_threads(), heads=args.heads,
                      kv_heads=args.kv_heads, head_dim=args.head_dim,
                      block_size=args.block_size, iters=args.iters, rows=_cpu_figures(args))
    else:
        result = attention_figures(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
