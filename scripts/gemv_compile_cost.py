#!/usr/bin/env python3
"""What `--gemv auto`'s start-up measurement compiles on a cold start with no shipped
table, and how long that takes, on a machine without a GPU: Triton compiles every
candidate of every projection shape of the presets for sm_90 (the offline target,
llmfast/kernels/launch/offline_target.py) through the start-up's own code
(gemv_tuning.compile_candidates), with an empty Triton cache. Also checks each variant's
shared memory against the H100/H200's 227 KiB a block.

    PYTHONPATH=$PWD python scripts/gemv_compile_cost.py --models random:llama-3.2-1b \\
        --quantizations none --json /tmp/cost.json

Shapes only: the weights are uninitialised CPU tensors (nothing is touched), one per
distinct launch key, so an 8B preset costs no memory. Figures depend on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from llmfast.kernels.gemv import launch_config  # noqa: E402
from llmfast.kernels.gemv import triton_kernels  # noqa: E402
from llmfast.kernels.launch import precompile  # noqa: E402
from llmfast.kernels.launch.offline_target import offline_hopper  # noqa: E402
from llmfast.worker.startup import gemv_tuning  # noqa: E402
from llmfast.worker.startup.gemv_tuning import Launch  # noqa: E402

H100_SMS = 132
MAX_SHARED = 227 * 1024  # a block's dynamic shared memory on sm_90


def preset_launches(spec: str, fp8: bool, fused: bool) -> dict[str, list[Launch]]:
    """One launch per distinct key of what gemv_routing.model_launches gives the preset
    (decoder projections, fused or not; the lm_head, never fp8), on empty CPU tensors."""
    from llmfast.models.sources.model_source import resolve_model

    cfg = resolve_model(spec).config
    dtype = torch.bfloat16
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def launch(n: int, k: int, quantized: bool = fp8, **fusions) -> Launch:
        if quantized:
            weights = dict(weight=torch.empty(n, k, dtype=torch.float8_e4m3fn),
                           weight_scale=torch.empty(1, n), mm_out_dtype=dtype)
        else:
            weights = dict(weight=torch.empty(n, k, dtype=dtype))
        return Launch(dtype=dtype, **weights, **fusions)

    norm = dict(norm_weight=torch.empty(h, dtype=dtype), eps=1e-5)
    if fused:
        launches = [launch(q + 2 * kv, h, **norm), launch(h, q, residual=True),
                    launch(2 * i, h, silu_mul=True, **norm), launch(h, i, residual=True)]
    else:
        launches = [launch(q + 2 * kv, h), launch(h, q), launch(2 * i, h), launch(h, i)]
    launches.append(launch(cfg.vocab_size, h, quantized=False))
    return {la.key: [la] for la in launches}


class _VariantCounter:
    """Stands in for the precompiler's dry launches: the variant keys bound, nothing
    compiled (precompile._variant_key: at least as fine as Triton's own key)."""

    def __init__(self) -> None:
        self.keys: set = set()

    def submit(self, kernel, grid, args, kwargs) -> None:
        self.keys.add(precompile._variant_key(kernel, args, kwargs))


def count_variants(groups: dict[str, list[Launch]], todo: list[tuple[str, int]]) -> int:
    counter = _VariantCounter()
    precompile.ACTIVE = counter
    try:
        for key, bucket in todo:
            first = groups[key][0]
            x, residual = gemv_tuning._rows(first, bucket, torch.empty)
            for config in launch_config.startup_candidates(bucket, first.n, first.k,
                                                           H100_SMS, first.fp8):
                gemv_tuning._launch(first, x, residual, config)
    finally:
        precompile.ACTIVE = None
    return len(counter.keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="random:llama-3.2-1b")
    p.add_argument("--quantizations", default="none", help="comma-separated: none, fp8")
    p.add_argument("--fuse", action="store_true", help="the --gemv-fuse launches")
    p.add_argument("--buckets", default="1,2,4,8,16")
    p.add_argument("--workers", type=int, default=None, help="compile threads")
    p.add_argument("--count-only", action="store_true",
                   help="count the distinct variants the launches bind, compile nothing")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    # A fresh Triton cache: every variant compiles (Triton reads it at each compile).
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gemv-cost-triton-")
    if args.workers:
        precompile.default_workers = lambda: args.workers
    groups: dict[str, list[Launch]] = {}
    for spec in args.models.split(","):
        for quant in args.quantizations.split(","):
            groups.update(preset_launches(spec, quant == "fp8", args.fuse))
    buckets = [int(b) for b in args.buckets.split(",")]
    todo = [(key, b) for key in groups for b in buckets]
    candidates = sum(len(launch_config.startup_candidates(
        b, groups[key][0].n, groups[key][0].k, H100_SMS, groups[key][0].fp8))
        for key, b in todo)
    if args.count_only:
        print(json.dumps({"shapes": len(groups), "pairs": len(todo), "candidates": candidates,
                          "variants": count_variants(groups, todo)}))
        return
    kernels = (triton_kernels.gemv_kernel, triton_kernels.gemv_reduce_kernel)
    for kernel in kernels:
        kernel.device_caches.clear()
    with offline_hopper(record_launches=True):
        t0 = time.perf_counter()
        submitted = gemv_tuning.compile_candidates(groups, todo, H100_SMS)
        seconds = time.perf_counter() - t0
    shared = [c.metadata.shared for kernel in kernels
              for caches in kernel.device_caches.values()
              for c in caches[0].values() if hasattr(c, "metadata")]
    over = sum(s > MAX_SHARED for s in shared)
    import triton

    result = {"models": args.models, "quantizations": args.quantizations,
              "fuse": args.fuse, "buckets": buckets, "shapes": len(groups),
              "pairs": len(todo), "candidates": candidates, "variants": submitted,
              "compiled": len(shared), "seconds": round(seconds, 2),
              "workers": precompile.default_workers(), "cpus": os.cpu_count(),
              "max_shared_bytes": max(shared, default=0), "over_shared_limit": over,
              "triton": triton.__version__, "torch": torch.__version__}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
