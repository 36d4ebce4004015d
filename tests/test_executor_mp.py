"""The mp executor: tensor parallelism over two worker processes (gloo on CPU) gives the
greedy tokens of the in-process runner, for a Llama and a Qwen3 checkpoint, with async
scheduling off and on, on a workload that preempts and hits the prefix cache (every KV
block free at the end), and across a switch of loops with a step in flight. Each rank
holds its shards of the model (llmfast/models with llmfast/distributed): this checks real
tensor parallelism over gloo. In steady decoding every worker receives one message per
step, in either loop (the kernel's count of the reads a worker process makes)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

import llmfast
from llmfast import LLM, SamplingParams
from llmfast.executor import ExecutorError
from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.processes import children, read_syscalls, wait_until_gone
from tests.helpers.tensor_parallel import ENGINE, run_workload
from tests.helpers.weight_bytes import expected_decode_weight_bytes


SWITCH_PROMPTS = [[7, 9, 11, 13, 15, 17, 19, 21], [30, 31, 32, 33, 34]]
SWITCH_TOKENS = 48
RAMP_STEPS, STEADY_STEPS = 4, 12  # per loop: 2 x 16 steps, fewer than SWITCH_TOKENS


def run_switching_loops(engine, worker_pids=()) -> tuple[list[list[int]], dict[bool, list]]:
    """Greedy tokens of SWITCH_PROMPTS generated in the pipelined loop, then in the
    synchronous one (the switch drains the step in flight: a collect with no launch); and
    per loop (async or not), the read system calls of each worker over STEADY_STEPS
    decode steps."""
    params = SamplingParams(temperature=0.0, max_tokens=SWITCH_TOKENS, ignore_eos=True)
    engine.set_async_scheduling(True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in SWITCH_PROMPTS]
    finished: dict[str, list[int]] = {}

    def keep(outputs) -> None:
        finished.update({o.request_id: list(o.outputs[0].token_ids)
                         for o in outputs if o.finished})

    reads = {}
    for async_scheduling in (True, False):
        keep(engine.set_async_scheduling(async_scheduling))
        for _ in range(RAMP_STEPS):
            keep(engine.step())
        before = [read_syscalls(pid) for pid in worker_pids]
        for _ in range(STEADY_STEPS):
            keep(engine.step())
        reads[async_scheduling] = [read_syscalls(pid) - n
                                   for pid, n in zip(worker_pids, before)]
    while engine.has_unfinished():
        keep(engine.step())
    return [finished[i] for i in ids], reads


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def runs(request, tmp_path_factory):
    """(uni tokens, {async: (mp tokens, preemptions, prefix hits)}, {"llm": the mp LLM,
    "switch": the uni tokens of run_switching_loops})."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param) / "model",
                              family=request.param)
    uni = LLM(str(path), async_scheduling=False, **ENGINE)
    want, _, _ = run_workload(uni)
    want_switch, _ = run_switching_loops(uni.engine)
    del uni
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="mp",
              async_scheduling=False, **ENGINE)
    got = {}
    for async_scheduling in (False, True):
        llm.engine.set_async_scheduling(async_scheduling)
        got[async_scheduling] = run_workload(llm)
    holder = {"llm": llm, "switch": want_switch}
    del llm
    yield want, got, holder
    if "llm" in holder:
        holder["llm"].engine.shutdown()


def test_workers_import_this_checkout_of_llmfast():
    from llmfast.utils.child_processes import PACKAGE_ROOT

    assert (Path(PACKAGE_ROOT) / "llmfast" / "__init__.py").resolve() == \
        Path(llmfast.__file__).resolve()


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


def test_one_message_per_steady_step_in_either_loop_and_tokens_equal_uni(runs):
    """A worker reads each message with two read calls (its 4-byte length, its body): one
    message per step is 2 reads a step. The launch carries the request for the oldest
    step's tokens (rank 0 answers); a separate collect message would make it 4. Stray
    reads of the process (none seen here) would only add: the bound leaves them room."""
    holder = runs[2]
    engine = holder["llm"].engine
    tokens, reads = run_switching_loops(engine, engine.executor.worker_pids())
    assert tokens == holder["switch"]
    for async_scheduling, per_rank in reads.items():
        assert len(per_rank) == 2
        for n in per_rank:
            assert 2 * STEADY_STEPS <= n < 3 * STEADY_STEPS, (async_scheduling, per_rank)


# Last in the module: it drops the shared engine (its family's tests have run by then).
def test_dropping_the_llm_stops_its_workers(runs):
    _, _, holder = runs
    pids = holder["llm"].engine.executor.worker_pids()
    assert set(pids) <= children()
    del holder["llm"]  # the last reference: the executor's finalizer stops the workers
    gc.collect()
    assert not wait_until_gone(pids, 10)
    assert not set(pids) & children()
