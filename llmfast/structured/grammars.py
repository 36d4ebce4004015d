"""A `StructuredOutputs` made into an xgrammar `Grammar` (no tokenizer needed): the check
the frontends run before a request reaches the engine (a bad schema, regex or grammar is
a one-line `StructuredOutputsError`), and the first half of the compile.

JSON is generated compact (no optional whitespace): a model cannot then pad an answer
with endless spaces or newlines until max_tokens, and the output is the same document.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import jsonschema

from llmfast.structured_params import StructuredOutputs, StructuredOutputsError
from llmfast.utils.errors import one_line

if TYPE_CHECKING:  # xgrammar imports transformers: loaded at the first constraint only
    import xgrammar as xgr


# xgrammar's C++ errors start "[05:04:52] /project/cpp/regex_converter.cc:94: ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def is_ebnf(text: str) -> bool:
    """GBNF-style EBNF defines rules with `::=`; Lark with `:`."""
    return "::=" in text


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for exactly one of `choices` (JSON string escapes are the EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(spec: StructuredOutputs) -> xgr.Grammar:
    """The grammar of `spec`; StructuredOutputsError (one line, naming the kind) when the
    schema, regex or grammar does not compile."""
    import xgrammar as xgr
    kind = spec.kind
    try:
        if kind == "json":
            check_schema(spec.json)
            return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False,
                                                strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
        if is_ebnf(spec.grammar):
            return xgr.Grammar.from_ebnf(spec.grammar)
        return xgr.Grammar.from_lark(spec.grammar)
    except StructuredOutputsError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError kinds
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[kind]
        raise StructuredOutputsError(
            f"invalid {what}: {_CPP_PREFIX.sub('', one_line(e))}") from None


def check_schema(schema_text: str) -> None:
    """A schema the JSON Schema meta-schema refuses (`{"type": 5}`) is refused here."""
    schema = json.loads(schema_text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(map(str, e.absolute_path))
        raise StructuredOutputsError(
            f"invalid JSON schema: {one_line(e)}" + (f" (at {path})" if path else "")) from None


def check_structured(spec: StructuredOutputs) -> None:
    """Raise StructuredOutputsError if `spec` does not make a grammar."""
    build_grammar(spec)
