"""The Triton variants a start-up launches, compiled one after another (as at their first
launches) vs in threads (the start-up's precompile: llmfast/worker/startup/kernel_precompile.py).

The runner of `--model` is built, its dry forwards are run with every submission
recorded (nothing compiled yet), then the recorded variants are compiled `--repeats`
times each way, alternating, each time into an empty Triton cache and with the kernels'
in-process caches emptied. Prints seconds per way (median) and per variant (serial).

On a GPU: the device's own compiles. With `--offline` (no GPU needed): llmfast's Triton
path forced on the CPU and compiled for sm_90 (llmfast/kernels/launch/offline_target.py),
as the CPU tests of the precompile do.

    PYTHONPATH=$PWD python scripts/bench_kernel_precompile.py --model random:llama-3.2-1b \
        [--offline] [--threads 8] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmfast.engine_args import EngineArgs  # noqa: E402
from llmfast.kernels import attention, kv_write, ops, rope_cache  # noqa: E402
from llmfast.kernels.launch import precompile  # noqa: E402
from llmfast.kernels.launch.offline_target import offline_hopper  # noqa: E402
from llmfast.kernels.layers import switch  # noqa: E402
from llmfast.worker.model_runner import ModelRunner  # noqa: E402
from llmfast.worker.startup import kernel_precompile  # noqa: E402


def _force_offline_triton(stack: contextlib.ExitStack) -> None:
    """llmfast's Triton path on the CPU, compiled for sm_90, launches recorded."""
    import pytest

    patch = stack.enter_context(pytest.MonkeyPatch.context())
    patch.setattr(ops, "use_triton", lambda x: True)
    patch.setattr(switch, "use_triton", lambda x: True)
    for module in (attention, kv_write, rope_cache):
        patch.setattr(module, "check_launchable", lambda *args: None)
    stack.enter_context(offline_hopper(record_launches=True))


def record_variants(runner: ModelRunner) -> list[tuple]:
    """(kernel, grid, args, kwargs) of each distinct variant the dry forwards submit."""
    recorded: dict[tuple, tuple] = {}

    def record(self, kernel, grid, args, kwargs):
        self.dry_launch_count += 1
        key = precompile._variant_key(kernel, args, kwargs)
        recorded.setdefault(key, (kernel, tuple(grid), tuple(args), dict(kwargs)))

    submit = precompile.KernelPrecompiler.submit
    precompile.KernelPrecompiler.submit = record
    try:
        kernel_precompile.precompile_kernels(runner)
    finally:
        precompile.KernelPrecompiler.submit = submit
    return list(recorded.values())


def compile_all(variants: list[tuple], threads: int) -> tuple[float, list[float]]:
    """Seconds to compile every variant (threads=0: serially) into an empty Triton cache;
    per-variant seconds when serial."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmfast-bench-triton-")
    for kernel, *_ in variants:
        kernel.device_caches.clear()
    each: list[float] = []
    start = time.perf_counter()
    if threads == 0:
        for kernel, grid, args, kwargs in variants:
            t0 = time.perf_counter()
            kernel.warmup(*args, grid=grid, **kwargs)
            each.append(time.perf_counter() - t0)
    else:
        precompiler = precompile.KernelPrecompiler(max_workers=threads)
        with precompiler.dry_launches():
            for kernel, grid, args, kwargs in variants:
                precompiler.submit(kernel, grid, args, kwargs)
        precompiler.wait()
    return time.perf_counter() - start, each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--offline", action="store_true", help="CPU, compiled for sm_90")
    parser.add_argument("--threads", type=int, default=precompile.default_workers())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.offline and not torch.cuda.is_available():
        parser.error("no GPU: pass --offline to compile for sm_90 on the CPU")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmfast-bench-triton-")
    with contextlib.ExitStack() as stack:
        if args.offline:
            _force_offline_triton(stack)
        engine_args = EngineArgs(model=args.model, dtype=args.dtype, seed=0,
                                 device="cpu" if args.offline else "cuda",
                                 compile=not args.offline, max_model_len=2048,
                                 max_num_batched_tokens=args.max_num_batched_tokens)
        config, source = engine_args.create_engine_config()
        runner = ModelRunner(config, source)
        variants = record_variants(runner)
        serial, threaded, per_variant = [], [], []
        for _ in range(args.repeats):
            seconds, each = compile_all(variants, 0)
            serial.append(seconds)
            per_variant.append(each)
            threaded.append(compile_all(variants, args.threads)[0])
    names = [kernel.fn.__name__ for kernel, *_ in variants]
    medians = [statistics.median(col) for col in zip(*per_variant)]
    result = {
        "model": args.model, "dtype": args.dtype, "offline_sm90": args.offline,
        "device": (torch.cuda.get_device_name() if not args.offline else "cpu (sm_90 offline)"),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "triton": triton.__version__,
        "machine": platform.node(), "threads": args.threads, "repeats": args.repeats,
        "variants": [{"kernel": n, "serial_s": round(s, 3)} for n, s in zip(names, medians)],
        "serial_s": round(statistics.median(serial), 3),
        "threads_s": round(statistics.median(threaded), 3),
    }
    print(f"{len(variants)} variants of {args.model} ({result['device']}, "
          f"{result['cpu_count']} CPUs, torch {torch.__version__}, triton {triton.__version__})")
    for n, s in zip(names, medians):
        print(f"  {n:34s} {s:6.2f} s serial")
    print(f"serial {result['serial_s']:.2f} s, {args.threads} threads "
          f"{result['threads_s']:.2f} s (medians of {args.repeats}): "
          f"{result['serial_s'] / result['threads_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
