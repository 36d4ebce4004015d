"""The ray executor: two Ray actors in a placement group on a local cluster that llmfast
starts itself give the greedy tokens of the in-process runner (async scheduling off and
on, a workload that preempts and hits the prefix cache); an actor killed mid-run ends
the engine with an error naming its rank, and the engine's failure takes the actors and
the local cluster down with it. Slow: the same for a Qwen3 checkpoint, and the address of
an existing cluster."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from llmfast import LLM, SamplingParams
from llmfast.bench import run_sweep
from llmfast.executor import ExecutorError, WorkerDied
from llmfast.executor.errors import WorkerFailed
from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.cli import TINY, invoke
from tests.helpers.processes import children, wait_until_gone
from tests.helpers.tensor_parallel import ENGINE, run_workload
from tests.helpers.weight_bytes import expected_decode_weight_bytes

RAY = {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_tp2_ray_tokens_equal_uni_then_a_killed_actor_stops_everything(family, tmp_path):
    import ray

    assert not ray.is_initialized()  # llmfast starts (and stops) the local cluster
    path = make_hf_checkpoint(tmp_path / "model", family=family)
    uni = LLM(str(path), async_scheduling=False, **ENGINE)
    want, _, _ = run_workload(uni)
    del uni
    before = children()
    llm = LLM(str(path), async_scheduling=False, **RAY, **ENGINE)
    engine = llm.engine
    assert engine.executor.backend == "ray"
    for async_scheduling in (False, True):
        engine.set_async_scheduling(async_scheduling)
        tokens, preemptions, prefix_hits = run_workload(llm)
        assert tokens == want, async_scheduling
        assert preemptions > 0 and prefix_hits > 0
    assert {"join_group", "load", "kv_cache"} <= set(engine.startup_times)
    # The bench reads each actor's runner through the executor, as with mp workers.
    want_bytes = [expected_decode_weight_bytes(engine.config.model, 2, r) for r in range(2)]
    assert [(i.rank, i.decode_weight_bytes) for i in engine.runner_infos] == [
        (0, want_bytes[0]), (1, want_bytes[1])]
    sweep = run_sweep(engine, [1, 2], context_len=8, steps=2)
    assert [p.batch_size for p in sweep.points] == [1, 2] and sweep.skipped == []
    assert sweep.weight_bytes_per_rank == want_bytes

    pids = engine.executor.worker_pids()  # the actors run on this machine
    for i in range(4):
        engine.add_request({"prompt_token_ids": [5 + i] * 9},
                           SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    for _ in range(3):
        engine.step()
    # A rank's failure report stands while its peers live, and names a dead peer (its
    # collective failing first is what a killed peer causes).
    reset = WorkerFailed(0, "Connection reset by peer", "in a step")
    assert engine.executor._peer_death_behind(reset) is reset
    os.kill(pids[1], signal.SIGKILL)
    cause = engine.executor._peer_death_behind(reset, grace_s=30)
    assert isinstance(cause, WorkerDied) and cause.rank == 1
    start = time.monotonic()
    with pytest.raises(WorkerDied) as caught:
        while time.monotonic() - start < 60:
            engine.step()
    assert time.monotonic() - start < 30
    assert caught.value.rank == 1 and str(caught.value).startswith("worker rank 1 died (Ray")
    with pytest.raises(ExecutorError, match="stopped earlier"):
        engine.step()
    assert not ray.is_initialized()  # the failure shut the local cluster down
    assert not wait_until_gone(pids, 15)
    assert not wait_until_gone(children() - before, 30), "Ray processes left behind"


def test_an_address_where_nothing_listens_is_one_line_at_once():
    """Ray itself retries such an address for minutes (over five measured): llmfast
    checks that something answers there first."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "llmfast", "generate", "hi", *TINY, "-tp", "2",
             "--distributed-executor-backend", "ray", "--ray-address", f"127.0.0.1:{port}"],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
            timeout=90, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("a Ray address where nothing listens was retried past 90 s")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: cannot connect to the Ray cluster at 127.0.0.1:{port}: nothing answers at "
        f"127.0.0.1:{port} (Connection refused)"]


@pytest.mark.slow
def test_generate_connects_to_an_existing_cluster_by_address():
    """`--ray-address` of a cluster this test started: the CLI's actors run there and go
    when the CLI exits; the cluster stays up."""
    import ray

    want = invoke("generate", "hello there", *TINY, "--json", "-", "--temperature", "0",
                  "--max-tokens", "6", "--ignore-eos", "--max-model-len", "64")
    assert want.exit_code == 0, want.output
    context = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
                       runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        result = subprocess.run(
            [sys.executable, "-m", "llmfast", "generate", "hello there", *TINY, "--json", "-",
             "--temperature", "0", "--max-tokens", "6", "--ignore-eos", "--max-model-len",
             "64", "-tp", "2", "--distributed-executor-backend", "ray",
             "--ray-address", context.address_info["gcs_address"]],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
            timeout=300, check=False)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)[0]["token_ids"] == json.loads(want.stdout)[0][
            "token_ids"]
        # Its actors and placement group are gone: every CPU of the cluster is free.
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU") != 2:
            assert time.monotonic() < deadline, "the CLI's actors outlived it"
            time.sleep(0.5)
    finally:
        ray.shutdown()
