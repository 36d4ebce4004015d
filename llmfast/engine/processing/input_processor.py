"""`InputProcessor`: a prompt and its sampling parameters made into an `EngineCoreRequest`
the core can run: text tokenized, token ids checked (ints, in the vocabulary), the
prompt's length checked against max-model-len and the KV cache, the parameters fitted to
the model. Everything the core would refuse is refused here, on the frontend's side: a
bad request never reaches the engine core's process."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from llmfast.core.request import RequestRejected, check_blocks_fit, check_prompt_length
from llmfast.engine.messages import EngineCoreRequest
from llmfast.sampling_params import SamplingParams
from llmfast.structured.grammars import check_structured
from llmfast.structured_params import StructuredOutputsError
from llmfast.tokenizer import Tokenizer
from llmfast.utils.value_checks import int_list

Prompt = str | list[int] | dict


@dataclass(frozen=True)
class CoreLimits:
    """What a request must fit: the model's and the KV cache's sizes."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_usable_blocks: int


def tokenize_prompt(prompt: Prompt, tokenizer: Tokenizer | None,
                    no_tokenizer_reason: Callable[[], str]) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: text is encoded by `tokenizer`, token ids
    (a list, or a dict with 'prompt_token_ids' and maybe its 'prompt' text) are checked
    to be ints. RequestRejected for anything else, or for text without a tokenizer."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise RequestRejected("a dict prompt needs 'prompt_token_ids'")
        ids = int_list(prompt["prompt_token_ids"], "prompt token ids", RequestRejected)
        return prompt.get("prompt"), ids
    if isinstance(prompt, list):
        return None, int_list(prompt, "prompt token ids", RequestRejected)
    if not isinstance(prompt, str):
        raise RequestRejected(
            f"a prompt must be a string or token ids, not {type(prompt).__name__}")
    if tokenizer is None:
        raise RequestRejected(f"{no_tokenizer_reason()}; pass prompt_token_ids instead of text")
    return prompt, tokenizer.encode(prompt)


class InputProcessor:
    def __init__(self, limits: CoreLimits, tokenizer: Tokenizer | None,
                 no_tokenizer_reason: Callable[[], str]) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.no_tokenizer_reason = no_tokenizer_reason

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(prompt, self.tokenizer, self.no_tokenizer_reason)

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """`params` as the core takes them (fitted to the model); RequestRejected for
        token ids outside the vocabulary, or a structured-output constraint that does not
        compile."""
        limits = self.limits
        params = params.fit_to_model(limits.vocab_size, limits.max_model_len)
        outside = params.token_ids_outside(limits.vocab_size)
        if outside is not None:
            raise RequestRejected(outside)
        if params.structured is not None:
            # The grammar is compiled against the vocabulary in the core: it needs one,
            # and a constraint that does not compile is refused here.
            if self.tokenizer is None:
                raise RequestRejected(f"structured outputs need the model's tokenizer: "
                                      f"{self.no_tokenizer_reason()}")
            try:
                check_structured(params.structured)
            except StructuredOutputsError as e:
                raise RequestRejected(str(e)) from None
        return params

    def check_prompt(self, ids: list[int]) -> None:
        """RequestRejected for prompt token ids the core would refuse whatever the
        parameters: ids outside the vocabulary, a length past max-model-len, more KV
        blocks than the cache has."""
        limits = self.limits
        check_prompt_length(len(ids), limits.max_model_len)
        vocab = limits.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        check_blocks_fit(len(ids), limits.block_size, limits.num_usable_blocks)

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams,
                arrival_time: float | None = None, client_index: int = 0
                ) -> tuple[str | None, EngineCoreRequest]:
        """The prompt's text (if any) and the request for the core."""
        params = self.check_params(params)
        text, ids = self.tokenize(prompt)
        self.check_prompt(ids)
        return text, EngineCoreRequest(
            request_id, ids, params,
            time.monotonic() if arrival_time is None else arrival_time, client_index)
