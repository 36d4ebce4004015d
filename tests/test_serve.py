"""`llmfast serve` driven by the real `openai` client and httpx: completions, chat,
streaming, n > 1, stop strings, logprobs, concurrency, a killed client, and greedy text
equal to `llmfast generate`. One server subprocess for the module, its `openai` client and
model id (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest

from tests.serve_server import repo_env

PROMPTS = ["hello there", "The capital of France is", "Tell me a story", "how are you today?"]


@pytest.fixture(scope="module")
def tokenizer(serve_model_dir):
    from llmfast.tokenizer import load_tokenizer

    return load_tokenizer(serve_model_dir)


def _greedy(**kw):
    return {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}, **kw}


def test_models_health(server, client, model, serve_model_dir):
    assert model == serve_model_dir.name
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/other-model")
    assert info.value.body["code"] == "model_not_found"


def test_completion_usage_counts_tokens(client, model, tokenizer):
    out = client.completions.create(model=model, prompt=PROMPTS[1], **_greedy())
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[1]))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    # Token-id prompts are the same request.
    ids = tokenizer.encode(PROMPTS[1])
    by_ids = client.completions.create(model=model, prompt=ids, **_greedy())
    assert by_ids.choices[0].text == out.choices[0].text
    # A repeated prompt is served from the prefix cache (blocks of 16 tokens; the
    # prompt here is shorter than one, so nothing to reuse) - a long one is:
    long_ids = (ids * 20)[:40]
    client.completions.create(model=model, prompt=long_ids, **_greedy(max_tokens=1))
    again = client.completions.create(model=model, prompt=long_ids, **_greedy(max_tokens=1))
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_streaming_equals_whole_response(client, model):
    whole = client.completions.create(model=model, prompt=PROMPTS[0], **_greedy())
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], stream=True,
                                            stream_options={"include_usage": True},
                                            **_greedy()))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_and_chat_stream(client, model, tokenizer):
    messages = [{"role": "system", "content": "you are a test"},
                {"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=model, messages=messages, **_greedy())
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and msg.role == "assistant"
    assert whole.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages))
    assert whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True,
                                                 **_greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # Text parts are accepted as content and mean the same.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "hello "},
                                                       {"type": "text", "text": "there"}]}]
    same = client.chat.completions.create(model=model, messages=parts, **_greedy())
    assert same.choices[0].message.content == msg.content
    # OpenAI's account and record fields change nothing here.
    same = client.chat.completions.create(model=model, messages=messages, store=False,
                                          metadata={"team": "a"}, service_tier="auto",
                                          user="u1", **_greedy())
    assert same.choices[0].message.content == msg.content


def test_echo(client, model, tokenizer):
    plain = client.completions.create(model=model, prompt=PROMPTS[2], **_greedy())
    echoed = client.completions.create(model=model, prompt=PROMPTS[2], echo=True, **_greedy())
    assert echoed.choices[0].text == PROMPTS[2] + plain.choices[0].text
    # Token ids echo as their text, special tokens included, streamed or not.
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[2]}])
    head = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in head  # the fixture's ChatML markers are special tokens
    plain = client.completions.create(model=model, prompt=ids, **_greedy())
    echoed = client.completions.create(model=model, prompt=ids, echo=True, **_greedy())
    assert echoed.choices[0].text == head + plain.choices[0].text
    streamed = client.completions.create(model=model, prompt=ids, echo=True, stream=True,
                                         **_greedy())
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_nullable_fields_mean_their_default(server, model):
    """OpenAI's spec lets n, stream, echo and chat's logprobs be null; clients that send
    every field (unset ones as null) must get the default, not a 400."""
    body = {"model": model, "prompt": PROMPTS[0], "temperature": 0, "max_tokens": 4,
            "ignore_eos": True}
    plain = httpx.post(server.v1 + "/completions", json=body, timeout=30)
    nulls = httpx.post(server.v1 + "/completions", timeout=30,
                       json={**body, "n": None, "stream": None, "echo": None})
    assert nulls.status_code == 200, nulls.text
    assert [c["text"] for c in nulls.json()["choices"]] == \
        [c["text"] for c in plain.json()["choices"]]
    chat = httpx.post(server.v1 + "/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "n": None, "stream": None, "logprobs": None})
    assert chat.status_code == 200, chat.text
    choices = chat.json()["choices"]
    assert len(choices) == 1 and choices[0]["logprobs"] is None


def test_n_and_prompt_lists(client, model):
    greedy = client.completions.create(model=model, prompt=PROMPTS[:2], n=2, **_greedy())
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert greedy.choices[0].text == greedy.choices[1].text  # greedy: the same twice
    assert greedy.choices[2].text == greedy.choices[3].text
    assert greedy.choices[0].text != greedy.choices[2].text
    assert greedy.usage.completion_tokens == 4 * 12
    single = client.completions.create(model=model, prompt=PROMPTS[1], **_greedy())
    assert greedy.choices[2].text == single.choices[0].text
    # Sampled with a seed: n different samples, reproducible as a whole.
    kw = {"temperature": 1.0, "max_tokens": 12, "seed": 7, "extra_body": {"ignore_eos": True}}
    a = client.completions.create(model=model, prompt=PROMPTS[0], n=3, **kw)
    b = client.completions.create(model=model, prompt=PROMPTS[0], n=3, **kw)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) == 3
    # Streaming n > 1: every choice gets its own chunks and its own finish.
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=3, stream=True, **kw))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length", 2: "length"}


def test_stop_strings(client, model):
    full = client.completions.create(model=model, prompt=PROMPTS[3], **_greedy(max_tokens=24))
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert len(stop) == 2
    cut = text[: text.index(stop)]
    out = client.completions.create(model=model, prompt=PROMPTS[3], stop=[stop, "never seen"],
                                    **_greedy(max_tokens=24))
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[3], stop=stop,
                                            stream=True, **_greedy(max_tokens=24)))
    assert "".join(c.choices[0].text for c in chunks) == cut
    kept = client.completions.create(model=model, prompt=PROMPTS[3], stop=stop, **_greedy(
        max_tokens=24, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}))
    assert kept.choices[0].text == cut + stop


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPTS[0], logprobs=3, **_greedy())
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the argmax
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # logprobs 0 still lists the sampled token (OpenAI: up to logprobs + 1 entries),
    # and with sampling it need not be the likeliest.
    sampled = client.completions.create(model=model, prompt=PROMPTS[0], logprobs=0,
                                        temperature=1.5, seed=3, max_tokens=12,
                                        extra_body={"ignore_eos": True}).choices[0].logprobs
    assert [list(top.items()) for top in sampled.top_logprobs] == \
        [[(t, v)] for t, v in zip(sampled.tokens, sampled.token_logprobs)]
    streamed = list(client.completions.create(model=model, prompt=PROMPTS[0], logprobs=3,
                                              stream=True, **_greedy()))
    assert [v for c in streamed for v in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(lp.token_logprobs, abs=1e-5)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=2, **_greedy())
    content = chat.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


@pytest.fixture(scope="module")
def offline(serve_model_dir):
    """The Python API on the server's model: the reference for its prompt logprobs."""
    from llmfast import LLM

    return LLM(str(serve_model_dir), kv_cache_memory=32 << 20)


