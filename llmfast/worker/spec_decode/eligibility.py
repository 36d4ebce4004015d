"""Which requests get draft tokens.

A request whose sampling depends on more than the target's logits at one position, or
that wants outputs the verify step does not produce, simply gets no drafts (it decodes
one token a step as without speculation, in the same batch as drafting requests):
- penalties (repetition, presence, frequency) and min_tokens: the logits of draft
  position i depend on the drafts before it being accepted or not;
- structured outputs: the grammar's mask of draft position i needs the matcher advanced
  over the drafts before it;
- logit_bias / allowed_token_ids, sample logprobs and prompt logprobs: not wired into
  the verify step yet.
"""

from __future__ import annotations

from llmfast.sampling_params import SamplingParams


def drafts_allowed(params: SamplingParams) -> bool:
    return (params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.min_tokens == 0
            and params.structured is None and not params.has_logit_rules
            and params.logprobs is None and params.prompt_logprobs is None)
