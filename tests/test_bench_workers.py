"""`llmfast bench` and `llmfast profile` with the model in worker processes (`mp`, one
rank and two): every mode runs. The sweep's weight bytes are each rank's shards, equal
to the in-process engine's figure split as tensor parallelism splits it (and to a count
from the config alone); the HF baseline of a random preset computes what the workers
compute; start-up figures, compile stats and the environment's GPU facts come from rank 0.
Ray: tests/test_executor_ray.py."""

from __future__ import annotations

import json

import pytest

from llmfast.bench.environment import cpu_name, rank_device_facts
from llmfast.models.sources.model_source import resolve_model
from tests.helpers.cli import TINY, invoke
from tests.helpers.weight_bytes import expected_decode_weight_bytes

SWEEP = ["--sizes", "1,2", "--context", "8", "--steps", "3"]
# Weights the TP split leaves whole on every rank: the 2 norms of each layer, the final one.
CONFIG = resolve_model("random:tiny").config


def workers(tp: int) -> list[str]:
    return ["-tp", str(tp), "--distributed-executor-backend", "mp"]


def _sweep_report(tmp_path, *args: str) -> dict:
    out = tmp_path / f"sweep-{len(args)}.json"
    result = invoke("bench", *TINY, *SWEEP, *args, "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "decode sweep" in result.stdout
    report = json.loads(out.read_text())
    run = report["runs"]["default"]
    assert [p["batch_size"] for p in run["sweep"]] == [1, 2] and run["sweep_skipped"] == []
    assert all(p["all_decode"] for p in run["sweep"])
    # The environment's device facts are the ones rank 0 reported.
    assert {k: report["environment"][k] for k in run["device_facts"]} == run["device_facts"]
    return report


def _sweep(tmp_path, *args: str) -> dict:
    run = _sweep_report(tmp_path, *args)["runs"]["default"]
    assert run["bandwidth"] is None  # CPU
    assert run["device_facts"] == {"device": "cpu"}
    return run


@pytest.fixture(scope="module")
def uni_run(tmp_path_factory):
    return _sweep(tmp_path_factory.mktemp("uni"))


def test_sweep_in_workers_reports_each_rank_s_weight_bytes(uni_run, tmp_path):
    """Two ranks; one rank's sweep is the GPU-facts test's below (a worker set's start is
    ~20-60 s on the 2-core CI machine)."""
    _check_rank_weight_bytes(uni_run, _sweep(tmp_path, *workers(2)), 2)


def _check_rank_weight_bytes(uni_run: dict, run: dict, tp: int) -> None:
    uni_bytes = uni_run["sweep"][0]["weight_bytes"]
    assert uni_run["weight_bytes_per_rank"] == [uni_bytes]
    assert uni_bytes == expected_decode_weight_bytes(CONFIG)

    assert run["engine_config"]["parallel"]["distributed_executor_backend"] == "mp"
    assert run["engine_config"]["parallel"]["tensor_parallel_size"] == tp
    assert {"join_group", "load", "kv_cache"} <= set(run["startup"])  # rank 0's
    h, vocab = CONFIG.hidden_size, CONFIG.vocab_size
    replicated = 4 * (2 * CONFIG.num_hidden_layers + 1) * h
    # The in-process figure split as TP splits it: everything but the norms W ways
    # (this vocabulary divides evenly, so the LM head's rows too).
    assert vocab % tp == 0
    per_rank = (uni_bytes - replicated) // tp + replicated
    assert run["weight_bytes_per_rank"] == [per_rank] * tp
    assert per_rank == expected_decode_weight_bytes(CONFIG, tp)
    assert all(p["weight_bytes"] == per_rank for p in run["sweep"])
    for p in run["sweep"]:
        assert p["weight_stream_bytes_per_s"] == pytest.approx(
            per_rank / p["step_latency"]["median"])
    assert ("tensor-parallel ranks" in run["weight_bytes_note"]) == (tp > 1)


# What a rank on an H100 reports (torch.cuda.get_device_properties there): emulates
# workers on a GPU this process cannot see, e.g. a remote Ray cluster driven from a
# host without one.
REMOTE_H100 = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3",
               "device_memory_bytes": 85_045_231_616, "cuda_version": "12.8"}


