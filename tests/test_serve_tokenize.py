"""vLLM's utility endpoints on `llmfast serve`: /tokenize and /detokenize against the
tokenizer loaded directly (the oracle) and against the token counts a request reports,
and /version. Through the shared server (tests/conftest.py: --api-servers 0 and 1)."""

from __future__ import annotations

import httpx
import pytest

import llmfast

MESSAGES = [{"role": "system", "content": "you are a helpful test model."},
            {"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def tokenizer(serve_model_dir):
    from llmfast.tokenizer import load_tokenizer

    return load_tokenizer(serve_model_dir)


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.v1 + "/models").json()["data"][0]["id"]


def _post(server, route, body):
    r = httpx.post(server.base_url + route, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("text", ["The capital of France is", "héllo  wörld 🙂", ""])
def test_tokenize_a_prompt_as_the_tokenizer_does_and_round_trip(server, model, tokenizer,
                                                                 text):
    out = _post(server, "/tokenize", {"prompt": text, "model": model})
    assert out == {"count": len(tokenizer.encode(text)), "max_model_len": 2048,
                   "tokens": tokenizer.encode(text)}
    assert _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}
                 )["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = _post(server, "/detokenize", {"tokens": out["tokens"], "model": model})
    assert back == {"prompt": text}


def test_tokenize_messages_as_the_chat_endpoint_does(server, tokenizer):
    out = _post(server, "/tokenize", {"messages": MESSAGES})
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert out["tokens"] == expected and out["count"] == len(expected)
    # The same count a chat request reports for its prompt.
    chat = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == out["count"]

    bare = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["tokens"] == tokenizer.apply_chat_template(MESSAGES,
                                                           add_generation_prompt=False)
    assert bare["count"] < out["count"]
    with_special = _post(server, "/tokenize", {"messages": MESSAGES,
                                               "add_special_tokens": True})
    assert with_special["tokens"] == tokenizer.encode(tokenizer.render_chat(MESSAGES),
                                                      add_special_tokens=True)
    # Special tokens are kept: the text the model was given, template markers included.
    text = _post(server, "/detokenize", {"tokens": out["tokens"]})["prompt"]
    assert text == tokenizer.render_chat(MESSAGES) and "<|im_start|>" in text


def test_tokenize_counts_what_a_completion_reports(server, tokenizer):
    text = "hello there, how are you today?"
    count = _post(server, "/tokenize", {"prompt": text})["count"]
    out = _post(server, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert out["usage"]["prompt_tokens"] == count


def test_a_prompt_past_the_context_is_still_counted(server):
    """/tokenize is how a client learns a prompt is too long: no length check there."""
    out = _post(server, "/tokenize", {"prompt": "hello there " * 1500})
    assert out["count"] > out["max_model_len"] == 2048


def test_detokenize_any_ids_of_the_vocabulary(server, tokenizer):
    ids = list(range(tokenizer.vocab_size))
    assert _post(server, "/detokenize", {"tokens": ids})["prompt"] == tokenizer.decode(
        ids, skip_special_tokens=False)
    assert _post(server, "/detokenize", {"tokens": []}) == {"prompt": ""}


def test_version(server):
    r = httpx.get(server.base_url + "/version")
    assert r.status_code == 200
    assert r.json() == {"version": llmfast.__version__}
