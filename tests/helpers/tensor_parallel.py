"""What the tensor-parallel tests share: engine settings small enough that the workload
of tests/helpers/workloads preempts and hits the prefix cache, and a run of it that
returns the tokens with the scheduler's counters."""

from __future__ import annotations

from tests.helpers.workloads import greedy_params, random_workload

# 32 blocks of 4 tokens for 12 running requests of up to 62 tokens: requests are preempted.
ENGINE = {"device": "cpu", "max_model_len": 96, "block_size": 4,
          "num_gpu_blocks_override": 32, "max_num_batched_tokens": 40, "max_num_seqs": 12,
          "seed": 0}


def run_workload(llm, seed: int = 3) -> tuple[list[list[int]], int, int]:
    """(greedy tokens per prompt, preemptions, prefix-cache hit tokens) of one workload
    with a shared 12-token prefix; the counters count this run only. Every KV block is
    free again at the end."""
    prompts, lengths = random_workload(seed, shared_prefix=12)
    engine = llm.engine
    before = engine.stats()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    after = engine.stats()
    manager = engine.scheduler.kv_cache_manager
    assert manager.get_num_free_blocks() == manager.num_usable_blocks
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    return ([list(o.outputs[0].token_ids) for o in outputs],
            after.num_preemptions - before.num_preemptions,
            after.prefix_cache_hits - before.prefix_cache_hits)
