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
from tests.helpers.processes import children, wait_until_gone, with_marker

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
