"""Helpers for the server tests (imported by them; not a pytest conftest): a real
`llmfast serve` subprocess on a free loopback port, its /metrics as numbers, and a
frontend over an engine core's busy loop in this process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from llmfast.utils.ports import free_port

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key"


def repo_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    log_path: Path

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value for every sample of /metrics."""
        return parse_metrics(httpx.get(self.base_url + "/metrics", timeout=10).text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()



def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample of a Prometheus text exposition."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values

def start_server(model_dir: Path, log_path: Path, *extra: str, timeout: float = 180.0
                 ) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "llmfast", "serve", str(model_dir), "--port", str(port),
           "--kv-cache-memory", "32MiB", *extra]
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes to it until it exits
    proc = subprocess.Popen(cmd, cwd=REPO, env=repo_env(), stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"llmfast serve exited with {proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"llmfast serve did not become healthy in {timeout} s:\n{server.log()[-3000:]}")


@contextlib.asynccontextmanager
async def serving_front(engine):
    """The engine's core behind `EngineCoreProc` on a thread of this process (its step can
    be patched), a started `Frontend` connected to it as in `llmfast serve`; yields both."""
    from llmfast.engine.core_process import EngineCoreProc
    from llmfast.engine.processing.tokenizer import FrontendTokenizer
    from llmfast.serve.frontend import Frontend, FrontendSpec, api_limits

    with tempfile.TemporaryDirectory() as tmp:
        inp, out = f"ipc://{tmp}/input", f"ipc://{tmp}/output"
        proc = EngineCoreProc(engine.core, inp, out, owns_core=False)
        loop = threading.Thread(target=proc.run, daemon=True)
        loop.start()
        tokens = FrontendTokenizer(engine.tokenizer, None, engine.eos_token_ids)
        spec = FrontendSpec("tiny", api_limits(engine.config, tokens),
                            engine.input_processor.limits, tokens, engine.core.stats(), inp,
                            out, os.getpid())
        front = Frontend(spec)
        front.start()
        try:
            yield front, proc
        finally:
            front.stop()
            front.join()
            proc.request_stop()
            await asyncio.to_thread(loop.join, 30)
            assert not loop.is_alive()


def offline_text(engine, prompt, n: int) -> str:
    """What the engine alone generates greedily for `prompt` (n tokens)."""
    from llmfast.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    req_id = engine.add_request(prompt, params, stream=False)
    while True:
        for out in engine.step():
            if out.request_id == req_id and out.finished:
                return out.outputs[0].text


async def drain(rs) -> list:
    """A DeltaQueue's items until every choice finished or an error came."""
    from llmfast.serve.frontend_types import StreamError

    items, finished = [], 0
    while finished < rs.num_choices:
        item = await asyncio.wait_for(rs.get(), 60)
        items.append(item)
        if isinstance(item, StreamError):
            break
        finished += item.finish_reason is not None
    return items


async def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")
