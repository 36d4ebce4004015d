"""Timing on a CUDA device for the kernel benchmarks of scripts/ (bench_kernels, bench_moe,
bench_sliding, bench_gemv): medians of CUDA-event timings with L2 flushed before each
call, calls of several functions interleaved for their ratio, CUDA-graph replays, host
launch time, the copy bandwidth ceiling, and differences counted in ulps."""

from __future__ import annotations

import time

import torch

from llmfast.attention.tuning.prefill_measure import median_device_us_interleaved

L2_FLUSH_BYTES = 256 << 20


def time_us(fn, iters: int, flush: torch.Tensor, idle: bool = False) -> float:
    """Median microseconds of fn() between CUDA events, L2 flushed before each call.

    `idle`: wait for the flush before the start event, so the GPU is idle when fn() is
    launched and its host launch time lies between the events (the "eager launch"
    figures: what a call costs when launched on its own). Otherwise the ~90 µs flush
    still runs when fn() is launched and hides any launch time under it (CUDA-graph
    replays and bandwidth, where the kernel's own time is the figure)."""
    return time_us_interleaved([fn], iters, flush, idle)[0]


def time_us_interleaved(fns, iters: int, flush: torch.Tensor, idle: bool = False
                        ) -> list[float]:
    """time_us of each of `fns`, their calls interleaved (f0, f1, f0, f1, ...) rather than
    one function's run after the other's: for a ratio between them. An eager figure
    holds host time, which drifts (clocks, the other processes), so two runs taken one
    after the other can differ by ~10 % for the same kernel (2026-11-26's H100 table:
    13 µs between two launches of one variant at batch 8, 8k)."""
    if not idle:
        return median_device_us_interleaved(fns, iters, warmup=3, before=flush.zero_)

    def flush_and_wait() -> None:
        flush.zero_()
        torch.cuda.synchronize()

    return median_device_us_interleaved(fns, iters, warmup=3, before=flush_and_wait)


ULP_FLOOR = 2.0**-4  # values below this are measured in the ulps of this


def max_diff_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest difference in units of `dtype`'s last place at the reference value
    (at least at ULP_FLOOR: near zero, ulps shrink without end while the absolute
    rounding of a sum of bf16 products does not). A fixed absolute bar (#17's 4e-3) is
    about half a bf16 ulp for outputs of magnitude >= 1 (early causal rows average few
    values), so one rounding step there reads as a failure; this says how many steps."""
    magnitude = want.abs().clamp_min(ULP_FLOOR)
    scale = torch.exp2(torch.floor(torch.log2(magnitude)))
    return ((got - want).abs() / (scale * torch.finfo(dtype).eps)).max().item()


def graph_replay(fn):
    """fn captured into a CUDA graph (after a warm-up call); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def host_launch_us(fn, calls: int = 200) -> float:
    """Host wall-clock microseconds per call of `calls` back-to-back launches."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def copy_bandwidth(flush: torch.Tensor, iters: int) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), iters, flush)
    return 2 * src.numel() / us / 1e3
