"""`LLM.chat` and `--chat-template` (vLLM's names): conversations rendered by the model's
chat template or one given instead, checked against transformers' own rendering and
against `generate` on the same token ids."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from llmfast import LLM, SamplingParams
from tests.helpers.chat_model import make_chat_model
from tests.helpers.cli import assert_one_line_error, invoke

# A template unlike the model's ChatML one, so that using it shows in the prompt.
BRACKETS = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "you are a helpful test model."},
     {"role": "user", "content": "The capital of France is"}],
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """The same kind of model without a chat template."""
    return make_chat_model(tmp_path_factory.mktemp("plain") / "model", chat_template=False)


@pytest.fixture(scope="module")
def llm(chat_dir):
    return LLM(str(chat_dir), device="cpu", kv_cache_memory="16MiB")


def test_chat_renders_like_transformers_and_generates_like_generate(llm, chat_dir):
    hf = AutoTokenizer.from_pretrained(chat_dir)
    outputs = llm.chat(CONVERSATIONS, GREEDY)
    expected_texts = [hf.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                    for c in CONVERSATIONS]
    assert [o.prompt for o in outputs] == expected_texts
    assert [o.prompt_token_ids for o in outputs] == [
        hf.encode(text, add_special_tokens=False) for text in expected_texts]
    by_ids = llm.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outputs], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in by_ids]
    # One conversation alone is a batch of one; OpenAI's text parts read as their text.
    (alone,) = llm.chat(CONVERSATIONS[1], GREEDY)
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids
    parts = [CONVERSATIONS[1][0], {"role": "user", "content": [
        {"type": "text", "text": "The capital "}, {"type": "text", "text": "of France is"}]}]
    (from_parts,) = llm.chat(parts, GREEDY)
    assert from_parts.prompt == outputs[1].prompt


def test_chat_with_a_template_of_its_own(llm):
    (out,) = llm.chat(CONVERSATIONS[1], GREEDY, chat_template=BRACKETS)
    assert out.prompt == ("[system] you are a helpful test model.\n"
                          "[user] The capital of France is\n[assistant]")
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    (no_prompt,) = llm.chat(CONVERSATIONS[0], GREEDY, chat_template=BRACKETS,
                            add_generation_prompt=False)
    assert no_prompt.prompt == "[user] hello there\n"
    assert llm.tokenizer.chat_template is None  # the engine's own is untouched


@pytest.mark.parametrize("messages, fragment", [
    ([], "messages must be a non-empty list"),
    ("hello", "messages must be a non-empty list"),
    ([{"role": "user"}], "a chat message needs string 'role' and 'content'"),
])
def test_chat_bad_messages(llm, messages, fragment):
    with pytest.raises(ValueError, match=fragment):
        llm.chat(messages, GREEDY)


def test_engine_chat_template_from_a_file_or_inline(plain_dir, tmp_path):
    path = tmp_path / "brackets.jinja"
    path.write_text(BRACKETS)
    for value in (str(path), BRACKETS):
        llm = LLM(str(plain_dir), device="cpu", kv_cache_memory="16MiB", chat_template=value)
        assert llm.tokenizer.has_chat_template and llm.tokenizer.chat_template == BRACKETS
        (out,) = llm.chat(CONVERSATIONS[0], GREEDY)
        assert out.prompt == "[user] hello there\n[assistant]"
        del llm


def test_generate_cli_with_chat_template_on_a_model_without_one(plain_dir, tmp_path):
    path = tmp_path / "brackets.jinja"
    path.write_text(BRACKETS)
    common = ["--model", str(plain_dir), "--device", "cpu", "--kv-cache-memory", "16MiB",
              "--max-tokens", "5", "--temperature", "0", "--ignore-eos", "--json", "-"]
    # Without a template, --chat is refused; with one, the prompt goes through it.
    assert_one_line_error(invoke("generate", "hello there", "--chat", *common),
                          "has no chat template")
    result = invoke("generate", "hello there", "--chat-template", str(path), *common)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    llm = LLM(str(plain_dir), device="cpu", kv_cache_memory="16MiB")
    ids = llm.tokenizer.encode("[user] hello there\n[assistant]", add_special_tokens=False)
    (expected,) = llm.generate({"prompt_token_ids": ids},
                               SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert row["text"] == expected.outputs[0].text


# A real-size template (as models ship them: 1-10 KB) with transformers' own Jinja
# extensions: {% break %} (loopcontrols) and {% generation %}.
LONG = ("{#- " + "a template as long as real ones, " * 12 + "-#}\n"
        "{%- for m in messages %}{%- if m.role == 'stop' %}{% break %}{% endif %}"
        "{% generation %}[{{ m.role }}] {{ m.content }}\n{% endgeneration %}{%- endfor %}"
        "{%- if add_generation_prompt %}[assistant]{% endif %}")


def test_long_template_with_transformers_tags_from_a_file(plain_dir, tmp_path):
    """A template file of more than 255 bytes: its text, read by the CLI, is passed on as
    the engine argument, which must not then be taken for a (far too long) path."""
    assert len(LONG) > 300
    path = tmp_path / "long.jinja"
    path.write_text(LONG)
    result = invoke("generate", "hello there", "--model", str(plain_dir), "--device", "cpu",
                    "--kv-cache-memory", "16MiB", "--max-tokens", "2", "--chat-template",
                    str(path), "--json", "-")
    assert result.exit_code == 0, result.output
    llm = LLM(str(plain_dir), device="cpu", kv_cache_memory="16MiB", chat_template=LONG)
    (out,) = llm.chat([{"role": "user", "content": "hi"}, {"role": "stop", "content": "x"},
                       {"role": "user", "content": "never"}], GREEDY)
    assert out.prompt == "[user] hi\n[assistant]"


@pytest.mark.parametrize("value, fragment", [
    ("no-such-template.jinja", "is neither a file nor a jinja template"),
    ("{% for m in messages %}{{ m.content }}", "the chat template does not parse: line 1"),
])
def test_bad_chat_template_is_one_line_error(plain_dir, value, fragment):
    result = invoke("generate", "hi", "--model", str(plain_dir), "--device", "cpu",
                    "--chat-template", value)
    assert_one_line_error(result, fragment)


# Qwen3's switch, in miniature: a template variable a request may set.
THINK = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
         "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}")


def test_chat_template_kwargs(llm):
    conversation = [{"role": "user", "content": "hi"}]
    (plain,) = llm.chat(conversation, GREEDY, chat_template=THINK)
    (off,) = llm.chat(conversation, GREEDY, chat_template=THINK,
                      chat_template_kwargs={"enable_thinking": False})
    assert (plain.prompt, off.prompt) == ("[user] hi\n", "[user] hi\n/no_think")
    with pytest.raises(ValueError, match="chat template kwargs cannot set tokenize"):
        llm.chat(conversation, GREEDY, chat_template_kwargs={"tokenize": True})


def test_server_chat_template_kwargs_through_an_api_process(plain_dir, tmp_path):
    import httpx

    from tests.serve_server import start_server

    llm = LLM(str(plain_dir), device="cpu", kv_cache_memory="16MiB")
    expected = llm.tokenizer.encode("[user] hi\n/no_think", add_special_tokens=False)
    del llm
    server = start_server(plain_dir, tmp_path / "server.log", "--chat-template", THINK,
                          "--api-servers", "1")
    messages = [{"role": "user", "content": "hi"}]
    kwargs = {"enable_thinking": False}
    try:
        r = httpx.post(server.base_url + "/tokenize", timeout=30, json={
            "messages": messages, "chat_template_kwargs": kwargs})
        assert r.status_code == 200 and r.json()["tokens"] == expected, r.text
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": messages, "chat_template_kwargs": kwargs, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": messages, "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and "cannot set tokenize" in r.json()["error"]["message"]
        r = httpx.post(server.base_url + "/tokenize", timeout=30, json={
            "prompt": "hi", "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        server.stop()
