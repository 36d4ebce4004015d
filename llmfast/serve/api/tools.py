"""Tools on chat completions: `tools` and `tool_choice` made into what the engine runs
and how its output becomes OpenAI tool calls.

- "none" (or no tools): plain chat; the template gets no tools.
- "required": a grammar forces a JSON array of one or more `{"name": ..., "parameters":
  {...}}`, each valid against its tool's parameter schema, so any model (a random test
  model too) calls tools.
- a named function: a grammar forces that function's arguments object.
- "auto": the model answers as it likes, in its own format (tool_parsers.py), read back.

The chat template receives the tools in every case but "none". Streaming follows
OpenAI's chunks: a call's first delta carries its index, id, type and function name,
later ones argument fragments (a named function's arguments stream as generated;
required's calls go out each as its object closes, auto's once the output is read).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from llmfast.serve.api.errors import APIError
from llmfast.serve.api.protocol import ChatCompletionRequest
from llmfast.serve.api.structured import checked
from llmfast.serve.api.tool_parsers import (
    CALL_STARTS,
    PARSERS,
    PYTHON_TAG,
    Parsed,
    ParsedToolCall,
    parse_required,
)
from llmfast.structured_params import StructuredOutputs

_ANY_OBJECT = {"type": "object"}
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolMode:
    choice: str  # "auto", "required" or "named"
    parser: str  # auto's: a key of PARSERS
    template_tools: tuple[dict, ...]
    constraint: StructuredOutputs | None = None  # required / named
    name: str | None = None  # named

    def parse(self, text: str) -> Parsed:
        if self.choice == "named":
            return None, [ParsedToolCall(self.name, text)]
        if self.choice == "required":
            return parse_required(text)
        return PARSERS[self.parser](text)

    def stream(self) -> ToolStream:
        return ToolStream(self)


def tool_mode(req: ChatCompletionRequest, parser: str | None) -> ToolMode | None:
    """None for a chat without tools (or tool_choice "none"); APIError (400) for a
    tool_choice without tools, an unknown named function, a parameter schema that does
    not compile."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    _check_tools(req.tools)
    if choice == "none":
        return None
    schemas = {}
    for tool in req.tools:
        params = tool.function.parameters or _ANY_OBJECT
        checked("tools", json=params)  # a 400 naming the cause if it does not compile
        schemas[tool.function.name] = params
    template_tools = tuple(t.model_dump(by_alias=True, exclude_none=True) for t in req.tools)
    parser = parser or "hermes"
    if choice is None or choice == "auto":
        return ToolMode("auto", parser, template_tools)
    if choice == "required":
        calls = {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, params in schemas.items()]}
        array = {"type": "array", "items": calls, "minItems": 1}
        if req.parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolMode("required", parser, template_tools,
                        checked("tool_choice", json=array))
    name = choice.function.name
    if name not in schemas:
        raise APIError(f"tool_choice names function {name!r}, which is not in tools "
                       f"({', '.join(map(repr, schemas))})", param="tool_choice")
    return ToolMode("named", parser, template_tools, checked("tools", json=schemas[name]),
                    name)


def _check_tools(tools: list) -> None:
    """400s for definitions a call could not be made from, or made from unambiguously:
    an empty or repeated name (a call names its function; the second definition would
    silently replace the first), parameters that are not an object schema (a call's
    arguments are a JSON object, so no call could match)."""
    seen = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not name:
            raise APIError(f"tools[{i}].function.name is empty", param="tools")
        if name in seen:
            raise APIError(f"tools[{i}].function.name {name!r} is given twice; function "
                           "names must be unique", param="tools")
        seen.add(name)
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema of type "
                           f"'object' (a call's arguments are an object), got type {kind!r}",
                           param="tools")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_tool_calls(calls: list[ParsedToolCall]) -> list[dict]:
    return [{"id": call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


@dataclass
class ToolStream:
    """One streamed choice's text turned into content and tool-call deltas."""

    mode: ToolMode
    text: str = ""  # everything generated so far
    sent: int = 0  # chars of `text` sent as content
    holding: bool = False  # a call may have begun: hold the text from `sent` on
    num_calls: int = 0
    _pos: int = 0  # required: where the forced array's next call begins
    _id: str = field(default_factory=call_id)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send) for newly generated text."""
        self.text += delta
        mode = self.mode
        if mode.choice == "named":
            out = []
            if not self.num_calls:
                self.num_calls = 1
                out.append({"index": 0, "id": self._id, "type": "function",
                            "function": {"name": mode.name, "arguments": ""}})
            if delta:
                out.append({"index": 0, "function": {"arguments": delta}})
            return "", out
        if mode.choice == "required":
            return "", self._required_calls()
        if self.holding:
            return "", []
        return self._content(), []

    def _required_calls(self) -> list[dict]:
        """required: the calls of the forced array that are complete by now (each goes
        out once its object closes)."""
        text, i = self.text, self._pos
        if not i:
            i = text.find("[") + 1
            if not i:
                return []
        out = []
        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i >= len(text) or text[i] != "{":
                break
            try:
                _, end = _DECODER.raw_decode(text, i)
            except json.JSONDecodeError:  # not closed yet
                break
            _, calls = parse_required(f"[{text[i:end]}]")
            out += self._call_deltas(calls)
            i = end
        self._pos = i
        return out

    def _call_deltas(self, calls: list[ParsedToolCall]) -> list[dict]:
        """Two deltas a call: index, id, type and name; then its arguments."""
        out = []
        for call in calls:
            i = self.num_calls
            self.num_calls += 1
            out.append({"index": i, "id": call_id() if i else self._id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}})
            out.append({"index": i, "function": {"arguments": call.arguments}})
        return out

    def _content(self) -> str:
        """auto: send what cannot be the start of a call; hold the rest."""
        text, start = self.text, CALL_STARTS.get(self.mode.parser)
        if start is None:  # llama3_json: a call is the whole output, from its start
            head = text.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG) or (
                    head and PYTHON_TAG.startswith(head)) or not head:
                self.holding = bool(head)
                return ""
            end = len(text)
        elif start in text[self.sent:]:
            end = text.index(start, self.sent)
            self.holding = True
        else:  # keep back a tail that may be the start marker's beginning
            end = len(text)
            for k in range(min(len(start) - 1, len(text) - self.sent), 0, -1):
                if start.startswith(text[-k:]):
                    end = len(text) - k
                    break
        out, self.sent = text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """At the end: the held text as calls (two deltas each: id and name, then the
        arguments), or as content if it does not parse as calls."""
        if self.mode.choice == "named":
            return "", []
        if self.mode.choice == "required":  # the calls went out as they closed
            return "", self._required_calls()
        _, calls = self.mode.parse(self.text)
        rest, self.sent = self.text[self.sent:], len(self.text)
        if not calls:
            return rest, []
        # The text before the first call went out as content already (`_content` sends
        # up to the call's start): what is held is the calls.
        return "", self._call_deltas(calls)
