"""vLLM's utility endpoints /tokenize and /detokenize: request bodies to engine queries,
and the engine's answer (the engine's own tokenizer, where prompts are tokenized for
generation too, so counts agree with a request's usage) back to HTTP."""

from __future__ import annotations

from llmfast.serve.api.errors import APIError
from llmfast.serve.api.protocol import DetokenizeRequest, TokenizeRequest
from llmfast.serve.api.sampling import chat_messages, chat_prompt
from llmfast.serve.frontend_types import (
    DetokenizeQuery,
    EngineFront,
    EngineUnavailable,
    Query,
    TokenizeQuery,
)
from llmfast.utils.errors import one_line


def tokenize_query(req: TokenizeRequest) -> TokenizeQuery:
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give either prompt or messages", param="prompt", code="invalid_value")
    if req.prompt is not None:
        for field in ("add_generation_prompt", "chat_template_kwargs"):
            if field in req.model_fields_set:
                raise APIError(f"{field} applies to messages only", param=field,
                               code="invalid_value")
        return TokenizeQuery(req.prompt, req.add_special_tokens)
    return TokenizeQuery(chat_prompt(chat_messages(req.messages), req.chat_template_kwargs),
                         req.add_special_tokens, req.add_generation_prompt)


def detokenize_query(req: DetokenizeRequest) -> DetokenizeQuery:
    return DetokenizeQuery(tuple(req.tokens))


async def ask(front: EngineFront, query: Query, param: str) -> list[int] | str:
    """The engine's answer; its refusal as a 400 naming `param`."""
    try:
        return await front.query(query)
    except EngineUnavailable as e:
        raise APIError(str(e), 503) from None
    except ValueError as e:  # TokenizerError (a chat template's), an id out of vocabulary
        raise APIError(one_line(e, max_chars=None), 400, param, "invalid_value") from None