def _offline_prompt_logprobs(offline, prompt: str, n: int):
    from llmfast import SamplingParams

    return offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                   prompt_logprobs=n))[0]


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client, model, tokenizer, offline):
    """lm-eval's loglikelihood: echo + logprobs + max_tokens 0 gives the prompt's tokens'
    logprobs (null first) and nothing generated; streamed, in the first chunk."""
    prompt = PROMPTS[1]
    want = _offline_prompt_logprobs(offline, prompt, 2)
    ids = want.prompt_token_ids
    out = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2,
                                    max_tokens=0, temperature=0)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [entry[t] for t, entry in zip(ids[1:], want.prompt_logprobs[1:])], abs=1e-4)
    for top, entry in zip(lp.top_logprobs[1:], want.prompt_logprobs[1:]):
        assert 2 <= len(top) <= 3  # the top 2 and the prompt token
        assert max(top.values()) == pytest.approx(max(entry.values()), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = list(client.completions.create(model=model, prompt=prompt, echo=True,
                                              logprobs=2, max_tokens=0, temperature=0,
                                              stream=True))
    first = streamed[0].choices[0]
    assert first.text == prompt and first.logprobs.tokens == lp.tokens
    assert first.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert "".join(c.choices[0].text for c in streamed) == prompt


def test_echo_logprobs_list_the_prompt_then_the_generated_tokens(client, model):
    plain = client.completions.create(model=model, prompt=PROMPTS[0], logprobs=1, **_greedy())
    out = client.completions.create(model=model, prompt=PROMPTS[0], echo=True, logprobs=1,
                                    **_greedy())
    lp, generated = out.choices[0].logprobs, plain.choices[0].logprobs
    num_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 12 and out.usage.completion_tokens == 12
    assert out.choices[0].text == PROMPTS[0] + plain.choices[0].text
    assert lp.tokens[num_prompt:] == generated.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(generated.token_logprobs, abs=1e-5)
    assert lp.text_offset[num_prompt:] == [o + len(PROMPTS[0]) for o in generated.text_offset]
    streamed = list(client.completions.create(model=model, prompt=PROMPTS[0], echo=True,
                                              logprobs=1, stream=True, **_greedy()))
    assert streamed[0].choices[0].text.startswith(PROMPTS[0])
    assert [v for c in streamed for v in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(lp.token_logprobs, abs=1e-5)
    assert streamed[0].choices[0].logprobs.text_offset[:num_prompt] == \
        lp.text_offset[:num_prompt]


def test_vllm_prompt_logprobs_field(client, model, tokenizer, offline):
    """vLLM's extra field: [null, {id: {logprob, rank, decoded_token}}, ...] on each
    completion choice, and at the top of a chat response."""
    prompt = PROMPTS[3]
    want = _offline_prompt_logprobs(offline, prompt, 3)
    out = client.completions.create(model=model, prompt=prompt, **_greedy(
        max_tokens=2, extra_body={"prompt_logprobs": 3}))
    got = out.choices[0].model_extra["prompt_logprobs"]
    ids = want.prompt_token_ids
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        position = got[i]
        assert set(position) == {str(t) for t in want.prompt_logprobs[i]}
        for t, lp in want.prompt_logprobs[i].items():
            assert position[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4)
            assert position[str(t)]["decoded_token"] == tokenizer.decode(
                [t], skip_special_tokens=False)
        assert position[str(ids[i])]["rank"] == want.prompt_logprob_ranks[i]
        # The top 3 are ranked 1..3 (one of them may be the prompt token itself).
        others = [p["rank"] for t, p in position.items() if t != str(ids[i])]
        assert len(set(others)) == len(others) and set(others) <= {1, 2, 3}
    assert out.choices[0].logprobs is None  # the sampled tokens' were not asked for
    chat = client.chat.completions.create(model=model, messages=[
        {"role": "user", "content": "hi"}], **_greedy(extra_body={"prompt_logprobs": 0}))
    chat_lp = chat.model_extra["prompt_logprobs"]
    assert len(chat_lp) == chat.usage.prompt_tokens and chat_lp[0] is None
    assert all(len(position) == 1 for position in chat_lp[1:])


def test_logit_bias_and_allowed_token_ids(client, model, tokenizer):
    forced = tokenizer.encode("hello")[0]
    out = client.completions.create(model=model, prompt=PROMPTS[1], **_greedy(
        max_tokens=5, logit_bias={str(forced): 100}))
    assert out.choices[0].text == tokenizer.decode([forced] * 5)
    allowed = list(dict.fromkeys(tokenizer.encode("The capital of France")))[:3]
    assert len({tokenizer.decode([t]) for t in allowed}) == 3
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], logprobs=True,
        top_logprobs=3, **_greedy(max_tokens=6, extra_body={"ignore_eos": True,
                                                            "allowed_token_ids": allowed}))
    names = {tokenizer.decode([t]) for t in allowed}
    for entry in chat.choices[0].logprobs.content:
        # Every other token is banned before the logprobs: the three share all the mass.
        assert {top.token for top in entry.top_logprobs} == names
        assert sum(math.exp(top.logprob) for top in entry.top_logprobs) == pytest.approx(1.0)


