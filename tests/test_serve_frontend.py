"""The server's frontend over the engine core's busy loop, connected by ZeroMQ as in
`llmfast serve`: requests share steps and read as offline, an abort frees blocks before
the next step, a failing step ends only the live requests, a core that stops for good or
whose process dies ends every live request with a 503 and /health says so, and a request
the core would refuse never leaves the frontend.

Most tests run the busy loop (`EngineCoreProc`) on a thread of this process over a real
engine, so that its step can be made to fail; the last one kills a real core process."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from llmfast.sampling_params import SamplingParams
from llmfast.serve.frontend import Frontend
from llmfast.serve.frontend_types import ChoiceDelta, DeltaQueue, EngineUnavailable, StreamError
from tests.serve_server import drain as _drain
from tests.serve_server import offline_text as engine_text
from tests.serve_server import serving_front
from tests.serve_server import wait_until as _until
from tests.helpers.engine_config import engine_config


@pytest.fixture(scope="module")
def engine(serve_model_dir):
    from llmfast import LLM

    return LLM(str(serve_model_dir), kv_cache_memory=32 << 20).engine


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_requests_share_steps_and_match_offline(engine):
    offline = [engine_text(engine, [3 + i] * 20, 8) for i in range(3)]

    async def main():
        async with serving_front(engine) as (front, _):
            streams = [DeltaQueue(f"r{i}", 1) for i in range(3)]
            await asyncio.gather(*(front.add(rs, [[3 + i] * 20], [_params(8)])
                                   for i, rs in enumerate(streams)))
            return await asyncio.gather(*(_drain(rs) for rs in streams))

    results = asyncio.run(main())
    for items, expected in zip(results, offline):
        assert sum(d.num_new_tokens for d in items) == 8
        assert items[-1].finish_reason == "length" and items[-1].num_output_tokens == 8
        assert "".join(d.text for d in items) == expected


def test_abort_frees_blocks_and_a_failed_step_is_contained(engine, monkeypatch):
    async def main():
        async with serving_front(engine) as (front, _):
            rs = DeltaQueue("long", 1)
            await front.add(rs, [[5] * 40], [_params(400)])
            first = await rs.get()
            assert first.num_new_tokens >= 1
            assert front.stats.kv_cache_usage > 0
            front.abort(rs.engine_ids)
            await _until(lambda: front.stats.num_running_reqs == 0, "the abort applied")
            assert front.stats.kv_cache_usage == 0

            real_step, calls = engine.core.step, 0

            def failing_step():
                nonlocal calls
                calls += 1
                if calls == 3:
                    raise RuntimeError("boom")
                return real_step()

            monkeypatch.setattr(engine.core, "step", failing_step)
            doomed = DeltaQueue("doomed", 2)
            await front.add(doomed, [[6] * 10], [_params(50), _params(50)])
            items = await _drain(doomed)
            assert isinstance(items[-1], StreamError) and items[-1].status == 500
            await _until(lambda: front.stats.num_running_reqs == 0, "the failure applied")
            assert front.stats.kv_cache_usage == 0
            after = DeltaQueue("after", 1)
            await front.add(after, [[7] * 10], [_params(4)])
            items = await _drain(after)
            assert items[-1].finish_reason == "length" and items[-1].num_output_tokens == 4

    asyncio.run(main())


def test_a_core_that_stops_for_good_ends_every_request_and_health_says_why(engine,
                                                                         monkeypatch):
    from llmfast.executor import ExecutorError
    from llmfast.serve.api.app import ServeConfig, build_app

    def dead_step():
        raise ExecutorError("worker rank 1 died (in this test)")

    async def main():
        async with serving_front(engine) as (front, proc):
            app = build_app(front, ServeConfig(model_name="tiny"))
            monkeypatch.setattr(engine.core, "step", dead_step)
            rs = DeltaQueue("x", 1)
            await front.add(rs, [[5] * 4], [_params(30)])
            item = await asyncio.wait_for(rs.get(), 30)
            assert isinstance(item, StreamError) and item.status == 503
            assert "worker rank 1 died" in item.message
            assert "worker rank 1 died" in front.failure and not front.running
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                reply = await client.get("/health")
            assert reply.status_code == 503 and "worker rank 1" in reply.json()["message"]
            with pytest.raises(EngineUnavailable, match="worker rank 1"):
                await front.add(DeltaQueue("y", 1), [[5] * 4], [_params(2)])
            assert proc.failure == "worker rank 1 died (in this test)"

    asyncio.run(main())
    monkeypatch.undo()
    engine.abort_many(list(engine.scheduler.requests))
    assert not engine.has_unfinished()


def test_a_request_the_core_would_refuse_never_leaves_the_frontend(engine, monkeypatch):
    sent = []

    async def main():
        async with serving_front(engine) as (front, _):
            monkeypatch.setattr(front._client, "add_requests", sent.append)
            vocab = engine.config.model.vocab_size
            max_len = engine.config.scheduler.max_model_len
            for prompt, params, what in (
                    ([vocab], _params(2), "prompt token ids must be in"),
                    ([1] * max_len, _params(2), "leaves no room"),
                    ([1, 2], SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                    ([1, 2], SamplingParams(allowed_token_ids=[vocab + 3]),
                     "allowed_token_ids")):
                with pytest.raises(ValueError, match=what):
                    await front.add(DeltaQueue("bad", 1), [prompt], [params])
            ok = DeltaQueue("ok", 1)
            await front.add(ok, [[1, 2]], [_params(2)])
            assert len(sent) == 1 and [r.request_id for r in sent[0]] == ["ok-0"]
            front.abort(ok.engine_ids)

    asyncio.run(main())


def test_the_core_process_dying_ends_every_request(serve_model_dir):
    """A real core process, killed mid-stream: the stream ends with a 503 naming it, the
    front refuses new requests, and nothing waits for the dead process."""
    import logging

    from llmfast.engine.args import EngineArgs
    from llmfast.serve.launcher import CoreHandle
    from llmfast.serve.server import frontend_spec

    config, source = engine_config(EngineArgs.from_kwargs(
        model=str(serve_model_dir), kv_cache_memory=32 << 20))
    core = CoreHandle(config, source, logging.WARNING)

    async def main():
        front = Frontend(frontend_spec(core, config, source, "tiny"))
        front.start()
        failed = asyncio.Event()
        front.on_failure = failed.set
        try:
            rs = DeltaQueue("a", 1)
            await front.add(rs, [[5] * 9], [_params(100_000)])
            assert isinstance(await asyncio.wait_for(rs.get(), 60), ChoiceDelta)
            os.kill(core.pid, signal.SIGKILL)
            while True:
                item = await asyncio.wait_for(rs.get(), 30)
                if isinstance(item, StreamError):
                    break
            assert item.status == 503 and "engine core process" in item.message
            assert "exited" in item.message
            await asyncio.wait_for(failed.wait(), 10)
            with pytest.raises(EngineUnavailable, match="exited"):
                await front.add(DeltaQueue("b", 1), [[5] * 9], [_params(4)])
        finally:
            front.stop()
            front.join()

    try:
        asyncio.run(main())
    finally:
        core.stop()
    assert core.popen.returncode == -signal.SIGKILL