def test_bench_environment_takes_the_gpu_from_rank_0_and_the_host_from_here(
        uni_run, tmp_path, monkeypatch):
    """One `mp` rank whose RunnerInfo names a GPU this process does not have (there is
    no CUDA here, so querying it here would fail): the report's GPU facts are that
    rank's, the CPU and versions this process's. Its sweep is also the one-rank case of
    the weight bytes per rank (the device facts do not enter them)."""
    import platform
    from dataclasses import replace

    import torch

    from llmfast.executor.base import DistributedExecutor

    assert not torch.cuda.is_available()
    reported = DistributedExecutor.runner_infos.fget
    monkeypatch.setattr(DistributedExecutor, "runner_infos", property(
        lambda self: tuple(replace(info, **REMOTE_H100) for info in reported(self))))
    report = _sweep_report(tmp_path, *workers(1))
    env, run = report["environment"], report["runs"]["default"]
    assert run["device_facts"] == {"device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3",
                                   "gpu_memory_gib": 79.2, "cuda": "12.8"}
    assert env["gpu"] == "NVIDIA H100 80GB HBM3" and env["gpu_memory_gib"] == 79.2
    assert env["device"] == "cuda:0" and env["cuda"] == "12.8"
    assert env["torch"] == torch.__version__ and env["cpu"] == cpu_name()
    assert env["python"] == platform.python_version()
    # The sweep's HBM peak follows the same rank; its copy bandwidth cannot be measured here.
    assert run["bandwidth"]["name"] == "NVIDIA H100 80GB HBM3"
    assert run["bandwidth"]["peak_bytes_per_s"] == 3.35e12
    assert run["bandwidth"]["measured_copy_bytes_per_s"] is None
    _check_rank_weight_bytes(uni_run, run, 1)


@pytest.fixture(scope="module")
def mp_llm():
    from llmfast import LLM

    llm = LLM("random:tiny", device="cpu", max_model_len=64, num_gpu_blocks_override=32,
              tensor_parallel_size=2, distributed_executor_backend="mp")
    yield llm
    llm.engine.shutdown()


def test_runner_infos_and_the_hf_baseline_model_in_workers(mp_llm):
    """Each rank reports itself; the HF model the baseline builds when the weights are in
    workers (the preset drawn again here) gives the TP=2 engine's greedy tokens."""
    import torch

    from llmfast import SamplingParams
    from llmfast.bench.hf import load_hf_model

    engine = mp_llm.engine
    assert engine.executor.local_runner is None
    infos = engine.runner_infos
    assert [(i.rank, i.world_size, i.device, i.device_name, i.device_memory_bytes,
             i.cuda_version) for i in infos] == [
        (0, 2, "cpu", "cpu", None, None), (1, 2, "cpu", "cpu", None, None)]
    assert engine.runner_info == infos[0]
    assert rank_device_facts(engine.runner_info) == {"device": "cpu"}
    assert all(i.compile_stats is None for i in infos)  # eager on CPU
    prompts = [[5, 9, 3, 7, 11], [40, 2, 99]]
    got = mp_llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    hf = load_hf_model(engine)
    for prompt, out in zip(prompts, got):
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6,
                          do_sample=False, pad_token_id=0)
        assert ids[0, len(prompt):].tolist() == out.outputs[0].token_ids


def test_throughput_hf_baseline_and_latency_in_workers(mp_llm):
    """What `bench --mode throughput --baseline hf` and `--mode latency` run (the command
    adds nothing that depends on where the model runs)."""
    from llmfast.bench import random_requests, run_latency, run_throughput
    from llmfast.bench.hf import load_hf_model, run_hf_baseline

    engine = mp_llm.engine
    requests = random_requests(3, 6, 4, engine.config.model.vocab_size, seed=1)
    ours = run_throughput(engine, requests)
    theirs = run_hf_baseline(load_hf_model(engine), requests)
    assert ours.output_tokens == theirs.output_tokens == 12
    latency = run_latency(engine, requests, request_rate=float("inf"))
    assert latency.num_requests == 3 and latency.ttft.count == 3


def test_startup_child_reads_rank_0_through_the_executor(tmp_path):
    """What `bench --startup` runs in each fresh process (in this one: a fresh process
    each, with its workers, would cost ~20 s)."""
    from llmfast.cli import startup_child

    out = tmp_path / "child.json"
    spec = {"model": "random:tiny", "engine_args": {
        "device": "cpu", "max_model_len": 64, "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp"}}
    startup_child.main(["child", json.dumps(spec), str(out)])
    report = json.loads(out.read_text())
    assert {"join_group", "load", "kv_cache"} <= set(report["stages"])
    assert report["engine_s"] >= sum(report["stages"].values())
    assert report["compile_summary"] == "" and report["compile_cache_misses"] == 0
    assert report["device_facts"] == {"device": "cpu"}  # rank 0's, from its worker


def test_profile_in_workers_says_what_it_cannot_time(tmp_path):
    result = invoke("profile", *TINY, *workers(2), "--sizes", "1,2", "--steps", "2",
                    "--context", "8", "--tracer", "none", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["executor"]["backend"] == "mp" and summary["executor"]["world_size"] == 2
    assert summary["environment"]["device"] == "cpu" and "gpu" not in summary["environment"]
    assert "forward" in summary["executor"]["note"]
    assert {"schedule", "wait_output", "update"} <= set(summary["phases"])
    assert not any(name.startswith("forward") for name in summary["phases"])  # in the workers
    assert [p["batch_size"] for p in summary["sweep"]] == [1, 2]
    assert "2 mp worker(s)" in result.stdout
