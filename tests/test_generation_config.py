"""Default sampling parameters from the model's generation_config.json (vLLM's
`--generation-config auto`): requests that leave a field unset get the model's value, in
the Python API and on the server (through an API process too); `vllm` turns it off."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from llmfast import LLM, SamplingParams
from llmfast.models.sources.generation_config import read_sampling_defaults
from tests.helpers.chat_model import make_chat_model
from tests.helpers.cli import assert_one_line_error, invoke
from tests.serve_server import start_server

PROMPT = "The capital of France is"
# Greedy, short, and a repetition penalty: unlike SamplingParams' own defaults in every
# field that shows in the output.
MODEL_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 5,
                  "do_sample": True, "bos_token_id": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_chat_model(tmp_path_factory.mktemp("genconf") / "model")
    config = path / "generation_config.json"
    existing = json.loads(config.read_text()) if config.is_file() else {}
    config.write_text(json.dumps({**existing, **MODEL_DEFAULTS}))
    return path


def _explicit(max_tokens: int = 5) -> SamplingParams:
    return SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=max_tokens)


def test_reading_keeps_vllms_fields_and_drops_bad_values(tmp_path, caplog):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.6, "top_p": 0.8, "top_k": 20,
                                "min_p": "high", "repetition_penalty": 1.05,
                                "max_new_tokens": 2048, "do_sample": True,
                                "eos_token_id": [1, 2]}))
    with caplog.at_level(logging.WARNING):
        defaults = read_sampling_defaults(path)
    assert defaults == (("temperature", 0.6), ("top_p", 0.8), ("top_k", 20),
                        ("repetition_penalty", 1.05), ("max_tokens", 2048))
    assert "min_p" in caplog.text
    path.write_text("{not json")
    assert read_sampling_defaults(path) == ()


def test_python_api_uses_the_model_defaults_unless_told_not_to(model_dir):
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB")
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, repetition_penalty=1.3, max_tokens=5)
    (by_default,) = llm.generate(PROMPT)
    (explicit,) = llm.generate(PROMPT, _explicit())
    assert by_default.outputs[0].token_ids == explicit.outputs[0].token_ids
    (streamed_last, *_) = reversed(list(llm.stream(PROMPT)))
    assert streamed_last.outputs[0].token_ids == explicit.outputs[0].token_ids
    # Given parameters are used whole: SamplingParams' defaults fill them, not the model's.
    (given,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    assert len(given.outputs[0].token_ids) == 8 or given.outputs[0].finish_reason == "stop"
    del llm
    plain = LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB",
                generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_generation_config_from_another_directory(model_dir, tmp_path):
    other = tmp_path / "conf"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 7}))
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB",
              generation_config=str(other))
    assert llm.get_default_sampling_params() == SamplingParams(top_k=7)


def test_bad_generation_config_setting_is_one_line_error(model_dir, tmp_path):
    result = invoke("generate", "hi", "--model", str(model_dir), "--device", "cpu",
                    "--generation-config", str(tmp_path / "nowhere"))
    assert_one_line_error(result, "is not 'auto', 'vllm' or a directory holding "
                                  "generation_config.json")


@pytest.mark.parametrize("text, fragment", [("{not json", "expecting property name"),
                                             ("[1, 2]", "not a JSON object"),
                                             ('{"top_p": 7}', "top_p")])
def test_named_generation_config_that_cannot_be_used_is_one_line_error(model_dir, tmp_path,
                                                                       text, fragment):
    """A file named with --generation-config is the user's choice: what is wrong with it
    stops the run (a model's own file is only warned about: the model still runs)."""
    (tmp_path / "generation_config.json").write_text(text)
    result = invoke("generate", "hi", "--model", str(model_dir), "--device", "cpu",
                    "--generation-config", str(tmp_path))
    line = assert_one_line_error(result, fragment)
    assert line.startswith("error: --generation-config: ")


def test_server_requests_get_the_model_defaults(model_dir, tmp_path):
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB")
    (expected,) = llm.generate(PROMPT, _explicit())
    expected_text = expected.outputs[0].text
    chat_ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    (chat_expected,) = llm.generate({"prompt_token_ids": chat_ids}, _explicit())
    del llm
    # Through an API process: the defaults cross to it with the engine's limits.
    server = start_server(model_dir, tmp_path / "server.log", "--api-servers", "1")
    try:
        assert ("default sampling parameters from the model's generation_config.json: "
                "temperature=0.0, repetition_penalty=1.3, max_tokens=5") in server.log()
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": PROMPT},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected_text
        # Chat's default length is the rest of the context, capped by max_new_tokens.
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": PROMPT}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == chat_expected.outputs[0].text
        # A field the request sets wins.
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop()


@pytest.mark.slow  # a server start (~20-50 s on the 2-core CI machine) for what these cover:
def test_generation_config_flag_reaches_the_server(model_dir, tmp_path):
    """`--generation-config vllm`: OpenAI's 16 tokens for a completion, as without one.
    Slow: `serve` takes the engine flags every command shares (common.py), and the default
    suite covers each link: the flag parsed on the command line
    (test_chat_cli_takes_the_model_defaults_for_flags_not_given), `vllm` dropping the
    model's defaults (test_python_api_uses_the_model_defaults_unless_told_not_to), the
    engine's defaults reaching a real server's requests
    (test_server_requests_get_the_model_defaults), and no defaults meaning 16 tokens for a
    completion (test_server_default_lengths)."""
    server = start_server(model_dir, tmp_path / "server.log", "--generation-config", "vllm")
    try:
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "ignore_eos": True, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == 16
    finally:
        server.stop()


def test_chat_cli_takes_the_model_defaults_for_flags_not_given(model_dir):
    from typer.testing import CliRunner

    from llmfast.cli.main import app

    def settings(*flags: str) -> str:
        result = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--device", "cpu",
                                          "--kv-cache-memory", "16MiB", *flags],
                                    input=b"/settings\n")
        assert result.exit_code == 0, result.output
        # Piped, command answers go to stderr (stdout: replies); one line per setting list.
        return " ".join(result.stderr.split())

    # The model's temperature and repetition penalty, named as its; chat's local defaults
    # where it has none (top_k, top_p, min_p).
    shown = settings()
    assert "temperature 0 (generation_config.json)" in shown
    assert "repetition_penalty 1.3 (generation_config.json)" in shown
    assert "top_k 40, top_p 0.95, min_p 0.05" in shown
    assert "max_tokens 512" in shown  # max_new_tokens is not a turn
    shown = settings("--temperature", "0.5", "--generation-config", "vllm")
    assert "temperature 0.5" in shown and "generation_config.json" not in shown


