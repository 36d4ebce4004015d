"""Engine workloads shared by the CPU and GPU engine tests: random prompts (optionally
behind a shared prefix) with random greedy output lengths."""

from __future__ import annotations

import random

from llmfast import SamplingParams

NUM_PROMPTS = 16


def random_workload(seed: int, shared_prefix: int = 0) -> tuple[list[list[int]], list[int]]:
    """NUM_PROMPTS prompts of 1-39 token ids in [3, 256) after `shared_prefix` common
    ids, and an output length in [1, 12) for each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(shared_prefix)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))]
               for _ in range(NUM_PROMPTS)]
    lengths = [rng.randrange(1, 12) for _ in range(NUM_PROMPTS)]
    return prompts, lengths


def greedy_params(lengths: list[int]) -> list[SamplingParams]:
    """Greedy, exactly `n` tokens each (eos ignored)."""
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
