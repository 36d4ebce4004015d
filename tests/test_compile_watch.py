"""TritonCompileWatch (kernels/launch/compile_watch.py) sees each kernel variant the
process specializes, chains and restores Triton's hooks, and the benchmarks' tables say
when a timed run compiled something. Kernels compile for sm_90 here, without a GPU
(offline_target.py), or for the GPU where there is one."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import triton
import triton.language as tl

from llmfast.cli.bench.tables import sweep_table, throughput_table
from llmfast.kernels.launch.compile_watch import TritonCompileWatch
from llmfast.kernels.launch.offline_target import offline_hopper


@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)


def _compile(block: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _scale_kernel.warmup(torch.empty(64, device=device), 64, BLOCK=block, grid=(1,))


def test_watch_counts_each_new_variant_once_and_restores_the_hooks():
    if not isinstance(_scale_kernel, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET=1: nothing is compiled")
    # Without a GPU, for sm_90 (offline_target.py); with one, for it.
    target = contextlib.nullcontext() if torch.cuda.is_available() else offline_hopper()
    runtime = triton.knobs.runtime
    seen_by_previous = []

    def previous_after(**kwargs):
        seen_by_previous.append(kwargs["fn"].name)

    runtime.jit_post_compile_hook = previous_after
    try:
        with target:
            _compile(32)  # compiled before the watch: not its business
            with TritonCompileWatch() as watch:
                _compile(32)  # in the process's kernel cache already
                _compile(64)
                _compile(64)
                _compile(128)
        assert watch.available
        assert [c.name for c in watch.compiles] == ["_scale_kernel", "_scale_kernel"]
        assert all(c.seconds > 0 for c in watch.compiles)
        assert watch.summary() == {"watched": True, "count": 2,
                                   "seconds": round(watch.seconds, 3),
                                   "by_kernel": {"_scale_kernel": 2}}
        assert seen_by_previous == ["_scale_kernel"] * 3  # chained inside, its own outside
        assert runtime.jit_post_compile_hook is previous_after
        assert runtime.jit_cache_hook is None
    finally:
        runtime.jit_post_compile_hook = None


def test_watch_counts_only_the_compiles_of_its_own_thread():
    """The hooks are process-wide; a variant another thread compiles meanwhile is not
    the watched work's (the start-up's watch once counted one, in a CI run)."""
    if not isinstance(_scale_kernel, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET=1: nothing is compiled")
    target = contextlib.nullcontext() if torch.cuda.is_available() else offline_hopper()
    with target, TritonCompileWatch() as watch:
        other = threading.Thread(target=_compile, args=(256,))
        other.start()
        other.join()
        _compile(512)
    assert [c.name for c in watch.compiles] == ["_scale_kernel"]  # the 512 one's only


def test_throughput_and_sweep_tables_say_when_the_timed_run_compiled():
    result = dict(num_requests=4, input_tokens=40, output_tokens=8, elapsed_s=2.0,
                  requests_per_s=2.0, output_tokens_per_s=4.0, total_tokens_per_s=24.0)
    clean = {"model": "m", "throughput": {**result, "triton_compiles": {
        "watched": True, "count": 0, "seconds": 0.0, "by_kernel": {}}}}
    assert throughput_table(clean).caption is None
    compiled = {"model": "m", "throughput": {**result, "triton_compiles": {
        "watched": True, "count": 2, "seconds": 3.8,
        "by_kernel": {"_unified_attention_kernel": 2}}}}
    caption = throughput_table(compiled).caption
    assert "compiled 2 Triton kernel variant(s) in the timed run (3.8 s: " \
           "_unified_attention_kernel x2)" in caption

    point = dict(batch_size=2, context_len=8, steps=4, decode_tokens_per_s=1.0,
                 prefill_tokens_per_s=1.0, weight_stream_bytes_per_s=0.0,
                 step_latency={"median": 0.001, "p90": 0.001, "p99": 0.001})
    run = {"model": "m", "engine_config": {"scheduler": {"max_num_batched_tokens": 64,
                                                         "max_num_seqs": 8}},
           "sweep": [{**point, "triton_compiles": 0, "triton_compile_s": 0.0},
                     {**point, "batch_size": 4, "triton_compiles": 1,
                      "triton_compile_s": 1.9}]}
    caption = sweep_table({"default": run}).caption
    assert caption == ("Triton kernels compiled at batch 4 (1, 1.9 s): start-up missed "
                       "them; their prefill rates time the compiler")
