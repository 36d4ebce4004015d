"""The mp executor when things go wrong: a worker killed mid-run ends the engine within
seconds with an error naming its rank; the engine's process ending (normally, by Ctrl-C or killed outright) or dropping its
`LLM` (tests/test_executor_mp.py) leaves no worker process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from llmfast import LLM, SamplingParams
from llmfast.executor import ExecutorError, WorkerDied
from llmfast.executor.errors import WorkerFailed
from tests.helpers.processes import children, wait_until_gone, with_marker
from tests.helpers.engine_config import engine_config

TP2 = {"device": "cpu", "tensor_parallel_size": 2, "distributed_executor_backend": "mp",
       "max_model_len": 256, "block_size": 4, "num_gpu_blocks_override": 256, "seed": 0}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_until_error(engine, timeout_s: float) -> tuple[ExecutorError, float]:
    start = time.monotonic()
    with pytest.raises(ExecutorError) as caught:
        while time.monotonic() - start < timeout_s:
            engine.step()
    return caught.value, time.monotonic() - start


@pytest.mark.parametrize("rank", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_killed_worker_ends_the_engine_naming_its_rank(rank):
    llm = LLM("random:tiny", **TP2)
    engine = llm.engine
    pids = engine.executor.worker_pids()
    for i in range(4):
        engine.add_request({"prompt_token_ids": [5 + i] * 9},
                           SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    os.kill(pids[rank], signal.SIGKILL)
    error, elapsed = _run_until_error(engine, 60)
    assert elapsed < 30
    assert isinstance(error, WorkerDied) and error.rank == rank
    assert str(error) == f"worker rank {rank} died (killed by SIGKILL); the engine stopped"
    assert not wait_until_gone(pids, 10)  # the other rank was stopped, both reaped
    assert not set(pids) & children()
    with pytest.raises(ExecutorError, match="stopped earlier: worker rank"):
        engine.step()
    engine.shutdown()  # nothing left to stop: a no-op


def test_a_rank_failing_because_a_peer_died_is_reported_as_that_death():
    """Killing rank 1 resets rank 0's gloo connection, and rank 0's error report may reach
    the engine before rank 1's exit does: the report then names the death, the cause."""
    llm = LLM("random:tiny", **TP2)
    executor = llm.engine.executor
    pids = executor.worker_pids()
    reset = WorkerFailed(0, "Read error [127.0.0.1]:7077: Connection reset by peer",
                         "in a step")
    start = time.monotonic()
    assert executor._peer_death_behind(reset, grace_s=0.3) is reset  # nobody died
    assert time.monotonic() - start >= 0.3
    os.kill(pids[1], signal.SIGKILL)
    cause = executor._peer_death_behind(reset)
    assert isinstance(cause, WorkerDied) and cause.rank == 1
    assert str(cause) == "worker rank 1 died (killed by SIGKILL); the engine stopped"
    llm.engine.shutdown()
    assert not wait_until_gone(pids, 10)


_SCRIPT = textwrap.dedent("""
    import sys, time
    from llmfast import LLM
    llm = LLM("random:tiny", device="cpu", tensor_parallel_size=2,
              distributed_executor_backend="mp", max_model_len=64,
              num_gpu_blocks_override=64)
    print(*llm.engine.executor.worker_pids(), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                 signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_engine_process_ending_leaves_no_worker(sig):
    """Ctrl-C runs the exit path (the executor's finalizer stops the workers); a killed
    engine cannot, so the workers notice by themselves (end of file, parent gone)."""
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": ROOT, "LLMFAST_TEST_MARKER": marker}
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else line
        assert set(pids) == with_marker("LLMFAST_TEST_MARKER", marker) - {proc.pid}
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert not wait_until_gone(pids, 10)
        assert not with_marker("LLMFAST_TEST_MARKER", marker)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # ~60-95 s on the 2-core CI machine (a server and a TP=2 worker set)
def test_server_front_reports_a_dead_worker_idle_and_mid_stream():
    """`llmfast serve` over mp: the engine core's process holds the workers; a worker
    killed mid-stream ends that stream with a 503 naming the rank, /health then answers
    503 with the cause, and new requests get it. A worker killed while the server is idle
    is noticed without any request. Nothing is left running."""
    import asyncio
    import logging

    import httpx

    from llmfast.engine.args import EngineArgs
    from llmfast.serve.api.app import ServeConfig, build_app
    from llmfast.serve.frontend import Frontend
    from llmfast.serve.launcher import CoreHandle
    from llmfast.serve.server import frontend_spec
    from llmfast.serve.frontend_types import DeltaQueue, EngineUnavailable, StreamError

    pids: list[int] = []
    config, source = engine_config(EngineArgs.from_kwargs(model="random:tiny", **TP2))

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    async def health(app) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/health")

    async def wait_for_failure(front: Frontend) -> float:
        start = time.monotonic()
        while front.failure is None and time.monotonic() - start < 30:
            await asyncio.sleep(0.05)
        return time.monotonic() - start

    async def mid_stream(core: CoreHandle) -> None:
        front = Frontend(frontend_spec(core, config, source, "tiny"))
        front.start()
        app = build_app(front, ServeConfig(model_name="tiny"))
        try:
            assert (await health(app)).status_code == 200
            rs = DeltaQueue("a", 1)
            await front.add(rs, [[5] * 9], [params(10_000)])
            first = await asyncio.wait_for(rs.get(), 60)  # streaming has begun
            assert first.num_new_tokens >= 1
            workers = sorted(children(core.pid))
            pids.extend(workers)
            os.kill(workers[-1], signal.SIGKILL)
            while True:
                item = await asyncio.wait_for(rs.get(), 30)
                if isinstance(item, StreamError):
                    break
            assert item.status == 503
            assert "died (killed by SIGKILL)" in item.message
            reply = await health(app)
            assert reply.status_code == 503 and reply.json()["status"] == "error"
            assert "died" in reply.json()["message"]
            with pytest.raises(EngineUnavailable, match="the engine stopped"):
                await front.add(DeltaQueue("b", 1), [[5] * 9], [params(4)])
        finally:
            front.stop()
            front.join()

    async def idle(core: CoreHandle) -> None:
        front = Frontend(frontend_spec(core, config, source, "tiny"))
        front.start()
        try:
            await asyncio.sleep(0.5)
            workers = sorted(children(core.pid))
            pids.extend(workers)
            os.kill(workers[0], signal.SIGKILL)
            assert await wait_for_failure(front) < 15
            assert "died" in front.failure
            assert not front.running
        finally:
            front.stop()
            front.join()

    for case in (mid_stream, idle):
        core = CoreHandle(config, source, logging.WARNING)
        pids.append(core.pid)
        try:
            asyncio.run(case(core))
        finally:
            core.stop()
    assert not wait_until_gone(pids, 10)
    assert not set(pids) & children()
