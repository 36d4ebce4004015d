"""The scheduler's statistics: a snapshot after a step (Scheduler.get_stats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    num_preemptions: int  # since start
    prefix_cache_queries: int  # tokens of admitted requests
    prefix_cache_hits: int  # of which found cached
    prefix_cache_hit_rate: float
    kv_cache_usage: float  # fraction of usable blocks held
    # Speculative decoding, since start: draft tokens verified, of which accepted, and
    # request-steps that verified drafts.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_verify_steps: int = 0
    # accepted / verified drafts, and tokens emitted per verify step (accepted + 1);
    # 0.0 before any verify step.
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
