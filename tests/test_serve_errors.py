"""Bad input to `llmfast serve`: every case is a 4xx with an OpenAI error body (never a
500, never a traceback), and the server keeps serving."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
HI = [{"role": "user", "content": "hi"}]

# (route, raw body or JSON object, status, param[, a regex the message must match])
CASES = {
    "malformed json": (COMPLETIONS, b'{"prompt": "hi", "max_tokens": ', 400, None),
    "not an object": (COMPLETIONS, b'["hi"]', 400, None),
    "no prompt": (COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
    "prompt wrong type": (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    "prompt mixed list": (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt"),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    "empty token list": (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    "token id out of vocab": (COMPLETIONS, {"prompt": [1, 10**6]}, 400, "prompt"),
    "temperature wrong type": (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400,
                               "temperature"),
    "max_tokens as string": (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, 400,
                             "max_tokens"),
    "max_tokens zero": (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens negative": (CHAT, {"messages": HI, "max_tokens": -3}, 400, "max_tokens"),
    "max_completion_tokens zero": (CHAT, {"messages": HI, "max_completion_tokens": 0}, 400,
                                   "max_completion_tokens"),
    "top_p out of range": (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    "negative temperature": (CHAT, {"messages": HI, "temperature": -1}, 400, "temperature"),
    "logprobs too many": (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    "top_logprobs without logprobs": (CHAT, {"messages": HI, "top_logprobs": 2}, 400,
                                      "top_logprobs"),
    # The message names the field the client sent, as the param does.
    "top_logprobs too many": (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 50}, 400,
                              "top_logprobs", "^top_logprobs must be"),
    "unknown field": (COMPLETIONS, {"prompt": "hi", "temprature": 0.5}, 400, "temprature"),
    "unknown model": (COMPLETIONS, {"prompt": "hi", "model": "gpt-17"}, 400, "model"),
    "n too large": (COMPLETIONS, {"prompt": "hi", "n": 1000}, 400, "n"),
    "n zero": (CHAT, {"messages": HI, "n": 0}, 400, "n"),
    "prompt longer than the context": (COMPLETIONS, {"prompt": [5] * 3000}, 400, "prompt"),
    "empty messages": (CHAT, {"messages": []}, 400, "messages"),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
                     "messages"),
    "message without content type": (CHAT, {"messages": [{"role": "user", "content": 3}]}, 400,
                                     "messages"),
    "image content": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    "tools": (CHAT, {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools"),
    "json_schema without a schema": (CHAT, {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    "unknown response_format": (CHAT, {"messages": HI, "response_format": {"type": "xml"}},
                                400, "response_format"),
    "regex that does not compile": (COMPLETIONS, {"prompt": "hi", "guided_regex": "(a"}, 400,
                                    "guided_regex"),
    "logit_bias key not a token id": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"a5": 1.0}},
                                      400, "logit_bias"),
    "logit_bias key two signs": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"--5": 1}},
                                 400, "logit_bias"),
    "logit_bias key not ascii digits": (CHAT, {"messages": HI, "logit_bias": {"\u00b2": 1}},
                                        400, "logit_bias"),
    "logit_bias key with underscore": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"1_0": 1}},
                                       400, "logit_bias"),
    "logit_bias key of 5000 digits": (COMPLETIONS, {"prompt": "hi",
                                                    "logit_bias": {"9" * 5000: 1}},
                                      400, "logit_bias"),
    "logit_bias negative id": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"-5": 1}},
                               400, "logit_bias"),
    "logit_bias over 100": (CHAT, {"messages": HI, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    "logit_bias id out of vocab": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"1000000": 1}},
                                   400, "logit_bias"),
    "allowed_token_ids empty": (CHAT, {"messages": HI, "allowed_token_ids": []}, 400,
                                "allowed_token_ids"),
    "allowed_token_ids out of vocab": (COMPLETIONS, {"prompt": "hi",
                                                     "allowed_token_ids": [3, 10**6]}, 400,
                                       "allowed_token_ids"),
    "echo with too many logprobs": (COMPLETIONS, {"prompt": "hi", "echo": True,
                                                  "logprobs": 21}, 400, "logprobs"),
    "prompt_logprobs too many": (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 21}, 400,
                                 "prompt_logprobs"),
    "prompt_logprobs negative": (CHAT, {"messages": HI, "prompt_logprobs": -1}, 400,
                                 "prompt_logprobs"),
    "prompt_logprobs streamed": (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 1,
                                               "stream": True}, 400, "prompt_logprobs"),
    "max_tokens zero with logprobs, no echo": (COMPLETIONS, {"prompt": "hi", "max_tokens": 0,
                                                             "logprobs": 1}, 400,
                                               "max_tokens"),
    "stream not a bool": (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    "stop wrong type": (COMPLETIONS, {"prompt": "hi", "stop": 7}, 400, "stop"),
    "empty stop string": (COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    "stream_options without stream": (COMPLETIONS, {"prompt": "hi", "stream_options": {
        "include_usage": True}}, 400, "stream_options"),
    "stream_options with stream false": (CHAT, {"messages": HI, "stream": False,
                                                "stream_options": {"include_usage": False}},
                                         400, "stream_options"),
    "max_tokens past the context": (COMPLETIONS, {"prompt": [5] * 2000, "max_tokens": 49},
                                    400, "prompt"),
    "max_completion_tokens past the context": (CHAT, {"messages": HI,
                                                      "max_completion_tokens": 2048}, 400,
                                               "messages"),
    "tokenize without a prompt": (TOKENIZE, {}, 400, "prompt"),
    "tokenize prompt and messages": (TOKENIZE, {"prompt": "hi", "messages": HI}, 400,
                                     "prompt"),
    "tokenize prompt wrong type": (TOKENIZE, {"prompt": [1, 2]}, 400, "prompt"),
    "tokenize generation prompt for a prompt": (TOKENIZE, {
        "prompt": "hi", "add_generation_prompt": False}, 400, "add_generation_prompt"),
    "tokenize empty messages": (TOKENIZE, {"messages": []}, 400, "messages"),
    "tokenize unknown model": (TOKENIZE, {"prompt": "hi", "model": "gpt-17"}, 400, "model"),
    "tokenize unknown field": (TOKENIZE, {"prompt": "hi", "return_tokens": True}, 400,
                               "return_tokens"),
    "tokenize not an object": (TOKENIZE, b'"hi"', 400, None),
    "detokenize without tokens": (DETOKENIZE, {}, 400, "tokens"),
    "detokenize id out of vocab": (DETOKENIZE, {"tokens": [1, 10**6]}, 400, "tokens"),
    "detokenize negative id": (DETOKENIZE, {"tokens": [-1]}, 400, "tokens"),
    "detokenize text": (DETOKENIZE, {"tokens": "hello"}, 400, "tokens"),
    "detokenize bools": (DETOKENIZE, {"tokens": [True]}, 400, "tokens"),
    "detokenize unknown model": (DETOKENIZE, {"tokens": [1], "model": "gpt-17"}, 400, "model"),
}


def _post(server, route, body):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.base_url + route, timeout=30,
                      headers={"Content-Type": "application/json"}, **kwargs)


def _assert_error_body(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request(server, case):
    route, body, status, param, *message = CASES[case]
    error = _assert_error_body(_post(server, route, body), status)
    assert error["param"] == param
    for pattern in message:
        assert re.search(pattern, error["message"]), error["message"]


def test_oversized_body_is_413(server):
    big = {"prompt": "x" * (9 << 20)}  # the server's default limit is 8 MiB
    _assert_error_body(_post(server, COMPLETIONS, big), 413)


def test_unknown_route_and_method(server):
    _assert_error_body(httpx.get(server.base_url + "/v1/engines"), 404)
    _assert_error_body(httpx.get(server.base_url + COMPLETIONS), 405)
    _assert_error_body(httpx.get(server.base_url + TOKENIZE), 405)
    _assert_error_body(httpx.post(server.base_url + "/version"), 405)


def _context_message(total, prompt, completion, what):
    return (f"This model's maximum context length is 2048 tokens. However, you requested "
            f"{total} tokens ({prompt} in the {what}, {completion} in the completion). "
            f"Please reduce the length of the {what} or completion.")


@pytest.fixture(scope="module")
def tokenizer(serve_model_dir):
    """The oracle for a chat prompt's length."""
    from llmfast.tokenizer import load_tokenizer

    return load_tokenizer(serve_model_dir)


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized(server, tokenizer):
    """A text prompt (a chat's messages) longer than the tokenizer's bound for the context
    is the 400 context_length_exceeded at once, by its characters: the engine thread never
    tokenizes it (an 8M-character prompt held every other request up for ~15 s). Below
    the bound the token count decides (the test below)."""
    too_long = "a" * (tokenizer.prompt_chars_bound(2048) + 1)
    for path, body, param in (
            (COMPLETIONS, {"prompt": ["hi", too_long], "max_tokens": 1}, "prompt"),
            (CHAT, {"messages": [{"role": "user", "content": too_long}]}, "messages")):
        response = httpx.post(server.base_url + path, json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", param)
        assert error["message"].startswith(f"the prompt's {len(too_long)} characters "
                                           "cannot fit max-model-len 2048 tokens")


def test_max_tokens_past_the_context_is_refused_as_vllm_does(server, tokenizer):
    """An explicit max_tokens (max_completion_tokens) that does not fit after the prompt
    is a 400 naming the counts, for each prompt of a list and each of n choices, streamed
    or not; exactly filling the context is fine."""
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    for kwargs in ({"prompt": [5] * 2000}, {"prompt": [[5] * 10, [6] * 2000], "n": 2},
                   {"prompt": [5] * 2000, "stream": True}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, max_tokens=49, **kwargs)
        assert info.value.body == {
            "message": _context_message(2049, 2000, 49, "prompt"), "type":
            "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}
    full = client.completions.create(model=model, prompt=[5] * 2000, max_tokens=48,
                                     extra_body={"ignore_eos": True})
    assert (full.usage.completion_tokens, full.choices[0].finish_reason) == (48, "length")

    messages = [{"role": "user", "content": "hello there " * 40}]
    num_prompt = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    room = 2048 - num_prompt
    for field in ("max_completion_tokens", "max_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=messages,
                                           **{field: room + 1})
        assert info.value.body["message"] == _context_message(2049, num_prompt, room + 1,
                                                              "messages")
        assert info.value.body["code"] == "context_length_exceeded"
    assert "Traceback" not in server.log()


def test_chat_without_max_tokens_generates_to_the_context_end(server, tokenizer):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    content = "hello there " * 600
    messages = [{"role": "user", "content": content}]
    while len(tokenizer.apply_chat_template(messages)) > 2040:
        content = content[: len(content) - 12]
        messages = [{"role": "user", "content": content}]
    num_prompt = len(tokenizer.apply_chat_template(messages))
    out = client.chat.completions.create(model=client.models.list().data[0].id,
                                         messages=messages, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == num_prompt
    assert out.usage.completion_tokens == 2048 - num_prompt
    assert out.choices[0].finish_reason == "length"


def test_stream_options_need_stream(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    message = "Stream options can only be defined when `stream=True`."
    for call in (lambda **kw: client.completions.create(prompt="hi", **kw),
                 lambda **kw: client.chat.completions.create(messages=HI, **kw)):
        with pytest.raises(openai.BadRequestError) as info:
            call(model=model, max_tokens=2, stream_options={"include_usage": True})
        assert (info.value.body["message"], info.value.body["param"]) == (
            message, "stream_options")
        # With stream: true they are fine; null (and vLLM's empty object) are too.
        assert list(call(model=model, max_tokens=2, stream=True,
                         stream_options={"include_usage": True}))[-1].usage is not None
        for options in (None, {}):
            r = _post(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 1,
                                            "stream_options": options})
            assert r.status_code == 200, r.text


def test_openai_client_raises_and_server_keeps_serving(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="nope", messages=HI)
    assert info.value.body["code"] == "model_not_found"
    out = client.completions.create(model=model, prompt="hi", max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert "Traceback" not in server.log()


def test_non_json_content_type_is_415(server):
    """text/plain and form bodies are what a web page may POST cross-origin without a
    preflight; they are refused. No Content-Type at all is JSON."""
    body = b'{"prompt": "hi", "max_tokens": 1}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(server.base_url + COMPLETIONS, content=body, timeout=30,
                       headers={"Content-Type": content_type})
        assert _assert_error_body(r, 415)["code"] == "unsupported_media_type"
    for headers in ({}, {"Content-Type": "application/json; charset=utf-8"}):
        r = httpx.post(server.base_url + COMPLETIONS, content=body, headers=headers,
                       timeout=30)
        assert r.status_code == 200, r.text


def test_huge_counts_neither_fail_nor_disturb_other_requests(server):
    """top_k past int32 and min_tokens past int64 are valid JSON integers; they once
    overflowed the engine's per-request arrays, failing the step and with it every stream
    in flight. Now top_k past the vocabulary keeps every token, a max_tokens past the
    context is a 400 (vLLM's), and the others finish. Without max_tokens a long prompt
    generates to the context's end."""
    model = openai.OpenAI(base_url=server.v1, api_key="unused").models.list().data[0].id
    aclient = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0,
                                 timeout=60)
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 8}

    async def stream(i, started: asyncio.Queue):
        chunks = await aclient.completions.create(
            model=model, prompt=f"request {i}", stream=True, max_tokens=200, temperature=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        seen = []
        async for chunk in chunks:
            if not seen:
                started.put_nowait(i)
            seen.append(chunk)
        return seen[-1].usage.completion_tokens

    async def main():
        started = asyncio.Queue()
        good = [asyncio.ensure_future(stream(i, started)) for i in range(6)]
        for _ in good:  # all six are generating before the odd ones arrive
            await started.get()
        huge_top_k = await aclient.completions.create(
            model=model, prompt="hi", **sampled, extra_body={"top_k": 2**40})
        with pytest.raises(openai.BadRequestError) as huge_min:
            await aclient.completions.create(
                model=model, prompt=[5] * 2000, max_tokens=2**64,
                extra_body={"min_tokens": 2**63})
        to_the_end = await aclient.completions.create(  # the default max_tokens is 16
            model=model, prompt=[5] * 2040, extra_body={"ignore_eos": True})
        top_k_off = await aclient.completions.create(model=model, prompt="hi", **sampled)
        return await asyncio.gather(*good), huge_top_k, huge_min, to_the_end, top_k_off

    lengths, huge_top_k, huge_min, to_the_end, top_k_off = asyncio.run(main())
    assert lengths == [200] * 6
    assert huge_top_k.choices[0].text == top_k_off.choices[0].text
    assert huge_min.value.body["code"] == "context_length_exceeded"
    assert f"you requested {2000 + 2**64} tokens" in huge_min.value.body["message"]
    assert to_the_end.choices[0].finish_reason == "length"
    assert to_the_end.usage.completion_tokens == 2048 - 2040  # the server's max-model-len
    assert "Traceback" not in server.log()
