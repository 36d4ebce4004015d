"""Benchmarks as a library: workloads, percentile maths, and the sweep, throughput and
latency runners. Results are plain dataclasses; `llmfast bench` only
formats them (and the tests call these directly).

Definitions follow vLLM's `bench`: TTFT from a request's arrival to its first token,
TPOT = (e2e - ttft) / (output_len - 1), ITL = the gaps between consecutive tokens.

Where each part lives: `stats` (Summary, summarize), `workload` (requests, sampling
params, warm-up, BenchError), `sweep`, `throughput` and `latency` (the runners),
`environment` (versions and hardware), `bandwidth` (the HBM weight-streaming limit),
`startup` (cold and warm start in fresh processes), `serving` (the server's load
generator, and the server against offline `LLM.generate`), `kernels` (for the kernel
scripts: CUDA timing, the attention cases and launch configurations, the per-layer-kind
table; they import torch and Triton's launch side, so none is re-exported here); size
specs (`--sizes 1..512`) are read by `llmfast.utils.flag_values.parse_sizes`. The HF transformers
baseline lives in `llmfast.bench.hf`; it imports torch, so it is not re-exported here.
"""

from llmfast.bench.environment import environment_info, local_device_facts, rank_device_facts
from llmfast.bench.latency import (
    LatencyResult,
    check_request_rate,
    poisson_arrivals,
    request_latencies,
    run_latency,
)
from llmfast.bench.stats import Summary, summarize
from llmfast.bench.sweep import (
    NotPureDecode,
    SweepPoint,
    SweepResult,
    SweepSkip,
    run_sweep,
    run_sweep_point,
    sweep_engine_limits,
)
from llmfast.bench.throughput import ThroughputResult, run_throughput, throughput_result
from llmfast.bench.workload import (
    BenchError,
    BenchRequest,
    bench_params,
    check_fits,
    random_lengths,
    random_requests,
    shared_prefix_requests,
    warm_up,
)

__all__ = [
    "BenchError",
    "BenchRequest",
    "LatencyResult",
    "NotPureDecode",
    "Summary",
    "SweepPoint",
    "SweepResult",
    "SweepSkip",
    "ThroughputResult",
    "bench_params",
    "check_fits",
    "check_request_rate",
    "environment_info",
    "local_device_facts",
    "poisson_arrivals",
    "random_lengths",
    "random_requests",
    "rank_device_facts",
    "request_latencies",
    "run_latency",
    "run_sweep",
    "run_sweep_point",
    "run_throughput",
    "shared_prefix_requests",
    "summarize",
    "sweep_engine_limits",
    "throughput_result",
    "warm_up",
]
