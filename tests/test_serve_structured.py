"""Structured outputs and tool calls through `llmfast serve` with the real `openai`
client, on a tiny random model (so only the grammar makes the outputs valid):
response_format json_object / json_schema, vLLM's structured_outputs and guided_*
fields, tool_choice required / named / auto / none, streaming tool calls; invalid
schemas, regexes, grammars and unknown tools are 400s naming the cause."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

ITEM = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    "qty": {"type": "integer", "minimum": 1, "maximum": 20},
    "price": {"type": "number", "minimum": 0, "maximum": 1000}},
    "required": ["sku", "qty"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1000, "maximum": 9999},
    "status": {"enum": ["new", "paid", "shipped"]},
    "items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 3},
    "customer": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
        "vip": {"type": "boolean"}}, "required": ["name", "vip"],
        "additionalProperties": False}},
    "required": ["id", "status", "items", "customer"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string", "pattern": "^UTC[+-][0-9]$"}}, "required": ["tz"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "hello there, how are you today?"}]


@pytest.fixture(scope="module")
def server(shared_servers):
    """The shared server with its API process (tests/conftest.py): its start is the cost
    of this file, and one of the server files before it on this worker may have paid it."""
    return shared_servers(1)


def _chat(client, model, temperature, **kw):
    kw = {"max_tokens": 300, "seed": 7, **kw}
    return client.chat.completions.create(model=model, messages=MESSAGES,
                                          temperature=temperature, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(client, model, temperature):
    rf = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER,
                                                 "strict": True}}
    out = _chat(client, model, temperature, response_format=rf, n=3)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ORDER)


def test_json_object(client, model):
    outs = [_chat(client, model, 1.0, response_format={"type": "json_object"},
                  seed=s).choices[0] for s in range(6)]
    done = [c for c in outs if c.finish_reason == "stop"]
    assert done
    for c in done:
        assert isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"regex": r"[a-z]{3}-[0-9]{2}"}},
     lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
     lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"guided_json": ITEM}, lambda t: jsonschema.validate(json.loads(t), ITEM) is None),
    ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch(r"x\d\d", t)),
    ({"structured_outputs": {"grammar": 'start: "<" /[a-c]{2}/ ">"'}},
     lambda t: re.fullmatch(r"<[a-c]{2}>", t)),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_vllm_fields_on_completions_and_chat(client, model, body, check, temperature):
    comp = client.completions.create(model=model, prompt="hello", max_tokens=100,
                                     temperature=temperature, seed=3, extra_body=body)
    chat = _chat(client, model, temperature, extra_body=body)
    for text, finish in ((comp.choices[0].text, comp.choices[0].finish_reason),
                         (chat.choices[0].message.content, chat.choices[0].finish_reason)):
        assert finish == "stop" and check(text), text


def test_streamed_json_schema_joins_to_a_valid_document(client, model):
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM}}
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=200,
                                            temperature=1.0, seed=1, response_format=rf,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), ITEM)


@pytest.mark.parametrize("body, cause", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}},
     "invalid JSON schema"),
    ({"extra_body": {"guided_regex": "[a-"}}, "invalid regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}}, "invalid grammar"),
    ({"extra_body": {"guided_choice": []}}, "non-empty"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "one output constraint"),
    ({"extra_body": {"structured_outputs": {"structural_tag": {}}}}, "unsupported field"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "invalid JSON schema"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    # Definitions no call could be made from, or not unambiguously.
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "get_weather"}}]},
     "'get_weather' is given twice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
     "name is empty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}], "tool_choice": "required"}, "of type 'object'"),
    ({"tools": [TIME, TIME], "tool_choice": "none"}, "given twice"),
])
def test_bad_constraints_are_400s(client, model, server, body, cause):
    before = httpx.get(server.base_url + "/metrics").text
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, **body)
    assert re.search(cause, info.value.body["message"]), info.value.body
    # Nothing reached the engine: no prompt token was admitted.
    count = re.compile(r"^llmfast_prompt_tokens_total (\S+)$", re.M)
    after = count.findall(httpx.get(server.base_url + "/metrics").text)
    assert count.findall(before) == after and after
    # (The counter does count what reaches the engine.)
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    assert float(count.findall(httpx.get(server.base_url + "/metrics").text)[0]) > float(
        after[0])


def _check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_required(client, model, temperature):
    # One call each (a random model would append calls to the array until max_tokens).
    out = _chat(client, model, temperature, tools=TOOLS, tool_choice="required", n=2,
                parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_named(client, model, temperature):
    choice = {"type": "function", "function": {"name": "get_time"}}
    out = _chat(client, model, temperature, tools=TOOLS, tool_choice=choice)
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    _check_calls(calls)


def test_tool_choice_none_and_auto_answer_in_text(client, model):
    """A random model does not write `<tool_call>`: auto gives its text back."""
    for choice in ("none", "auto"):
        out = _chat(client, model, 0.0, tools=TOOLS, tool_choice=choice, max_tokens=10,
                    extra_body={"ignore_eos": True})
        assert out.choices[0].message.tool_calls is None
        assert out.choices[0].message.content


def _streamed_calls(stream) -> tuple[dict, str | None, str]:
    calls, finish, content = {}, None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        # No chunk of nothing (a held-back token used to send `delta: {}`).
        assert (delta.role or delta.content or delta.tool_calls
                or chunk.choices[0].finish_reason), chunk
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            if tc.index not in calls:  # the first delta of a call: id, type, name
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_streamed_tool_calls(client, model, tool_choice):
    choice = ("required" if tool_choice == "required"
              else {"type": "function", "function": {"name": "get_weather"}})
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=300,
                                            temperature=1.0, seed=5, tools=TOOLS,
                                            tool_choice=choice, stream=True,
                                            parallel_tool_calls=False)
    calls, finish, content = _streamed_calls(stream)
    assert finish == "tool_calls" and not content and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    if tool_choice == "named":
        assert [c["name"] for c in calls.values()] == ["get_weather"]


# A model of the hermes format, played by a grammar: the output is forced into
# `<tool_call>` form (tool_choice stays "auto"), which the auto parser must read back.
HERMES_CALL = (r'Let me see\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome)", "unit": "(c|f)"\}\}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_the_models_own_tool_calls(client, model, stream):
    kw = dict(model=model, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=2,
              tools=TOOLS, tool_choice="auto",
              extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me see."
        _check_calls(choice.message.tool_calls)
        assert choice.message.tool_calls[0].function.name == "get_weather"
        return
    calls, finish, content = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == "Let me see.\n"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])