@pytest.mark.parametrize("model_max, completion, chat", [
    (2048, 16, 1024),  # a long max_new_tokens never lengthens OpenAI's 16 for completions
    (5, 5, 5),  # and a short one caps both defaults
    (None, 16, 1024),
])
def test_server_default_lengths(model_max, completion, chat):
    """Defaults only: the least of the limits that apply, as vLLM; an explicit value is
    the client's."""
    from llmfast.serve.api.protocol import ChatCompletionRequest, CompletionRequest
    from llmfast.serve.api.sampling import chat_inputs, completion_inputs
    from llmfast.serve.frontend_types import Limits

    defaults = (("temperature", 0.3),) + ((("max_tokens", model_max),) if model_max else ())
    limits = Limits(max_n=4, max_model_len=1024, sampling_defaults=defaults)
    for body in ({"prompt": "hi"}, {"prompt": "hi", "max_tokens": None}):
        (params,) = completion_inputs(CompletionRequest.model_validate(body), limits).params
        assert (params.max_tokens, params.temperature) == (completion, 0.3)
    (params,) = completion_inputs(CompletionRequest.model_validate(
        {"prompt": "hi", "max_tokens": 30, "temperature": 1.0}), limits).params
    assert (params.max_tokens, params.temperature) == (30, 1.0)
    (params,) = chat_inputs(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}]}), limits).params
    assert params.max_tokens == chat
