"""One LLM, many callers: every request's outputs reach its own caller, whoever steps the
engine; abandoned streams abort and free their blocks. The oracle is the same prompts run
by one plain `generate` call (batched greedy equals HF alone: tests/test_engine.py)."""

from __future__ import annotations

import gc
import itertools
import threading

import pytest

from llmfast import LLM, SamplingParams
from tests.helpers.checkpoints import make_hf_checkpoint

PROMPTS = [[3 + i, 10 + 2 * i, 40 + 3 * i, 7] for i in range(8)]
LENGTHS = [5, 9, 3, 12, 7, 4, 10, 6]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = make_hf_checkpoint(tmp_path_factory.mktemp("routing") / "ckpt", vocab_size=256)
    return LLM(str(ckpt), device="cpu", max_model_len=128, block_size=4)


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [_params(n) for n in LENGTHS])
    return [list(o.outputs[0].token_ids) for o in outs]


def _gen(llm, indices):
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices],
                        [_params(LENGTHS[i]) for i in indices])
    return [list(o.outputs[0].token_ids) for o in outs]


def _stream(llm, i):
    return llm.stream({"prompt_token_ids": PROMPTS[i]}, _params(LENGTHS[i]))


def _all_blocks_free(llm) -> bool:
    stats = llm.engine.stats()
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    return (stats.num_running_reqs == stats.num_waiting_reqs == 0
            and pool.get_num_free_blocks() == pool.num_usable_blocks)


def test_generate_from_several_threads(llm, expected):
    groups = [[0, 1, 2], [3, 4], [5, 6, 7], [2, 3, 6]]
    results: dict[int, object] = {}
    start = threading.Barrier(len(groups))

    def worker(k):
        start.wait()
        try:
            for _ in range(3):
                results.setdefault(k, []).append(_gen(llm, groups[k]))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[k] = e

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k, group in enumerate(groups):
        assert results[k] == [[expected[i] for i in group]] * 3, k
    assert _all_blocks_free(llm)


def test_stream_stays_open_while_generate_runs(llm, expected):
    stream = _stream(llm, 3)  # 12 tokens
    first = next(stream)
    tokens = list(first.outputs[0].delta_token_ids)
    # generate steps the engine for both; the stream's outputs wait in its queue.
    assert _gen(llm, [0, 2]) == [expected[0], expected[2]]
    last = first
    for out in stream:
        tokens += out.outputs[0].delta_token_ids
        last = out
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert tokens == expected[3] == last.outputs[0].token_ids
    assert _all_blocks_free(llm)


def test_two_streams_read_alternately(llm, expected):
    a, b = _stream(llm, 1), _stream(llm, 4)
    got = {1: [], 4: []}
    for x, y in itertools.zip_longest(a, b):
        for i, out in ((1, x), (4, y)):
            if out is not None:
                got[i] += out.outputs[0].delta_token_ids
    assert got == {1: expected[1], 4: expected[4]}
    assert _all_blocks_free(llm)


def test_stream_in_one_thread_generate_in_another(llm, expected):
    got: dict[str, object] = {}

    def streamer():
        got["stream"] = [t for out in _stream(llm, 6) for t in out.outputs[0].delta_token_ids]

    thread = threading.Thread(target=streamer)
    thread.start()
    got["generate"] = _gen(llm, [7, 0, 5])
    thread.join(timeout=120)
    assert got == {"stream": expected[6], "generate": [expected[7], expected[0], expected[5]]}
    assert _all_blocks_free(llm)


def test_abandoned_stream_aborts_and_frees_blocks(llm, expected):
    stream = _stream(llm, 3)
    next(stream)
    next(stream)
    assert not _all_blocks_free(llm)
    del stream  # no close(): the finaliser aborts it
    gc.collect()
    assert _all_blocks_free(llm)
    # A stream never iterated holds its request from the start; dropping it aborts too.
    _stream(llm, 6)
    assert _all_blocks_free(llm)
    # Closed in the middle of others' work: the others finish with the right tokens.
    kept, dropped = _stream(llm, 1), _stream(llm, 3)
    next(dropped)
    dropped.close()
    assert [t for out in kept for t in out.outputs[0].delta_token_ids] == expected[1]
    assert _all_blocks_free(llm)


def test_stream_dropped_while_another_thread_steps(llm, expected):
    """A finaliser that runs while another thread holds the engine must not wait for it
    nor touch the engine: the request is aborted when that thread's engine call ends."""
    stream = _stream(llm, 3)
    next(stream)
    held, release = threading.Event(), threading.Event()

    def holder():
        with llm._engine_call():  # what a stepping thread holds
            held.set()
            release.wait(timeout=60)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(timeout=60)
    del stream  # returns at once: the lock is taken
    assert llm.engine.stats().num_running_reqs == 1
    release.set()
    thread.join(timeout=60)
    assert _all_blocks_free(llm)
    assert _gen(llm, [2]) == [expected[2]]


def test_rejected_prompt_in_a_batch_adds_nothing(llm):
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": [999]}],
                     _params(4))
    assert _all_blocks_free(llm) and not llm.engine.has_unfinished()


def test_outputs_reach_their_queue_whoever_steps(llm, expected):
    """The output processor routes: a request `LLM` added (with a queue) gets its outputs
    there, even from steps run on the engine directly; one added on the engine without a
    queue comes back from `step()`, alone."""
    stream = _stream(llm, 0)
    direct = llm.engine.add_request({"prompt_token_ids": PROMPTS[1]}, _params(LENGTHS[1]))
    returned = []
    while llm.engine.has_unfinished():
        returned.extend(llm.engine.step())
    assert {out.request_id for out in returned} == {direct}
    assert [t for out in returned for t in out.outputs[0].delta_token_ids] == expected[1]
    # Every step's output waited in the stream's queue: read now, with no step left.
    assert [t for out in stream for t in out.outputs[0].delta_token_ids] == expected[0]
    assert _all_blocks_free(llm)


def test_ctrl_c_keeps_the_finished_outputs(llm, expected):
    """A KeyboardInterrupt between steps (where a Ctrl-C lands while generate waits) hands
    back what finished, in input order; the rest is aborted and its blocks freed."""
    from llmfast import GenerationInterrupted

    def interrupt_once_one_finished(done, total):
        if done >= 1:
            raise KeyboardInterrupt

    short, long = 2, 3  # LENGTHS 3 and 12: the first ends well before the second
    with pytest.raises(GenerationInterrupted) as info:
        llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in (long, short)],
                     [_params(LENGTHS[i]) for i in (long, short)],
                     progress=interrupt_once_one_finished)
    assert isinstance(info.value, KeyboardInterrupt)  # code catching Ctrl-C still does
    unfinished, finished = info.value.outputs
    assert unfinished is None
    assert finished.finished and list(finished.outputs[0].token_ids) == expected[short]
    assert not llm.engine.has_unfinished()
    assert _gen(llm, [long]) == [expected[long]]  # the engine serves on
