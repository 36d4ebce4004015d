"""`llmfast serve --api-servers 2`: two frontend processes, each connected to the engine
core's process. A killed API process takes only its own requests with it (the core aborts
them: their KV blocks are freed at once, not when they would have finished) while the
other keeps serving; when the last one dies the server stops with one error line. (The
OpenAI API itself runs under --api-servers 0 and 1 in every test of test_serve*.py.)"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_server import parse_metrics, start_server

LONG = {"prompt": "hello there", "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
        "stream": True}


def _api_pids(main_pid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == main_pid and b"llmfast.serve.api_process" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def _connection_owner(server_port: int, client_port: int, pids: list[int]) -> int | None:
    """Which of `pids` holds the server side of the TCP connection from `client_port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if (int(local.rsplit(":", 1)[1], 16) == server_port
                    and int(remote.rsplit(":", 1)[1], 16) == client_port):
                inodes.add(f"socket:[{fields[9]}]")
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in inodes:
                    return pid
            except OSError:
                continue
    return None


def _metrics_dirs(server) -> list[Path]:
    """The API processes' shared metrics folder(s) of this server (named by its pid)."""
    return list(Path(tempfile.gettempdir()).glob(f"llmfast-metrics-{server.proc.pid}-*"))


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
def test_a_dead_api_process_takes_only_its_requests_and_the_last_stops_the_server(
        serve_model_dir, tmp_path):
    server = start_server(serve_model_dir, tmp_path / "server.log", "--max-model-len", "2048",
                          "--api-servers", "2")
    port = int(server.base_url.rsplit(":", 1)[1])
    try:
        pids = _api_pids(server.proc.pid)
        assert len(pids) == 2
        # Long streams until each API process holds one (the kernel picks who accepts).
        clients, streams = [], []  # (response, its lines, the API process that has it)
        for _ in range(20):
            client = httpx.Client(base_url=server.base_url, timeout=60)
            clients.append(client)
            stream = client.send(client.build_request("POST", "/v1/completions", json=LONG),
                                 stream=True)
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # it is running
            client_port = stream.extensions["network_stream"].get_extra_info("client_addr")[1]
            streams.append((stream, lines, _connection_owner(port, client_port, pids)))
            if {owner for *_, owner in streams} == set(pids):
                break
        assert {owner for *_, owner in streams} == set(pids), "one API process took all"
        victim, survivor = pids
        os.kill(victim, signal.SIGKILL)
        for _, lines, owner in streams:
            if owner == victim:
                with pytest.raises(httpx.HTTPError):
                    for _ in lines:
                        pass
        # The survivor still serves, new requests included.
        done = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        # The victim's requests were aborted when it died, not left running to their 1900
        # tokens: only the survivor's streams still run.
        survivors = sum(owner == survivor for *_, owner in streams)
        deadline = time.monotonic() + 30
        while server.metrics()["llmfast_num_requests_running"] != survivors:
            assert time.monotonic() < deadline, server.metrics()
            time.sleep(0.1)
        os.kill(survivor, signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
        log = server.log()
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "every API server process exited" in errors[0], log
        assert "Traceback" not in log
    finally:
        server.stop()
        for client in locals().get("clients", []):
            client.close()


def test_outputs_cross_the_socket_whole():
    """Every field of a step's outputs (a new one included, once added here) survives the
    msgpack encoding between the core's process and a frontend."""
    import msgspec

    from llmfast.engine.messages import EngineCoreOutputs, EngineCoreRequest, StepStats
    from llmfast.sampling_params import SamplingParams

    out = EngineCoreOutputs(
        req_ids=["a", "b"], new_token_ids=[[5], [6, 7]], finish_reasons={1: "stop"},
        logprobs={0: ([-0.25], [[5, 9]], [[-0.25, -2.0]])},
        prompt_logprobs={"a": (1, [-3.5], [4], [[5]], [[-0.5]])}, scheduled=[("b", 16)],
        errors={"c": ("internal error in the engine step", 500)},
        stats=StepStats(2, 1, 0, 32, 16, 0.5, 0.25, 7))
    assert all(getattr(out, f) for f in out.__struct_fields__)
    wire = msgspec.msgpack.encode(out)
    assert msgspec.msgpack.decode(wire, type=EngineCoreOutputs) == out
    request = EngineCoreRequest("r", [1, 2], SamplingParams(temperature=0.5, stop=("x",),
                                logit_bias={3: 1.0}, logprobs=2), 12.5, 3)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert back == request


@pytest.fixture(scope="module")
def two_api_server(serve_model_dir, tmp_path_factory):
    """One `--api-servers 2` server for the metrics test and then the stall test, which
    ends it with SIGTERM (a start is ~20-40 s on the 2-core CI machine)."""
    log = tmp_path_factory.mktemp("serve-two-api") / "server.log"
    server = start_server(serve_model_dir, log, "--max-model-len", "2048", "--api-servers", "2")
    yield server
    server.stop()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
def test_metrics_count_the_requests_of_every_api_process(two_api_server):
    """Each API process observes only the requests it takes; whichever answers /metrics
    must report them all (a scrape reaches one process at random). The server is new: no
    request reached it before this test (the stall test after it ends it)."""
    server = two_api_server
    port = int(server.base_url.rsplit(":", 1)[1])

    def on_fresh_connection(method: str, path: str, **kwargs) -> tuple[httpx.Response, int]:
        """The response, and which API process took the connection."""
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            response = client.request(method, path, **kwargs)
            # Still open (keep-alive): its owner can be read from /proc.
            client_port = response.extensions["network_stream"].get_extra_info(
                "client_addr")[1]
            return response, _connection_owner(port, client_port, pids)

    pids = _api_pids(server.proc.pid)
    assert len(pids) == 2
    assert len(_metrics_dirs(server)) == 1
    served_by, tokens = [], 0
    for i in range(40):  # until each process has served some
        r, owner = on_fresh_connection("POST", "/v1/completions", json={
            "prompt": "hello there", "max_tokens": 2 + i % 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        tokens += r.json()["usage"]["completion_tokens"]
        served_by.append(owner)
        if set(served_by) == set(pids) and len(served_by) >= 4:
            break
    assert set(served_by) == set(pids), "one API process took every request"
    scraped_by = set()
    for _ in range(40):  # until each process has answered a scrape
        r, owner = on_fresh_connection("GET", "/metrics")
        values = parse_metrics(r.text)
        assert values['llmfast_request_success_total{finished_reason="length"}'] == \
            len(served_by), (owner, served_by)
        assert values["llmfast_generation_tokens_total"] == tokens
        assert values["llmfast_time_to_first_token_seconds_count"] == len(served_by)
        scraped_by.add(owner)
        if scraped_by == set(pids):
            break
    assert scraped_by == set(pids), "one API process answered every scrape"


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
def test_a_stalled_api_process_stalls_nobody_else(two_api_server):
    """The engine never blocks writing to an API process: with one of two stopped
    (SIGSTOP: a long GC pause, a debugger), a long generation through the other runs to
    its end (the engine's steps would fill the stopped one's pipe within ~1000 steps if
    it waited on it). SIGTERM then ends the server by that signal, as with 0 API servers,
    and the API processes' metrics files go with it."""
    server = two_api_server
    assert _metrics_dirs(server)
    victim, _ = _api_pids(server.proc.pid)
    os.kill(victim, signal.SIGSTOP)
    try:
        done = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
            "prompt": "hi", "max_tokens": 1500, "temperature": 0, "ignore_eos": True})
    finally:
        os.kill(victim, signal.SIGCONT)
    assert done.status_code == 200
    assert done.json()["usage"]["completion_tokens"] == 1500
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == -signal.SIGTERM
    assert "Traceback" not in server.log()
    assert not _metrics_dirs(server)  # the files go with the server
