"""`llmfast serve` as a whole under faults: the engine core's process killed mid-stream,
Ctrl-C; and the access log. Every live request ends with an error event, the server
exits with one error line (or by the signal), and no process it started is left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve_server import start_server

LONG = {"prompt": "hello there", "max_tokens": 1900, "temperature": 0, "ignore_eos": True}


def _children(pid: int) -> dict[int, bytes]:
    """pid -> command line of `pid`'s child processes."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
    return out


def _gone(pids, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and b"Z" not in Path(f"/proc/{p}/stat")
                   .read_bytes().rsplit(b")", 1)[1][:3] for p in pids):
            return True
        time.sleep(0.1)
    return False


def _stream(server):
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny", stream=True, **{
        k: v for k, v in LONG.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    return chunks


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads Linux's /proc")
# The in-process frontend (api_servers 0) is slow-marked to keep the default suite short;
# the API-process case runs by default.
@pytest.mark.parametrize("api_servers", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_the_core_process_killed_mid_stream(serve_model_dir, tmp_path, api_servers):
    server = start_server(serve_model_dir, tmp_path / "server.log", "--max-model-len", "2048",
                          "--api-servers", str(api_servers))
    try:
        children = _children(server.proc.pid)
        core = [p for p, cmd in children.items() if b"llmfast.engine.core_process" in cmd]
        assert len(core) == 1 and len(children) == 1 + api_servers, children
        chunks = _stream(server)
        os.kill(core[0], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine core process .* exited"):
            for _ in chunks:
                pass
        assert server.proc.wait(timeout=60) == 1
        log = server.log()
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "engine core process" in errors[0], log
        assert "Traceback" not in log
        assert _gone(children)
    finally:
        server.stop()


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads Linux's /proc")
def test_ctrl_c_ends_streams_and_every_process(serve_model_dir, tmp_path):
    server = start_server(serve_model_dir, tmp_path / "server.log", "--max-model-len", "2048")
    try:
        children = _children(server.proc.pid)
        chunks = _stream(server)
        server.proc.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        # The CLI ends an interrupt with 130, as a shell does.
        assert server.proc.wait(timeout=30) in (130, -signal.SIGINT)
        assert "Traceback" not in server.log()
        assert _gone(children)
    finally:
        server.stop()


@pytest.mark.slow  # two server starts, ~60 s each on the 2-core CI machine
@pytest.mark.parametrize("flag", [[], ["--no-access-log"]], ids=["default", "silenced"])
def test_access_log_shows_client_errors(serve_model_dir, tmp_path, flag):
    """A request line per HTTP request on the server's log by default, a 4xx included;
    `--no-access-log` silences it. A request without `model` is served (as vLLM does)."""
    server = start_server(serve_model_dir, tmp_path / "server.log", "--api-servers", "1",
                          *flag)
    try:
        bad = httpx.post(server.v1 + "/completions", json={"prompt": "hi", "n": 0})
        assert bad.status_code == 400
        ok = httpx.post(server.v1 + "/completions", timeout=60,
                        json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["model"]
        time.sleep(0.5)
        lines = [line for line in server.log().splitlines() if "/v1/completions" in line]
        if flag:
            assert lines == []
        else:
            assert any("400" in line for line in lines), server.log()
            assert any("200" in line for line in lines), server.log()
    finally:
        server.stop()
