"""The async front in-process, over a real engine: requests share steps, an abort frees
blocks before the next step, a failing step ends the live requests with an error and the
front keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from llmfast.sampling_params import SamplingParams
from llmfast.serve.engine_loop import AsyncEngine, ChoiceDelta, RequestStream, StreamError


@pytest.fixture(scope="module")
def engine(serve_model_dir):
    from llmfast import LLM

    return LLM(str(serve_model_dir), kv_cache_memory=32 << 20).engine


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def _drain(rs: RequestStream) -> list[ChoiceDelta | StreamError]:
    items, finished = [], 0
    while finished < rs.num_choices:
        item = await rs.get()
        items.append(item)
        if isinstance(item, StreamError):
            break
        finished += item.finish_reason is not None
    return items


def test_requests_share_steps_and_match_offline(engine):
    offline = [engine_text(engine, [3 + i] * 20, 8) for i in range(3)]

    async def main():
        front = AsyncEngine(engine)
        front.start()
        try:
            streams = [RequestStream(f"r{i}", 1) for i in range(3)]
            for i, rs in enumerate(streams):
                await front.add(rs, [[3 + i] * 20], [_params(8)])
            return await asyncio.gather(*(_drain(rs) for rs in streams))
        finally:
            front.stop()
            await asyncio.to_thread(front.join, 10)

    results = asyncio.run(main())
    for items, expected in zip(results, offline):
        assert sum(d.num_new_tokens for d in items) == 8
        assert items[-1].finish_reason == "length" and items[-1].num_output_tokens == 8
        assert "".join(d.text for d in items) == expected
    # Each step delivers one delta per running request: with three requests added before
    # the first step, all three receive their first token in the same step.
    assert [len(items) for items in results] == [8, 8, 8]


def engine_text(engine, prompt, n):
    req_id = engine.add_request(prompt, _params(n), stream=False)
    while True:
        for out in engine.step():
            if out.request_id == req_id and out.finished:
                return out.outputs[0].text


def test_abort_frees_blocks_and_failed_step_is_contained(engine, monkeypatch):
    async def main():
        front = AsyncEngine(engine)
        front.start()
        try:
            rs = RequestStream("long", 1)
            await front.add(rs, [[5] * 40], [_params(400)])
            first = await rs.get()
            assert first.num_new_tokens == 1
            assert front.stats.kv_cache_usage > 0
            front.abort(rs.engine_ids)
            for _ in range(200):  # the engine thread applies it before its next step
                if front.stats.num_running_reqs == 0:
                    break
                await asyncio.sleep(0.01)
            assert front.stats.num_running_reqs == 0 and front.stats.kv_cache_usage == 0

            real_step = engine.step
            calls = 0

            def failing_step():
                nonlocal calls
                calls += 1
                if calls == 3:
                    raise RuntimeError("boom")
                return real_step()

            monkeypatch.setattr(engine, "step", failing_step)
            doomed = RequestStream("doomed", 2)
            await front.add(doomed, [[6] * 10], [_params(50), _params(50)])
            items = await _drain(doomed)
            assert isinstance(items[-1], StreamError) and items[-1].status == 500
            assert front.stats.num_running_reqs == 0 and front.stats.kv_cache_usage == 0
            after = RequestStream("after", 1)
            await front.add(after, [[7] * 10], [_params(4)])
            items = await _drain(after)
            assert items[-1].finish_reason == "length" and items[-1].num_output_tokens == 4
        finally:
            front.stop()
            await asyncio.to_thread(front.join, 10)

    asyncio.run(main())


def test_a_stop_queued_while_the_engine_fails_still_stops_the_loop(engine):
    """The loop keeps refusing adds after a failure until it is stopped; a stop that
    arrived while the failing step ran must not be lost in the refusals (the thread would
    then never end, and hold the engine)."""
    import threading

    from llmfast.executor import ExecutorError

    started, stopped = threading.Event(), threading.Event()

    def failing_step():
        started.set()
        stopped.wait(10)
        raise ExecutorError("worker rank 0 died (in this test)")

    async def main():
        front = AsyncEngine(engine)
        engine.step = failing_step  # shadows the method on this instance only
        try:
            front.start()
            rs = RequestStream("x", 1)
            await front.add(rs, [[5] * 4], [_params(3)])
            assert await asyncio.to_thread(started.wait, 10)
            front.stop()  # queued while the step is still running
            stopped.set()
            await asyncio.to_thread(front.join, 10)
            assert not front._thread.is_alive()
            assert front.failure == "worker rank 0 died (in this test)"
            assert isinstance(await rs.get(), StreamError)
        finally:
            del engine.step
            stopped.set()

    asyncio.run(main())
    assert not engine.has_unfinished()  # the request was aborted
