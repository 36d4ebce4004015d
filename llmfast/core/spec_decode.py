"""Speculative decoding's host-side bookkeeping after a step: roll back the rejected
drafts, count the acceptance, keep the drafts proposed for the next step.

A request that verified K drafts was scheduled 1 + K tokens, so after `schedule()` its
num_computed_tokens counts all of them; the step emitted its accepted drafts and one
more token. E.g. 10 known tokens, 9 computed, drafts [d1 d2 d3] scheduled (num_computed
13 after schedule); the step emits [d1 d2 r]: 1 draft rejected, num_computed 12 -> the
12 tokens t0..t9 d1 d2 have valid KV, and r (token 12) is computed next step. Rolling
back before the tokens are appended (and before a finished request's blocks are freed
and cached) keeps the stale KV of rejected drafts out of the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmfast.core.request import Request, RequestStatus
from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


@dataclass
class SpecDecodeCounts:
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which accepted
    num_verify_steps: int = 0  # request-steps that verified drafts

    def rates(self) -> tuple[float, float]:
        return spec_rates(self.num_draft_tokens, self.num_accepted_tokens,
                          self.num_verify_steps)


def spec_rates(num_draft_tokens: int, num_accepted_tokens: int,
               num_verify_steps: int) -> tuple[float, float]:
    """(acceptance rate, mean accepted length): accepted / verified drafts, and tokens
    emitted per verify step (its accepted drafts plus the bonus or recovered token);
    (0.0, 0.0) before any verify step."""
    if not num_verify_steps:
        return 0.0, 0.0
    return (num_accepted_tokens / num_draft_tokens,
            (num_accepted_tokens + num_verify_steps) / num_verify_steps)


def apply_verify_results(requests: dict[str, Request], scheduler_output: SchedulerOutput,
                         model_runner_output: ModelRunnerOutput,
                         counts: SpecDecodeCounts) -> None:
    """The module doc's rollback and counts, for each request of the output still
    running (not finished since, not a later request reusing the id); then its next
    drafts."""
    step_index = scheduler_output.step_index
    scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
    proposals = model_runner_output.spec_token_ids
    for idx, (rid, sampled) in enumerate(
            zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids)):
        request = requests.get(rid)
        if (request is None or request.first_step > step_index
                or request.status is not RequestStatus.RUNNING):
            continue
        drafts = scheduled_drafts.get(rid)
        if drafts and sampled:
            num_accepted = len(sampled) - 1
            request.num_computed_tokens -= len(drafts) - num_accepted
            counts.num_draft_tokens += len(drafts)
            counts.num_accepted_tokens += num_accepted
            counts.num_verify_steps += 1
        if proposals is not None and sampled:
            request.spec_token_ids = proposals[idx]
