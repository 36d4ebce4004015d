"""Tool-call parsers on fixed strings (each model family's format, prose around calls,
malformed calls that stay text), the streamed form of a choice's text (content held back
where a call may begin, then each call's id and name before its arguments), the parser a
model's template picks, and the chat template receiving the tools."""

from __future__ import annotations

import json

import pytest

from llmfast.serve.api.protocol import ChatCompletionRequest
from llmfast.serve.api.tool_parsers import (
    ParsedToolCall,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parse_required,
    parser_for,
)
from llmfast.serve.api.tools import ToolMode, tool_mode

W = ParsedToolCall("get_weather", json.dumps({"city": "Paris"}))
T = ParsedToolCall("get_time", json.dumps({"tz": "UTC+1"}))


@pytest.mark.parametrize("parse, text, expected", [
    (parse_hermes, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                   '</tool_call>', (None, [W])),
    (parse_hermes, 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": '
                   '{"city": "Paris"}}</tool_call>\n<tool_call>{"name": "get_time", '
                   '"arguments": {"tz": "UTC+1"}}</tool_call>', ("Let me check.", [W, T])),
    (parse_hermes, "It is sunny.", ("It is sunny.", [])),
    (parse_hermes, '<tool_call>{"name": "get_weather", "arguments": {"city": ',
     ('<tool_call>{"name": "get_weather", "arguments": {"city": ', [])),
    (parse_llama3_json, '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     (None, [W])),
    (parse_llama3_json, '<|python_tag|>{"name": "get_weather", "parameters": {"city": '
                        '"Paris"}}; {"name": "get_time", "parameters": {"tz": "UTC+1"}}',
     (None, [W, T])),
    (parse_llama3_json, '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
     (None, [W])),
    (parse_llama3_json, "Paris is in France.", ("Paris is in France.", [])),
    (parse_llama3_json, '{"city": "Paris"}', ('{"city": "Paris"}', [])),
    (parse_mistral, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                    '{"name": "get_time", "arguments": {"tz": "UTC+1"}}]', (None, [W, T])),
    (parse_mistral, 'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC+1"}}]',
     ("Sure.", [T])),
    (parse_mistral, "[TOOL_CALLS] not json", ("[TOOL_CALLS] not json", [])),
    (parse_required, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', (None, [W])),
])
def test_parsers(parse, text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("arch, template, parser", [
    ("Qwen2ForCausalLM", "{% if tools %}<tool_call>{% endif %}", "hermes"),
    ("MistralForCausalLM", "[TOOL_CALLS]", "mistral"),
    ("LlamaForCausalLM", "{{ '<|python_tag|>' }} tools", "llama3_json"),
    ("LlamaForCausalLM", None, "hermes"),
    ("MistralForCausalLM", None, "mistral"),
])
def test_parser_from_template_and_family(arch, template, parser):
    assert parser_for(arch, template) == parser


def _stream(mode: ToolMode, pieces: list[str]) -> tuple[str, dict]:
    """The content and the calls (index -> name, joined arguments) a client would read."""
    stream = mode.stream()
    content, calls = "", {}
    outs = [stream.feed(p) for p in pieces] + [stream.finish()]
    for text, deltas in outs:
        content += text
        for d in deltas:
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function"
                calls[d["index"]] = [d["function"]["name"], ""]
            else:
                assert "name" not in d["function"]
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, calls


def test_streamed_hermes_holds_back_a_split_marker():
    mode = ToolMode("auto", "hermes", ())
    text = ('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call>')
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # the marker split up
    stream = mode.stream()
    sent = "".join(stream.feed(p)[0] for p in pieces)
    assert sent == "Checking."  # nothing of the marker leaked as content
    content, calls = _stream(mode, pieces)
    assert content == "Checking."
    assert calls == {0: ["get_weather", W.arguments]}


def test_streamed_auto_prose_passes_through():
    for parser in ("hermes", "llama3_json", "mistral"):
        content, calls = _stream(ToolMode("auto", parser, ()), ["Hello", " <to", "day> ok"])
        assert content == "Hello <today> ok" and not calls, parser


def test_streamed_llama3_json_call():
    content, calls = _stream(ToolMode("auto", "llama3_json", ()),
                             [' {"name": "get_time", ', '"parameters": {"tz": "UTC+1"}}'])
    assert content == "" and calls == {0: ["get_time", T.arguments]}


def test_streamed_named_function_streams_arguments_as_generated():
    mode = ToolMode("named", "hermes", (), name="get_weather")
    stream = mode.stream()
    first = stream.feed('{"city"')
    assert first[1][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1][1]["function"] == {"arguments": '{"city"'}
    assert _stream(mode, ['{"city"', ': "Paris"}']) == ("", {0: ["get_weather",
                                                                 '{"city": "Paris"}']})


def test_tool_mode_passes_tools_to_the_template(serve_model_dir):
    from llmfast.tokenizer import load_tokenizer

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    mode = tool_mode(req, None)
    assert mode.choice == "auto" and mode.parser == "hermes"
    tok = load_tokenizer(serve_model_dir).with_chat_template(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tok.render_chat([{"role": "user", "content": "hi"}],
                           tools=mode.template_tools) == "[get_weather]hi"
    # tool_choice "none": no tools for the template, no parsing.
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
         "tool_choice": "none"})
    assert tool_mode(req, None) is None


def test_streamed_required_calls_go_out_as_each_closes():
    mode = ToolMode("required", "hermes", ())
    stream = mode.stream()
    first = '[{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert stream.feed(first[:-3]) == ("", [])  # not closed yet
    content, deltas = stream.feed(first[-3:] + ', {"name": "get_t')
    assert content == "" and [d["index"] for d in deltas] == [0, 0]
    assert deltas[0]["function"]["name"] == "get_weather"
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Paris"}
    assert stream.feed('ime", "parameters": {"tz": "UTC+1"}}')[1][0]["index"] == 1
    assert stream.feed("]") == ("", []) and stream.finish() == ("", [])
    pieces = [first, ', {"name": "get_time", "parameters": {"tz": "UTC+1"}}]']
    assert _stream(mode, pieces) == ("", {0: ["get_weather", W.arguments],
                                          1: ["get_time", T.arguments]})
