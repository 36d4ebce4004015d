"""The mp executor: tensor parallelism over two worker processes (gloo on CPU) gives the
greedy tokens of the in-process runner, for a Llama and a Qwen3 checkpoint, with async
scheduling off and on, on a workload that preempts and hits the prefix cache (every KV
block free at the end). Each rank holds its shards of the model (llmfast/models with
llmfast/distributed): this checks real tensor parallelism over gloo."""

from __future__ import annotations

import gc

import pytest

from llmfast import LLM
from llmfast.executor import ExecutorError
from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.processes import children, wait_until_gone
from tests.helpers.tensor_parallel import ENGINE, run_workload
from tests.helpers.weight_bytes import expected_decode_weight_bytes


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def runs(request, tmp_path_factory):
    """(uni tokens, {async: (mp tokens, preemptions, prefix hits)}, {"llm": the mp LLM})."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param) / "model",
                              family=request.param)
    uni = LLM(str(path), async_scheduling=False, **ENGINE)
    want, _, _ = run_workload(uni)
    del uni
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="mp",
              async_scheduling=False, **ENGINE)
    got = {}
    for async_scheduling in (False, True):
        llm.engine.set_async_scheduling(async_scheduling)
        got[async_scheduling] = run_workload(llm)
    holder = {"llm": llm}
    del llm
    yield want, got, holder
    if "llm" in holder:
        holder["llm"].engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_mp_tokens_equal_uni(runs, async_scheduling):
    want, got, _ = runs
    tokens, preemptions, prefix_hits = got[async_scheduling]
    assert tokens == want
    assert preemptions > 0 and prefix_hits > 0  # the workload exercised both


def test_mp_engine_reports_rank0_startup_and_has_no_local_runner(runs):
    engine = runs[2]["llm"].engine
    assert engine.executor.backend == "mp" and engine.executor.world_size == 2
    assert {"join_group", "load", "kv_cache"} <= set(engine.startup_times)
    with pytest.raises(ExecutorError, match="2 worker.*mp executor"):
        _ = engine.runner
    engine.executor.check_health()


def test_mp_sweep_reads_each_rank_s_shards_through_the_executor(runs):
    """The sweep's weight bytes are each rank's, as Megatron's split counts them from
    the config (Qwen3: per-head q/k norms, replicated)."""
    from llmfast.bench import run_sweep

    engine = runs[2]["llm"].engine
    config = engine.config.model
    want = [expected_decode_weight_bytes(config, 2, rank) for rank in range(2)]
    assert [i.decode_weight_bytes for i in engine.runner_infos] == want
    result = run_sweep(engine, [1, 2], context_len=8, steps=2)
    assert [p.batch_size for p in result.points] == [1, 2] and result.skipped == []
    assert result.weight_bytes_per_rank == want
    assert all(p.weight_bytes == max(want) for p in result.points)


# Last in the module: it drops the shared engine (its family's tests have run by then).
def test_dropping_the_llm_stops_its_workers(runs):
    _, _, holder = runs
    pids = holder["llm"].engine.executor.worker_pids()
    assert set(pids) <= children()
    del holder["llm"]  # the last reference: the executor's finalizer stops the workers
    gc.collect()
    assert not wait_until_gone(pids, 10)
    assert not set(pids) & children()
