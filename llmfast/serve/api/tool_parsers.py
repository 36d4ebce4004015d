"""Tool calls read from a model's own output format (tool_choice "auto"), and from the
format the grammar forces (tool_choice "required").

- `hermes` (Qwen 2/2.5/3, Hermes, ChatML models): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, any number, with text around them.
- `llama3_json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}`
  (or `"arguments"`), maybe after `<|python_tag|>`, several joined by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
- `required`: a JSON array `[{"name": ..., "parameters": {...}}, ...]` (tools.py's grammar).

A parser returns (the text that is not a call, or None; the calls). Output that does not
parse as calls stays text: the model answered in prose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


Parsed = tuple[str | None, list[ParsedToolCall]]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_START, MISTRAL_START, PYTHON_TAG = "<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"


def _call(obj: object, args_keys: tuple[str, ...] = ("arguments", "parameters")
          ) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(objs: list) -> list[ParsedToolCall] | None:
    calls = [_call(o) for o in objs]
    return None if not calls or None in calls else calls


def parse_hermes(text: str) -> Parsed:
    if HERMES_START not in text:
        return text, []
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = _call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[: text.index(HERMES_START)].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> Parsed:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    objs, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        objs.append(obj)
        i = end
        while i < len(body) and body[i] in " \t\n;":
            i += 1
    calls = _calls(objs)
    return (text, []) if calls is None else (None, calls)


def parse_mistral(text: str) -> Parsed:
    if MISTRAL_START not in text:
        return text, []
    head, _, body = text.partition(MISTRAL_START)
    try:
        objs = json.loads(body.strip())
    except json.JSONDecodeError:
        return text, []
    calls = _calls(objs if isinstance(objs, list) else [objs])
    if calls is None:
        return text, []
    return head.strip() or None, calls


def parse_required(text: str) -> Parsed:
    """The forced array (tools.py's grammar for tool_choice "required")."""
    try:
        objs = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    calls = _calls(objs) if isinstance(objs, list) else None
    return (text, []) if calls is None else (None, calls)


PARSERS: dict[str, Callable[[str], Parsed]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}
# Where a call can begin, per parser: streamed text is held back from there.
CALL_STARTS = {"hermes": HERMES_START, "mistral": MISTRAL_START}


def parser_for(architecture: str, chat_template: str | None) -> str:
    """The parser a model's own format needs: from its chat template's markers, else
    its family."""
    template = chat_template or ""
    if HERMES_START in template:
        return "hermes"
    if MISTRAL_START in template:
        return "mistral"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    arch = architecture.lower()
    if "mistral" in arch or "mixtral" in arch:
        return "mistral"
    if "llama" in arch and "tools" in template:
        return "llama3_json"
    return "hermes"  # Qwen, Hermes and ChatML models
