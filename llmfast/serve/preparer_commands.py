"""What the frontend hands its prompt preparer (prompt_preparer.py): an add's prompts to
tokenize, or a tokenizer query. Plain frozen records; `done` and `stream` are the
frontend's own handles, passed back untouched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmfast.sampling_params import SamplingParams
from llmfast.serve.frontend_types import PromptInput, Query


@dataclass(frozen=True, slots=True)
class AddCommand:
    stream: Any  # the carrier's handle of the HTTP request; has `.engine_ids`
    prompts: tuple[PromptInput, ...]
    params: tuple[SamplingParams, ...]  # one per choice, prompt-major
    done: Any  # how the carrier answers this add (a future, an id)
    with_text: bool  # decode token-id prompts for the response
    # The client gave max_tokens: a prompt + max_tokens past max-model-len is refused
    # (vLLM, OpenAI). Otherwise (a default max_tokens) generation stops at the context's end.
    check_length: bool = False


@dataclass(frozen=True, slots=True)
class QueryCommand:
    """Tokenizer work for /tokenize and /detokenize, with the frontend's tokenizer (the
    one its requests are tokenized with, so counts agree with a request's usage)."""

    query: Query
    done: Any  # as `AddCommand.done`
