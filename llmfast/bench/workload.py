"""Workloads and what every runner shares: BenchRequest, random and shared-prefix
prompts, greedy fixed-length sampling params, the warm-up request, the fit check, and
BenchError, the one-line user-facing error every benchmark raises."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmfast.sampling_params import SamplingParams


class BenchError(ValueError):
    """A benchmark that cannot run as asked; the message is one user-facing line."""


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> list[int]:
    """`n` lengths uniform in [mean * (1 - r), mean * (1 + r)] (at least 1), as vLLM's
    random dataset; r = 0 gives fixed lengths."""
    if not 0.0 <= range_ratio < 1.0:
        raise BenchError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_requests(
    num: int, input_len: int, output_len: int, vocab_size: int,
    range_ratio: float = 0.0, seed: int = 0,
) -> list[BenchRequest]:
    """Seeded random-token prompts with fixed or random input and output lengths."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise BenchError("--num-prompts, --input-len and --output-len must be >= 1")
    rng = np.random.default_rng(seed)
    in_lens = random_lengths(rng, num, input_len, range_ratio)
    out_lens = random_lengths(rng, num, output_len, range_ratio)
    return [
        BenchRequest(rng.integers(0, vocab_size, size=n_in).tolist(), n_out)
        for n_in, n_out in zip(in_lens, out_lens)
    ]


def shared_prefix_requests(
    num: int, prefix_len: int, suffix_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """Prompts that share their first `prefix_len` tokens (a system prompt, a document):
    the prefix cache should serve all but the first."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    return [
        BenchRequest(prefix + rng.integers(0, vocab_size, size=suffix_len).tolist(), output_len)
        for _ in range(num)
    ]


def bench_params(output_len: int) -> SamplingParams:
    """Greedy, exactly `output_len` tokens: benchmarks must not end early on EOS."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def warm_up(engine, prompt_len: int = 16, output_len: int = 4) -> None:
    """One short request outside the timed region: first-call costs (allocator, lazy
    kernels, compile guards) must not be billed to the first measured requests."""
    vocab = engine.config.model.vocab_size
    max_len = engine.config.scheduler.max_model_len
    prompt = [(7 * i + 3) % vocab for i in range(min(prompt_len, max_len - output_len - 1))]
    req_id = engine.add_request({"prompt_token_ids": prompt}, bench_params(output_len),
                                request_id="bench-warmup")
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.abort(req_id)


def check_fits(requests: Sequence[BenchRequest], max_model_len: int) -> None:
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    if longest > max_model_len:
        raise BenchError(
            f"a request needs {longest} tokens (input + output), above max-model-len "
            f"{max_model_len}; shorten --input-len/--output-len or raise --max-model-len"
        )
