"""Request bodies of the OpenAI API, as strict pydantic models with OpenAI's field names.

Strict: a number where a string belongs (or "5" where a number belongs) is a 400, as on
OpenAI's own API; unknown fields are refused rather than silently ignored. Value ranges
are checked once, by `SamplingParams`, when the request becomes engine requests. Besides
OpenAI's fields the models take vLLM's common extras (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, allowed_token_ids, prompt_logprobs, ...), which the
`openai` client passes via extra_body.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# What a union-typed field accepts, for the 400 message when a value fits none of them.
UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # Fields OpenAI's spec allows to be null that have a non-null default here: null means
    # the default (clients that send every field, unset ones as null, rely on it).
    null_means_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _defaults_for_nulls(cls, data):
        if isinstance(data, dict) and cls.null_means_default:
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.null_means_default}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields completions and chat share."""

    null_means_default: ClassVar[frozenset[str]] = frozenset({"n", "stream"})
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    # OpenAI fields about the account or the record, not the generation: accepted (SDK
    # wrappers send them), unused.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI's) -> bias
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    # vLLM's structured outputs: {"json" | "json_object" | "regex" | "choice" | "grammar":
    # ...}, and its older guided_* fields (serve/api/structured.py).
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    null_means_default: ClassVar[frozenset[str]] = frozenset({"n", "stream", "echo"})
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # refused unless equal to n
    suffix: str | None = None  # refused


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    null_means_default: ClassVar[frozenset[str]] = frozenset({"n", "stream", "logprobs"})
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extra: more variables for the chat template (Qwen3's enable_thinking, ...).
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a completion's `prompt`, or a chat's `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # None: as a completion / chat request does
    chat_template_kwargs: dict[str, Any] | None = None  # messages only


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize."""

    model: str | None = None
    tokens: list[int]
