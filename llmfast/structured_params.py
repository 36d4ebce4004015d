"""`StructuredOutputs`: what a request's output must follow (vLLM's
`StructuredOutputsParams`): a JSON schema, any JSON object, a regular expression, one of
a list of strings, or a grammar (EBNF in xgrammar's GBNF dialect, `root ::= ...`, or
Lark). Exactly one is set. Only the shape is checked here; whether the schema, regex or
grammar compiles is the grammar engine's to say (llmfast/structured/grammars.py), before
the request reaches the engine core."""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmfast.utils.value_checks import describe

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    """An invalid constraint; the message is one user-facing line."""


@dataclass(frozen=True)
class StructuredOutputs:
    # A JSON schema: a dict, or its JSON text (held as compact text: hashable, and the
    # same schema spaced two ways is one grammar in the cache; key order is kept: the
    # output's properties come in the schema's order).
    json: str | dict | None = None
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # GBNF-style EBNF (`root ::= ...`) or Lark

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_schema(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise StructuredOutputsError(
                    f"choice must be a list of strings, got {describe(self.choice)}")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputsError("choice must be a non-empty list of non-empty "
                                             "strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise StructuredOutputsError(f"{name} must be a non-empty string, got "
                                             f"{describe(value)}")
        if not isinstance(self.json_object, bool):
            raise StructuredOutputsError(f"json_object must be True or False, got "
                                         f"{describe(self.json_object)}")
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise StructuredOutputsError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar (got {', '.join(set_) or 'none'})")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the grammar (the compile cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        return kind, value


def _canonical_schema(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise StructuredOutputsError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputsError(f"a JSON schema must be an object, got {describe(schema)}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
