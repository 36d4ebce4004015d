"""Which requests get draft tokens.

The rejection sampler verifies drafts under every sampling feature that depends only on
the target's logits, the request's tokens and its position (temperature, top-k/p, min-p,
seeds, penalties, min_tokens, logit_bias / allowed_token_ids, sample logprobs). A request
using one of the others simply gets no drafts: it decodes one token a step as without
speculation, in the same steps as drafting requests.
- structured outputs: the grammar's mask at draft position i needs the matcher advanced
  over the drafts before it (and rolled back over the rejected ones), which the grammar
  side does not do yet;
- prompt logprobs: the prompt's scoring plan (sampling/prompt_logprobs.py) assumes a
  step's query tokens are all final.
"""

from __future__ import annotations

from llmfast.sampling_params import SamplingParams


def drafts_allowed(params: SamplingParams) -> bool:
    return params.structured is None and params.prompt_logprobs is None
