"""`llmfast generate --json-schema FILE / --regex / --choice / --grammar FILE`: outputs of
a tiny random model follow the constraint; bad input is one line and a non-zero exit,
before any model loads."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.helpers.cli import assert_one_line_error, invoke

SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}},
    "required": ["answer", "n", "tags"], "additionalProperties": False}


def _texts(serve_model_dir, tmp_path, *flags: str) -> list[str]:
    out = tmp_path / "out.json"
    result = invoke("generate", "--model", str(serve_model_dir), "--device", "cpu",
                    "--max-tokens", "120", "--temperature", "1", "--seed", "3",
                    "--json", str(out), *flags, "hello there", "Tell me a story")
    assert result.exit_code == 0, result.output
    return [r["text"] for r in json.loads(out.read_text())]


def test_json_schema_file(serve_model_dir, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    for text in _texts(serve_model_dir, tmp_path, "--json-schema", str(path)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_choice_and_grammar(serve_model_dir, tmp_path):
    for text in _texts(serve_model_dir, tmp_path, "--regex", r"[0-9]{2}:[0-9]{2}"):
        assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", text)
    for text in _texts(serve_model_dir, tmp_path, "--choice", "red, green,blue"):
        assert text in ("red", "green", "blue")
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "<" [a-c] [a-c]? ">"')
    for text in _texts(serve_model_dir, tmp_path, "--grammar", str(grammar)):
        assert re.fullmatch(r"<[a-c]{1,2}>", text)


@pytest.mark.parametrize("flags, fragment", [
    (["--regex", "[a-"], "'--regex': invalid regex"),
    (["--choice", " , "], "'--choice': choice must be a non-empty list"),
    (["--json-schema", "/nonexistent/schema.json"], "cannot read /nonexistent/schema.json"),
    (["--regex", "a", "--choice", "b"], "one output constraint at a time"),
])
def test_bad_constraints_are_one_line_errors(flags, fragment):
    # A model that does not exist: the flags are refused before any model is looked at.
    result = invoke("generate", "--model", "/nonexistent/model", *flags, "hi")
    assert_one_line_error(result, fragment)


def test_a_schema_that_does_not_compile(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"type": "object", "properties": {"a": {"type": 5}}}')
    result = invoke("generate", "--model", "/nonexistent/model", "--json-schema", str(path), "x")
    assert_one_line_error(result, "'--json-schema': invalid JSON schema")
    path.write_text("{not json")
    result = invoke("generate", "--model", "/nonexistent/model", "--json-schema", str(path), "x")
    assert_one_line_error(result, "not valid JSON")