def test_concurrent_streams_batch_and_finish(server, client, model):
    """32 streaming clients at once: each gets all its tokens and the text it gets alone
    (greedy), and the engine ran them in shared steps."""
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    alone = [client.completions.create(model=model, prompt=p, **_greedy(max_tokens=10))
             .choices[0].text for p in prompts[:4]]
    aclient = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0,
                                 timeout=120)

    async def one(prompt):
        stream = await aclient.completions.create(
            model=model, prompt=prompt, stream=True, stream_options={"include_usage": True},
            **_greedy(max_tokens=10))
        text, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
            if chunk.usage:
                usage = chunk.usage
        return "".join(text), usage

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    steps_before = server.metrics()["llmfast_engine_steps_total"]
    results = asyncio.run(main())
    steps = server.metrics()["llmfast_engine_steps_total"] - steps_before
    assert all(usage.completion_tokens == 10 for _, usage in results)
    assert [text for text, _ in results[:4]] == alone
    # One at a time would take 32 * 10 steps; shared steps make it far fewer: 16-18 on a
    # quiet 2-core machine, but 90-172 seen with the whole suite loading both cores (the
    # streams then reach the engine spread over time), so the bound is a quarter fewer.
    assert steps <= 32 * 10 * 3 / 4, f"{steps} steps for 320 tokens: requests rarely shared a step"


