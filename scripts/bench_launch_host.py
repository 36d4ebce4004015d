"""Host cost of one attention / KV-write (/ RoPE + KV-write) launch on CPU, cached launch
path vs Triton's JIT.

No GPU needed: Triton compiles the kernels for sm_90 (llmfast/kernels/launch/offline_target.py)
and each launch ends in a recorder where the C launcher would be called, so this times
everything Python does per launch up to that call (llmfast's config selection and
workspace lookups, then either Triton's JIT dispatch or the cached launcher). The C
launcher itself (the same for both) and CUDA's own launch cost are not included: on a GPU,
scripts/bench_kernels.py measures whole launches.

Shapes: bf16, 32 query / 8 KV heads, head dim 128, block size 16; a batch-1 decode (8 KV
splits merged in the launch, one launch) and a 512-token prefill. Figures: median over
--repeats of the mean µs per call of --calls back-to-back calls.

    PYTHONPATH=$PWD python scripts/bench_launch_host.py [--markdown FILE] [--json FILE]

`--baseline DIR` times the same calls with the llmfast found in DIR instead (e.g. a
`git archive` of an older commit, before the cached launch existed): one column.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

REPO = Path(__file__).resolve().parent.parent
BASELINE = sys.argv[sys.argv.index("--baseline") + 1] if "--baseline" in sys.argv else None
sys.path.insert(0, BASELINE or str(REPO))

from llmfast.kernels import attention, kv_write, rope_cache
from llmfast.kernels.workspaces import AttentionWorkspaces


def _offline_hopper():
    """This checkout's offline_target (a baseline tree may predate it)."""
    spec = importlib.util.spec_from_file_location(
        "_offline_target", REPO / "llmfast" / "kernels" / "launch" / "offline_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.offline_hopper


def per_call_us(fn, calls: int, repeats: int, launches: list, both: bool = True
                ) -> tuple[float, float]:
    """(JIT, cached) µs per call; the two alternate batch by batch, so both see the same
    share of a busy machine. both=False: as the code stands (no toggle), twice the same."""
    modes = (False, True) if both else (None,)
    samples: dict[bool | None, list[float]] = {m: [] for m in modes}
    for fast in modes:
        set_fast_launch(fast)
        fn()  # compile (JIT) / remember the compiled kernel (cached)
    for _ in range(repeats):
        for fast in modes:
            set_fast_launch(fast)
            launches.clear()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[fast].append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples[modes[0]]), statistics.median(samples[modes[-1]])


def set_fast_launch(on: bool | None) -> None:
    if on is not None:
        for cache in (attention._ATTENTION_LAUNCHES, kv_write._KV_WRITE_LAUNCHES,
                      rope_cache._LAUNCHES):
            cache.enabled = on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--baseline", help="a tree holding an older llmfast (see above)")
    args = parser.parse_args()
    if torch.cuda.is_available() or not isinstance(attention._unified_attention_kernel,
                                                   triton.runtime.JITFunction):
        sys.exit("run on a CPU machine, without TRITON_INTERPRET (GPUs: bench_kernels.py)")
    # CPU tensors are refused by the launch guard (they would crash a real launch); here
    # nothing is launched.
    attention.check_launchable = kv_write.check_launchable = lambda *a: None
    rope_cache.check_launchable = lambda *a: None

    bf16 = dict(dtype=torch.bfloat16)
    k_cache = torch.empty(64, 16, 8, 128, **bf16)
    owner = AttentionWorkspaces([k_cache])  # noqa: F841 - partials reused, as the runner's
    cases = {}
    for name, num_tokens, kw in (("decode B=1", 1, dict(num_splits=8)),
                                 ("prefill 512", 512, {})):
        q = torch.empty(num_tokens, 32, 128, **bf16)
        out = torch.empty_like(q)
        table = torch.zeros(1, 64, dtype=torch.int32)
        qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
        seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
        cases[f"attention, {name}"] = (lambda q=q, out=out, table=table, qsl=qsl,
                                       seq_lens=seq_lens, kw=kw: attention.unified_attention(
                                           q, k_cache, k_cache, table, qsl, seq_lens, 0.1, out,
                                           **kw))
    k = torch.empty(1, 8, 128, **bf16)
    slots = torch.zeros(1, dtype=torch.int64)
    cases["KV write, 1 token"] = lambda: attention.reshape_and_cache(k, k, k_cache, k_cache,
                                                                     slots)
    q1, q1_out = torch.empty(1, 32, 128, **bf16), torch.empty(1, 32, 128, **bf16)
    positions, cos_sin = torch.zeros(1, dtype=torch.int64), torch.empty(64, 128)
    cases["RoPE + KV write, 1 token"] = lambda: attention.rope_and_cache(
        q1, k, k, positions, cos_sin, q1_out, k_cache, k_cache, slots)
    rows = []
    if args.baseline:
        with _offline_hopper()(record_launches=True) as launches:
            for name, fn in cases.items():
                rows.append(dict(case=name, baseline_us=per_call_us(
                    fn, args.calls, args.repeats, launches, both=False)[0]))
        print(f"Host µs per call, llmfast from {args.baseline} (median of {args.repeats} x "
              f"{args.calls} calls):\n")
        print("\n".join(f"- {r['case']}: {r['baseline_us']:.1f}" for r in rows))
        return
    with _offline_hopper()(record_launches=True) as launches:
        # The launch alone, arguments built once: LaunchCache.launch_planned (the path
        # unified_attention takes) vs kernel[grid](...).
        seen = []
        cache = attention._ATTENTION_LAUNCHES
        launch = cache.launch_planned
        cache.launch_planned = lambda *a: seen.append(a) or launch(*a)
        cases["attention, decode B=1"]()
        del cache.launch_planned  # the method again
        plan, grid, tensors, scalars, const_key, constexprs, fixed = seen[0]
        kernel = attention._unified_attention_kernel

        def launch_only():
            if cache.enabled:
                launch(plan, grid, tensors, scalars, const_key, constexprs, fixed)
            else:  # what unified_attention did before the cached path
                kernel[grid](*tensors, *scalars, *fixed, **constexprs)

        cases["attention launch only (decode B=1 arguments)"] = launch_only
        for name, fn in cases.items():
            jit, fast = per_call_us(fn, args.calls, args.repeats, launches)
            rows.append(dict(case=name, jit_us=jit, cached_us=fast))
    assert attention._ATTENTION_LAUNCHES.fast_launches > 0  # the cached path did run

    lines = [
        (f"Host µs per call up to the C launcher (CPU: {platform.processor() or 'unknown'}, "
         f"{os.cpu_count()} cores; torch {torch.__version__}, triton {triton.__version__}; "
         f"median of {args.repeats} x {args.calls} calls, the two paths alternating):"),
        "",
        "| call | Triton JIT launch µs | cached launch µs | saved µs |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | {r['jit_us']:.1f} | {r['cached_us']:.1f} "
                     f"| {r['jit_us'] - r['cached_us']:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps(dict(torch=torch.__version__, triton=triton.__version__,
                                             rows=rows), indent=2))


if __name__ == "__main__":
    main()
