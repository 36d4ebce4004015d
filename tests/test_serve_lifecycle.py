"""`llmfast serve` with --api-key, and its shutdown: SIGTERM ends in-flight streams with
an error event and in-flight requests with a 503, and the process exits."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from tests.serve_server import API_KEY, start_server


@pytest.fixture(scope="module", params=[0, 2], ids=lambda n: f"api-servers-{n}")
def keyed_server(request, serve_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-keyed") / "server.log"
    proc = start_server(serve_model_dir, log, "--api-key", API_KEY, "--max-model-len", "2048",
                        "--api-servers", str(request.param))
    yield proc
    proc.stop()


def test_api_key(keyed_server):
    base = keyed_server.base_url
    assert httpx.get(base + "/health").status_code == 200  # probes need no key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(base + "/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401
    key = {"Authorization": f"Bearer {API_KEY}"}
    for method, route, body in (("POST", "/tokenize", {"prompt": "hi"}),
                                ("POST", "/detokenize", {"tokens": [1]}),
                                ("GET", "/version", None)):
        r = httpx.request(method, base + route, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.request(method, base + route, json=body, headers=key).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.v1, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=keyed_server.v1, api_key=API_KEY, max_retries=0)
    out = client.completions.create(model=client.models.list().data[0].id, prompt="hi",
                                    max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_sigterm_ends_streams_and_exits(keyed_server):
    client = openai.OpenAI(base_url=keyed_server.v1, api_key=API_KEY, max_retries=0,
                           timeout=60)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    long = {"prompt": "hello there", "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
    whole: dict = {}

    def non_streaming():
        whole["response"] = httpx.post(keyed_server.base_url + "/v1/completions", json=long,
                                       headers=headers, timeout=60)

    waiter = threading.Thread(target=non_streaming)
    waiter.start()
    stream = client.completions.create(model="tiny", stream=True, **{
        k: v for k, v in long.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    deadline = time.monotonic() + 30  # both requests in the engine before the signal
    while keyed_server.metrics()["llmfast_num_requests_running"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    keyed_server.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in chunks:
            pass
    waiter.join(timeout=30)
    response = whole["response"]
    assert response.status_code == 503
    assert "shutting down" in response.json()["error"]["message"]
    keyed_server.proc.wait(timeout=30)
    assert time.monotonic() - sent < 30
    assert "Traceback" not in keyed_server.log()
