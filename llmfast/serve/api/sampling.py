"""From an OpenAI request body to engine inputs: prompts and one SamplingParams per choice.

Value ranges are `SamplingParams`' own checks (its message becomes the 400); this file
adds what only the API knows: n, unsupported fields, prompt shapes, chat messages.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from llmfast.sampling_params import SamplingParams, SamplingParamsError
from llmfast.serve.api.errors import APIError
from llmfast.serve.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _SamplingFields,
)
from llmfast.serve.api.structured import request_constraint
from llmfast.serve.api.tools import ToolMode, tool_mode
from llmfast.serve.frontend_types import ChatPrompt, Limits, PromptInput
from llmfast.structured_params import StructuredOutputs

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's, for /v1/completions


@dataclass(frozen=True)
class EngineInputs:
    prompts: list[PromptInput]
    params: list[SamplingParams]  # len(prompts) * n, prompt-major
    n: int
    # The client set max_tokens: a prompt + max_tokens past the context is then a 400
    # (vLLM, OpenAI); a default max_tokens is cut to the context's end instead.
    max_tokens_given: bool = False
    # echo with max_tokens 0 (scoring the prompt, lm-eval's loglikelihood): the engine
    # generates one token, as vLLM's does, and the response leaves it out.
    scoring_only: bool = False
    # Chat with tools (not tool_choice "none"): how the output becomes tool calls.
    tools: ToolMode | None = None


def completion_inputs(req: CompletionRequest, limits: Limits) -> EngineInputs:
    _check_stream_options(req)
    if req.suffix is not None:
        raise APIError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of other than n is not supported", param="best_of")
    prompts = _completion_prompts(req.prompt)
    for prompt in prompts:
        if isinstance(prompt, str):
            _check_prompt_chars(len(prompt), limits, "prompt")
    # null means the default, as absent does.
    given = "max_tokens" in req.model_fields_set and req.max_tokens is not None
    max_tokens = req.max_tokens if given else _default_max_tokens(
        limits, COMPLETION_DEFAULT_MAX_TOKENS)
    scoring_only = given and req.echo and max_tokens == 0
    # vLLM's rule: echo with logprobs returns the prompt's tokens' logprobs too.
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    base = _sampling_params(req, 1 if scoring_only else max_tokens, req.logprobs, limits,
                            prompt_logprobs, request_constraint(req))
    choices = _per_choice(base, req.n)
    return EngineInputs(prompts, [p for _ in prompts for p in choices], req.n, given,
                        scoring_only)


def chat_inputs(req: ChatCompletionRequest, limits: Limits) -> EngineInputs:
    _check_stream_options(req)
    messages = chat_messages(req.messages)
    _check_prompt_chars(sum(len(m["content"]) for m in messages), limits, "messages")
    tools = tool_mode(req, limits.tool_call_parser)
    constraint = request_constraint(req)
    if tools is not None and tools.constraint is not None:
        if constraint is not None:
            raise APIError("tool_choice 'required' or a named function cannot be combined "
                           "with another output constraint", param="tool_choice")
        constraint = tools.constraint
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    given = max_tokens is not None
    if max_tokens is None:  # OpenAI's default: up to the context length
        max_tokens = _default_max_tokens(limits, limits.max_model_len)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    base = _sampling_params(req, max_tokens, logprobs, limits, req.prompt_logprobs, constraint)
    prompt = chat_prompt(messages, req.chat_template_kwargs,
                         tools.template_tools if tools is not None else None)
    return EngineInputs([prompt], _per_choice(base, req.n), req.n, given, tools=tools)


def _check_prompt_chars(num_chars: int, limits: Limits, param: str) -> None:
    """Text that cannot fit the context whatever it says is refused here, in O(1), rather
    than after the engine spent seconds tokenizing it (holding every other request up:
    an 8M-character prompt took ~15 s on the CPU)."""
    bound = limits.max_prompt_chars
    if bound is not None and num_chars > bound:
        raise APIError(f"the prompt's {num_chars} characters cannot fit max-model-len "
                       f"{limits.max_model_len} tokens (with this tokenizer, no text past "
                       f"{bound} characters does)", 400, param, "context_length_exceeded")


def chat_prompt(messages: tuple[dict, ...], template_kwargs: dict | None,
                tools: tuple[dict, ...] | None = None) -> ChatPrompt:
    return ChatPrompt(messages, tuple((template_kwargs or {}).items()), tools)


def chat_messages(messages: list[ChatMessage]) -> tuple[dict, ...]:
    """The messages as the chat template takes them (text parts joined; an assistant's
    tool calls and a tool answer's call id kept)."""
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    out = []
    for m in messages:
        message = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            message["name"] = m.name
        out.append(message)
    return tuple(out)


def _default_max_tokens(limits: Limits, fallback: int) -> int:
    """A request's max tokens when it gives none: `fallback` (the API's default), or the
    model's max_new_tokens where that is fewer (vLLM takes the least that applies)."""
    return min(fallback, dict(limits.sampling_defaults).get("max_tokens", fallback))


def _check_stream_options(req: _SamplingFields) -> None:
    # As vLLM: the prompt_logprobs field has no place in streamed chunks (completions'
    # echo with logprobs streams the prompt's in its own format).
    if req.stream and req.prompt_logprobs is not None:
        raise APIError("prompt_logprobs is not available with stream: true",
                       param="prompt_logprobs")
    # vLLM's rule and words. As there, an empty object (or null) passes: vLLM tests the
    # raw value's truth, and `{}` sets no field.
    if req.stream_options is not None and req.stream_options.model_fields_set \
            and not req.stream:
        raise APIError("Stream options can only be defined when `stream=True`.",
                       param="stream_options", code="invalid_value")


def _completion_prompts(prompt) -> list[PromptInput]:
    if isinstance(prompt, str):
        prompts: list[PromptInput] = [prompt]
    elif prompt and isinstance(prompt[0], list):
        prompts = [list(p) for p in prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError("prompt must not be empty", param="prompt")
    return prompts


def _sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                     limits: Limits, prompt_logprobs: int | None = None,
                     structured: StructuredOutputs | None = None) -> SamplingParams:
    if not 1 <= req.n <= limits.max_n:
        raise APIError(f"n must be in [1, {limits.max_n}] (the server's max-num-seqs), "
                       f"got {req.n}", param="n")
    given = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "seed": req.seed,
        "max_tokens": max_tokens, "min_tokens": req.min_tokens,
    }
    # The model's defaults (generation_config.json) for what the request leaves unset.
    kwargs = {k: v for k, v in limits.sampling_defaults if k != "max_tokens"}
    kwargs.update((k, v) for k, v in given.items() if v is not None)
    stop = req.stop
    try:
        params = SamplingParams(
            **kwargs,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            structured=structured,
        )
    except SamplingParamsError as e:
        field = str(e).split(" ", 1)[0]
        message = str(e)
        if isinstance(req, ChatCompletionRequest):  # name the field the client sent
            if field == "logprobs":
                field = "top_logprobs"
                message = message.replace("logprobs", field, 1)
            elif field == "max_tokens" and req.max_completion_tokens is not None:
                field = "max_completion_tokens"
                message = message.replace("max_tokens", field, 1)
        raise APIError(message, param=field if field in req.model_fields else None) from None
    outside = limits.vocab_size and params.token_ids_outside(limits.vocab_size)
    if outside:
        raise APIError(outside, param=outside.split(" ", 1)[0])
    return params


# A token id as OpenAI's logit_bias writes it: ASCII digits only (`int` also takes " 5 ",
# "1_0" and other scripts' digits) and short enough for `int` (a key of 5000 digits
# raises); a minus sign passes, for the vocabulary check to name the id.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias names tokens by their ids written as strings."""
    if not bias:
        return None
    bad = next((key for key in bias if not _TOKEN_ID_KEY.fullmatch(key)), None)
    if bad is not None:
        shown = bad if len(bad) <= 40 else f"{bad[:37]}..."
        raise APIError(f"logit_bias keys must be token ids written as integers, got {shown!r}",
                       param="logit_bias")
    return {int(key): value for key, value in bias.items()}


def _per_choice(base: SamplingParams, n: int) -> list[SamplingParams]:
    """n copies; with a seed, choice i samples with seed + i so the n choices differ (and
    each is still reproducible)."""
    if n == 1 or base.seed is None:
        return [base] * n
    return [dataclasses.replace(base, seed=base.seed + i) for i in range(n)]
