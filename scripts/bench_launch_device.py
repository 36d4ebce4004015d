"""Where the host time of one eager attention call goes, on a CUDA machine.

Each row is a layer of the launch alone, its arguments built once, so the differences
between rows are what each layer costs: the whole op (`unified_attention`: plan lookup,
workspaces, then the cached launch), `LaunchCache.launch_planned`, Triton's
`CudaLauncher.__call__`, the C launch under it (what the cached path calls directly,
launch_cache.py `_direct_form`; timed through `LaunchCache._call`, one Python frame more
than session 26's H100 figures, which called it bare), and two floors: a one-element
torch kernel and SDPA's flash decode. Figures: host wall-clock µs per call over --calls back-to-back calls
(then a synchronize), median of --repeats, the rows interleaved.

    python scripts/bench_launch_device.py [--batch 8] [--context 2048] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels_lib import decode_case, flash_backend

from llmfast.kernels import attention


def per_call_us(fns: dict, calls: int, repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_launch_device.py needs a CUDA GPU (none found); nothing was measured.")
    dev = torch.device("cuda", 0)
    batch, ctx, hd, heads, kv_heads = args.batch, args.context, args.head_dim, 32, 8
    gen = torch.Generator("cuda").manual_seed(0)
    case = decode_case(batch, ctx, heads, kv_heads, hd, 16, gen)
    q, k_cache, v_cache, table = case.q, case.k_cache, case.v_cache, case.block_table
    qsl, seq_lens, out = case.query_start_loc, case.seq_lens, case.out
    cache = attention._ATTENTION_LAUNCHES

    def op():
        attention.unified_attention(q, k_cache, v_cache, table, qsl, seq_lens, hd**-0.5, out)

    op()
    op()  # planned: the next calls take the cached path
    seen = []
    launch_planned = cache.launch_planned
    cache.launch_planned = lambda *a: seen.append(a) or launch_planned(*a)
    op()
    del cache.launch_planned
    plan, grid, tensors, scalars, const_key, constexprs, fixed = seen[0]
    entry = next(e for key, e in cache._planned.items() if key[0] is plan)
    launcher, function, packed, fixed_tail, direct = entry
    addresses = tuple(t.data_ptr() for t in tensors)
    kernel_args = (*addresses, *scalars, *fixed_tail)
    stream = torch.cuda.current_stream().cuda_stream

    def planned_only():
        launch_planned(plan, grid, tensors, scalars, const_key, constexprs, fixed)

    def launcher_call():
        launcher(grid[0], grid[1], grid[2], stream, function, packed, None, None, None,
                 *kernel_args)

    def op_direct():
        cache.direct_launch = True
        op()

    def op_through_call():
        cache.direct_launch = False
        op()

    def planned_direct():
        cache.direct_launch = True
        planned_only()

    fns = {
        "op (unified_attention), direct C launch": op_direct,
        "op, through CudaLauncher.__call__": op_through_call,
        "LaunchCache.launch_planned only, direct": planned_direct,
        "CudaLauncher.__call__ only": launcher_call,
    }
    if direct is not None:
        def c_only():  # the C launch, with LaunchCache's one method frame around it
            cache.direct_launch = True
            cache._call(launcher, direct, grid, stream, function, packed, kernel_args)

        fns["LaunchCache._call: Triton's C launch (arguments built)"] = c_only
    one = torch.zeros(1, device=dev)
    fns["torch floor: one-element add_"] = lambda: one.add_(1)
    q_s = q.view(batch, heads, 1, hd)
    k_s, v_s = (t.transpose(1, 2).contiguous() for t in (case.k, case.v))
    with flash_backend():
        fns["SDPA flash decode (enable_gqa)"] = lambda: F.scaled_dot_product_attention(
            q_s, k_s, v_s, enable_gqa=True)
        results = per_call_us(fns, args.calls, args.repeats)
    cache.direct_launch = True
    device = torch.cuda.get_device_name(0)
    print(f"{device}; torch {torch.__version__}, triton {triton.__version__}; decode B={batch}, "
          f"context {ctx}, head dim {hd}, {heads}/{kv_heads} heads; direct form "
          f"{None if direct is None else direct[1]}; host µs per call, median of "
          f"{args.repeats} x {args.calls} back-to-back calls:\n")
    print("| call | host µs |\n|---|---:|")
    for name, us in results.items():
        print(f"| {name} | {us:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(dict(device=device, torch=torch.__version__,
                                             triton=triton.__version__, batch=batch,
                                             context=ctx, head_dim=hd,
                                             direct_form=None if direct is None else direct[1],
                                             host_us=results), indent=1))


if __name__ == "__main__":
    main()