_STREAMER = textwrap.dedent("""
    import sys, httpx
    body = {"prompt": "hello there", "max_tokens": 1900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                print("chunk", flush=True)
""")


def test_killed_client_frees_its_blocks(server):
    before = server.metrics()
    proc = subprocess.Popen([sys.executable, "-c", _STREAMER, server.base_url],
                            stdout=subprocess.PIPE, text=True, env=repo_env())
    try:
        for _ in range(5):
            assert proc.stdout.readline() == "chunk\n"
        during = server.metrics()
        assert during["llmfast_num_requests_running"] == 1
        assert during["llmfast_kv_cache_usage_ratio"] > 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = server.metrics()
        if after["llmfast_num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert after["llmfast_num_requests_running"] == 0
    assert after["llmfast_kv_cache_usage_ratio"] == 0
    assert after["llmfast_request_aborted_total"] == before["llmfast_request_aborted_total"] + 1
    generated = after["llmfast_generation_tokens_total"] - before["llmfast_generation_tokens_total"]
    assert 5 <= generated < 1900  # aborted long before its max_tokens
    # And the server goes on serving.
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_greedy_text_equals_llmfast_generate(client, model, serve_model_dir):
    prompts = PROMPTS[:3]
    cmd = [sys.executable, "-m", "llmfast", "generate", "--model", str(serve_model_dir),
           "--json", "-", "--max-tokens", "16", "--temperature", "0", "--kv-cache-memory", "32MiB",
           *prompts]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=repo_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    expected = [row["text"] for row in json.loads(done.stdout)]
    served = [client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=16
    ).choices[0].message.content for p in prompts]
    assert served == expected


def test_load_generator_counts_every_request(server):
    """scripts/bench_serve.py's runner: all requests complete with their token counts and
    the latency summaries cover them (no timing is asserted)."""
    from llmfast.bench.serving.load_generator import format_result, run_serve_bench
    from llmfast.bench.workload import random_requests

    requests = random_requests(6, 24, 5, vocab_size=300, seed=1)
    result = asyncio.run(run_serve_bench(server.base_url + "/v1", requests, request_rate=50.0,
                                         max_concurrency=4))
    assert (result.completed, result.failed) == (6, 0)
    assert result.ttft.count == 6 and result.e2e.count == 6 and result.tpot.count == 6
    assert result.output_tokens_per_s == pytest.approx(30 / result.duration_s)
    assert 0 < result.ttft.median <= result.e2e.median
    assert "| TTFT |" in format_result(result)


def test_load_generator_refuses_requests_past_the_context(server):
    """Each would be a 400 (prompt + max_tokens past max-model-len): refused up front,
    with the sizes, instead of timing failures."""
    from llmfast.bench.serving.load_generator import run_serve_bench
    from llmfast.bench.workload import BenchError, BenchRequest

    max_len = httpx.get(server.base_url + "/v1/models").json()["data"][0]["max_model_len"]
    requests = [BenchRequest([5] * 8, 4), BenchRequest([5] * (max_len - 3), 4)]
    with pytest.raises(BenchError, match=f"{max_len - 3} prompt \\+ 4 output = {max_len + 1} "
                                         f"tokens, past the server's max_model_len {max_len}"):
        asyncio.run(run_serve_bench(server.base_url, requests, request_rate=50.0))


def test_load_generator_without_a_models_endpoint():
    """Another OpenAI-compatible server may have no usable /v1/models: with --model given
    the run goes on (no context check), without it the error is one line."""
    from llmfast.bench.serving.load_generator import fetch_model
    from llmfast.bench.workload import BenchError

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": "no such route"})

    async def ask(model):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await fetch_model(client, "http://server", {}, model)

    assert asyncio.run(ask("my-model")) == ("my-model", None)
    with pytest.raises(BenchError, match="cannot read the served model .*; pass the model"):
        asyncio.run(ask(None))
