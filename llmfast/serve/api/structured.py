"""A request's output constraint (`StructuredOutputs`) from OpenAI's `response_format`
(`json_object`, `json_schema`) and vLLM's extras (`structured_outputs`: {json, json_object,
regex, choice, grammar}; the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`). The grammar is built here, in the API process: a schema, regex or
grammar that does not compile is a 400 naming the cause, and nothing reaches the engine."""

from __future__ import annotations

from typing import Any

from llmfast.serve.api.errors import APIError
from llmfast.serve.api.protocol import ChatCompletionRequest, _SamplingFields
from llmfast.structured.grammars import check_structured
from llmfast.structured_params import KINDS, StructuredOutputs, StructuredOutputsError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def request_constraint(req: _SamplingFields) -> StructuredOutputs | None:
    """The request's constraint, checked; None when it has none. APIError (400) for
    more than one, an unknown kind, or one that does not compile."""
    found: list[tuple[str, dict[str, Any]]] = []  # (the field that set it, its kwargs)
    if isinstance(req, ChatCompletionRequest) and req.response_format is not None:
        rf = req.response_format
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError("response_format json_schema needs json_schema.schema",
                               param="response_format")
            found.append(("response_format", {"json": rf.json_schema.schema_}))
    if req.structured_outputs:
        so = dict(req.structured_outputs)
        unknown = sorted(set(so) - set(KINDS))
        if unknown:
            raise APIError(f"structured_outputs: unsupported field {unknown[0]!r} (supported: "
                           f"{', '.join(KINDS)})", param="structured_outputs")
        kwargs = {k: v for k, v in so.items() if v is not None and v is not False}
        if kwargs:
            found.append(("structured_outputs", kwargs))
    for field, kind in _GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            found.append((field, {kind: value}))
    if not found:
        return None
    if len(found) > 1 or len(found[0][1]) > 1:
        names = [f"{f}.{k}" if f == "structured_outputs" else f for f, kw in found for k in kw]
        raise APIError(f"a request takes one output constraint, got {', '.join(names)}",
                       param=found[-1][0])
    field, kwargs = found[0]
    return checked(field, **kwargs)


def checked(param: str, **kwargs: Any) -> StructuredOutputs:
    """StructuredOutputs(**kwargs) whose grammar compiles; else APIError naming `param`."""
    try:
        spec = StructuredOutputs(**kwargs)
        check_structured(spec)
    except StructuredOutputsError as e:
        raise APIError(str(e), param=param) from None
    return spec
