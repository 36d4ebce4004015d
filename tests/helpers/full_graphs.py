"""The full-graph tests' engine and workload (tests/test_full_graphs.py, and the tests of
device views, graph inputs, kernel precompile, the interpreted GEMV and hybrid KV that
run the same path): an engine on the CPU with emulated CUDA graphs that check static
addresses, a workload whose requests arrive, finish and join mid-decode, its greedy run
checked against HF, RoPE handed to the attention op as on CUDA, and the runner started
in its CUDA order."""

from __future__ import annotations

import dataclasses
import random

from llmfast import SamplingParams
from llmfast.config import CudaGraphMode
from llmfast.engine import LLMEngine
from llmfast.engine.args import EngineArgs
from tests.helpers.engine_config import engine_config

MAX_SEQS = 6
SIZES = (1, 2, 4, 8, 16, 32)


def emulated_graph_engine(ckpt, mode: CudaGraphMode, **engine_args) -> LLMEngine:
    args = EngineArgs(model=str(ckpt), device="cpu", max_model_len=96, block_size=4,
                      seed=0, compile=mode is not None, max_num_seqs=MAX_SEQS,
                      max_num_batched_tokens=32, cuda_graph_sizes=SIZES, **engine_args)
    config, source = engine_config(args)
    if mode is not None:
        config = dataclasses.replace(config, compile=dataclasses.replace(
            config.compile, cuda_graph_mode=mode, emulate_cuda_graphs=True,
            check_static_addresses=True))
    return LLMEngine(config, source)


def arrival_workload(seed: int = 0):
    """10 prompts (1-30 tokens) generating 3-24 tokens; 6 run at once, so requests
    finish and others join mid-decode; with block size 4 every context crosses
    several block boundaries while decoding."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 31))] for _ in range(10)]
    lengths = [rng.randrange(3, 25) for _ in range(10)]
    arrivals = [0, 0, 0, 0, 2, 5, 9, 14, 20, 27]  # step at which each request arrives
    return prompts, lengths, arrivals


def run_with_arrivals(engine: LLMEngine, prompts, params, arrivals) -> list[list[int]]:
    ids: dict[str, int] = {}
    tokens: dict[int, list[int]] = {}
    step = 0
    while len(tokens) < len(prompts):
        for i, at in enumerate(arrivals):
            if at == step:
                ids[engine.add_request({"prompt_token_ids": prompts[i]}, params[i],
                                       stream=False)] = i
        for out in engine.step():
            if out.finished:
                tokens[ids[out.request_id]] = list(out.outputs[0].token_ids)
        step += 1
        assert step < 1000
    return [tokens[i] for i in range(len(prompts))]


def rope_in_the_op(monkeypatch, cache_dir) -> None:
    """The decoder hands RoPE to the attention op, as on CUDA (on the CPU the op then
    rotates with the torch reference), with a compile cache of its own (`cache_dir`), so
    the first start traces: a guard problem shows on a cold start only."""
    from llmfast.kernels.layers.rotary_reference import rope_cache_takes
    from llmfast.models import decoder

    monkeypatch.setattr(decoder, "rope_fuses_into_attention", rope_cache_takes)
    monkeypatch.setenv("LLMFAST_CACHE", str(cache_dir))


def greedy_matches_hf(engine: LLMEngine, oracle) -> None:
    """The workload, greedy, under async scheduling: every request's tokens are HF's,
    and both graph kinds were replayed."""
    prompts, lengths, arrivals = arrival_workload()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    engine.set_async_scheduling(True)
    got = run_with_arrivals(engine, prompts, params, arrivals)
    for p, n, tokens in zip(prompts, lengths, got):
        assert tokens == oracle(p, n)
    compiled = engine.runner.compiled
    assert compiled.graphs.full.num_replays > 0 and compiled.graphs.piecewise.num_replays > 0


def cuda_start_up_order(monkeypatch, calls: list[str] | None = None, profile=None) -> None:
    """The runner starts in its CUDA order on the CPU: the memory profile (by default a
    stand-in leaving one-block scratch caches bound, as the real one does) and the
    graphs' estimate -> the KV cache sized (256 blocks: a stand-in for the device's free
    memory) and bound -> the model compiled and every graph captured once on it.
    `calls` records "profile", "size" and "capture" as they happen."""
    from llmfast.worker import model_runner
    from llmfast.worker.startup import runner_startup
    from llmfast.worker.startup.memory_profile import bind_one_block_caches

    def one_block_profile(model, sampler, max_num_tokens, max_num_reqs, block_size, dtype,
                          device, max_model_len=None):
        bind_one_block_caches(model, block_size, dtype, device)
        if calls is not None:
            calls.append("profile")
        return 0

    def blocks(*args):
        if calls is not None:
            calls.append("size")
        return 256

    def capture_recorded(*args):
        if calls is not None:
            calls.append("capture")
        return compile_and_capture(*args)

    compile_and_capture = runner_startup.compile_and_capture
    monkeypatch.setattr(runner_startup, "profile_peak_memory", profile or one_block_profile)
    monkeypatch.setattr(runner_startup, "num_gpu_blocks", blocks)
    monkeypatch.setattr(runner_startup, "compile_and_capture", capture_recorded)
    monkeypatch.setattr(model_runner.ModelRunner, "_sizes_cache_by_profiling",
                        lambda self: True)
