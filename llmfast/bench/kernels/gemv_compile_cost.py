"""What `--gemv auto`'s start-up measurement compiles on a cold start with no shipped
table, and how long that takes, on a machine without a GPU (`scripts/bench_gemv.py
--compile-cost`): Triton compiles every candidate of every projection shape of the
presets for sm_90 (the offline target, llmfast/kernels/launch/offline_target.py) through
the start-up's own code (gemv_tuning.compile_candidates), with an empty Triton cache, and
each variant's shared memory is checked against the H100/H200's 227 KiB a block.

Shapes only: the weights are uninitialised CPU tensors (nothing is touched), one per
distinct launch key, so an 8B preset costs no memory. Figures depend on the CPU.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from llmfast.kernels.gemv import launch_config, triton_kernels
from llmfast.kernels.launch import precompile
from llmfast.kernels.launch.offline_target import offline_hopper
from llmfast.worker.startup import gemv_tuning
from llmfast.worker.startup.gemv_tuning import Launch

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


def compile_cost(models: list[str], quantizations: list[str], fused: bool,
                 buckets: list[int], count_only: bool) -> dict:
    """The presets' start-up launches at `buckets`: their candidate and variant counts,
    and unless `count_only` the seconds a cold compile of them all takes here."""
    # A fresh Triton cache: every variant compiles (Triton reads it at each compile).
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gemv-cost-triton-")
    groups: dict[str, list[Launch]] = {}
    for spec in models:
        for quant in quantizations:
            groups.update(preset_launches(spec, quant == "fp8", fused))
    todo = [(key, b) for key in groups for b in buckets]
    candidates = sum(len(launch_config.startup_candidates(
        b, groups[key][0].n, groups[key][0].k, H100_SMS, groups[key][0].fp8))
        for key, b in todo)
    counts = {"shapes": len(groups), "pairs": len(todo), "candidates": candidates}
    if count_only:
        return {**counts, "variants": count_variants(groups, todo)}
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
    import triton

    return {"models": ",".join(models), "quantizations": ",".join(quantizations),
            "fuse": fused, "buckets": buckets, **counts, "variants": submitted,
            "compiled": len(shared), "seconds": round(seconds, 2),
            "workers": precompile.default_workers(), "cpus": os.cpu_count(),
            "max_shared_bytes": max(shared, default=0),
            "over_shared_limit": sum(s > MAX_SHARED for s in shared),
            "triton": triton.__version__, "torch": torch.__version__}
