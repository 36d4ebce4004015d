"""The server's frontend tokenises on threads of its own: running requests keep getting
tokens while a prompt is tokenised, an abort reaches choices not yet added, and a stop
answers adds still being tokenised. Over a real engine core (its busy loop on a thread,
connected as in `llmfast serve`); the tokenizer of the preparer is the frontend's own,
behind a gate the test opens (the only thing not real: when it runs)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import sys
import threading
import time

import pytest

from llmfast.sampling_params import SamplingParams
from llmfast.serve import frontend, prompt_preparer
from llmfast.serve.frontend import Frontend
from llmfast.serve.frontend_types import ChoiceDelta, DeltaQueue, EngineUnavailable
from tests.serve_server import drain as _drain
from tests.serve_server import offline_text as _offline_text
from tests.serve_server import serving_front
from tests.serve_server import wait_until as _wait_until

GATED = "hello there, the capital of France"  # a prompt whose encode waits for the gate


@pytest.fixture(scope="module")
def engine(serve_model_dir):
    from llmfast import LLM

    return LLM(str(serve_model_dir), kv_cache_memory=32 << 20).engine


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class _Gate:
    def __init__(self) -> None:
        self.entered = threading.Event()  # an encode of GATED has begun
        self.open = threading.Event()
        self.threads: list[str] = []  # the threads that encoded GATED


class _GatedHF:
    """The tokenizer's transformers object, whose encode of GATED waits for the gate."""

    def __init__(self, inner, gate: _Gate) -> None:
        self._inner, self._gate = inner, gate

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __deepcopy__(self, memo):  # the preparer's copy shares the gate
        return _GatedHF(copy.deepcopy(self._inner, memo), self._gate)

    def encode(self, text, **kwargs):
        if text == GATED:
            self._gate.threads.append(threading.current_thread().name)
            self._gate.entered.set()
            assert self._gate.open.wait(30), "the test never opened the gate"
        return self._inner.encode(text, **kwargs)


@pytest.fixture
def gate(engine, monkeypatch):
    """The preparer's tokenizer gated (the engine's own stays as it is)."""
    import dataclasses

    gate = _Gate()
    real_copy = prompt_preparer._own_copy

    def gated_copy(tokenizer):
        own = real_copy(tokenizer)
        return dataclasses.replace(own, hf=_GatedHF(own.hf, gate))

    monkeypatch.setattr(prompt_preparer, "_own_copy", gated_copy)
    # Every job to the preparer's threads (small ones are otherwise prepared inline).
    monkeypatch.setattr(frontend, "INLINE_JOB_CHARS", -1)
    yield gate
    gate.open.set()


async def _running(front: Frontend) -> DeltaQueue:
    """A request that streams until aborted, past its first token."""
    running = DeltaQueue("running", 1)
    await front.add(running, [[5] * 8], [_params(10_000)])
    await asyncio.wait_for(running.get(), 30)
    return running


@contextlib.asynccontextmanager
async def _serving(engine, gate: _Gate | None = None):
    """A Frontend over `engine`'s core, started, and stopped at the end (the gate opened
    first: after a failure the stop would otherwise wait for a gated encode)."""
    async with serving_front(engine) as (front, _):
        try:
            yield front
        finally:
            if gate is not None:
                gate.open.set()


def test_requests_keep_running_while_a_prompt_is_tokenized(engine, gate):
    """While the preparer's encode of GATED is held, a running request gets token after
    token (before: the engine thread tokenised it, and nothing stepped); the gated prompt
    then generates what the engine alone makes of it."""
    want = _offline_text(engine, GATED, 6)

    async def main():
        async with _serving(engine, gate) as front:
            running = await _running(front)
            gated = DeltaQueue("gated", 1)
            add = asyncio.ensure_future(front.add(gated, [GATED], [_params(6)]))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            for _ in range(5):  # tokens while the encode is held
                item = await asyncio.wait_for(running.get(), 30)
                assert isinstance(item, ChoiceDelta) and item.num_new_tokens == 1
            assert not add.done()
            gate.open.set()
            prepared = await asyncio.wait_for(add, 30)
            items = await _drain(gated)
            front.abort(running.engine_ids)
            return prepared, items

    prepared, items = asyncio.run(main())
    assert gate.threads == ["llmfast-tokenize"]
    assert list(prepared[0].token_ids) == engine.tokenizer.encode(GATED)
    assert "".join(d.text for d in items) == want
    assert items[-1].finish_reason == "length" and items[-1].num_output_tokens == 6


def test_an_abort_reaches_choices_not_yet_added(engine, gate):
    """An abort that arrives while its add is being tokenised, or between its slices,
    leaves nothing of it running; the add is still answered."""

    async def main():
        async with _serving(engine, gate) as front:
            running = await _running(front)
            # Aborted while its prompt is tokenised: none of it is ever added.
            early = DeltaQueue("early", 3)
            add = asyncio.ensure_future(front.add(early, [GATED], [_params(10_000)] * 3))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            front.abort(early.engine_ids)
            gate.open.set()
            await asyncio.wait_for(add, 30)
            # Aborted between slices: the choices added so far stop, the rest never start.
            late = DeltaQueue("late", 8)
            add = asyncio.ensure_future(front.add(late, [[4] * 6], [_params(10_000)] * 8))
            first = await asyncio.wait_for(late.get(), 30)
            assert isinstance(first, ChoiceDelta)
            front.abort(late.engine_ids)
            await asyncio.wait_for(add, 30)
            await _wait_until(lambda: front.stats.num_running_reqs == 1, "one request runs")
            front.abort(running.engine_ids)
            await _wait_until(lambda: front.stats.num_running_reqs == 0, "none runs")
            assert front.stats.num_waiting_reqs == 0 and front.stats.kv_cache_usage == 0
            assert early.get_nowait() is None
            assert not front._unapplied and not front._cancelled

    asyncio.run(main())


def test_a_stop_answers_adds_still_being_tokenized_at_once(engine, gate):
    """Stopping while an add's prompt is being tokenised (and stays so), with a query
    queued behind it: both are answered with EngineUnavailable, and the loop ends without
    waiting for the encode."""
    import time

    from llmfast.serve.frontend_types import TokenizeQuery

    async def main():
        async with serving_front(engine) as (front, _):
            add = asyncio.ensure_future(front.add(DeltaQueue("gated", 1), [GATED],
                                                  [_params(4)]))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            query = asyncio.ensure_future(front.query(TokenizeQuery("hello", None)))
            await asyncio.sleep(0.05)  # the query reaches the preparer's queue
            start = time.monotonic()
            front.stop()
            assert not gate.open.is_set()  # the encode still holds
            for pending in (add, query):
                with pytest.raises(EngineUnavailable, match="shutting down"):
                    await asyncio.wait_for(pending, 10)
            assert time.monotonic() - start < 5
            gate.open.set()

    asyncio.run(main())


def test_a_long_prompt_does_not_hold_up_the_short_ones(engine, gate, monkeypatch):
    """A prompt past LARGE_JOB_CHARS is tokenised in the large lane: while its encode is
    held, a short request is added and generates."""
    long_text = "hello there " * 100  # 1200 characters: past the limit set here
    monkeypatch.setattr(prompt_preparer, "LARGE_JOB_CHARS", 1000)
    monkeypatch.setattr(sys.modules[__name__], "GATED", long_text)

    async def main():
        async with _serving(engine, gate) as front:
            slow = asyncio.ensure_future(front.add(DeltaQueue("long", 1), [long_text],
                                                   [_params(2)]))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            short = DeltaQueue("short", 1)
            await asyncio.wait_for(front.add(short, [[4] * 6], [_params(3)]), 10)
            items = await _drain(short)
            assert items[-1].finish_reason == "length" and not slow.done()
            gate.open.set()
            await asyncio.wait_for(slow, 30)

    asyncio.run(main())
    assert gate.threads == ["llmfast-tokenize-large"]


def test_an_aborted_add_stops_between_its_prompts(engine, gate, monkeypatch):
    """An add of three prompts whose client goes away while the first is encoded: the
    other two are never tokenised, and nothing of it is added."""
    others = ["the capital of Italy is Rome", "tell me a story"]
    encoded: list[str] = []

    async def main():
        async with _serving(engine, gate) as front:
            real_encode = _GatedHF.encode

            def recording(self, text, **kwargs):
                encoded.append(text)
                return real_encode(self, text, **kwargs)

            monkeypatch.setattr(_GatedHF, "encode", recording)
            rs = DeltaQueue("three", 3)
            add = asyncio.ensure_future(front.add(rs, [GATED, *others], [_params(4)] * 3))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            front.abort(rs.engine_ids)
            await _wait_until(lambda: rs.engine_ids[0] in front._cancelled, "the abort")
            gate.open.set()
            with pytest.raises(EngineUnavailable, match="stopped while its prompts"):
                await asyncio.wait_for(add, 30)
            assert front.stats.num_running_reqs == front.stats.num_waiting_reqs == 0
            assert not front._unapplied and not front._cancelled

    asyncio.run(main())
    assert encoded == [GATED]


@pytest.mark.parametrize("model", ["serve", "random:smollm2-135m"])
def test_the_preparers_tokenizer_is_its_own(model, serve_model_dir):
    """The copy the preparer works with shares no Rust tokenizer with the engine's (whose
    cached decode would otherwise point at the original), and answers the same."""
    from llmfast.models.sources.model_source import resolve_model

    tok = resolve_model(str(serve_model_dir) if model == "serve" else model).load_tokenizer()
    tok.decode([5, 6, 7])  # fills the cached Rust decode
    own = prompt_preparer._own_copy(tok)
    assert own.hf is not tok.hf and own.rust_tokenizer is not tok.rust_tokenizer
    text = "hello there, how are you today?"
    assert own.encode(text) == tok.encode(text)
    assert own.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    chat = [{"role": "user", "content": text}]
    assert own.apply_chat_template(chat) == tok.apply_chat_template(chat)


def test_an_add_the_engine_would_refuse_is_refused_before_any_of_it_runs(engine):
    """Sliced, an add whose second prompt is out of the vocabulary must not have its first
    prompt's choices running (and finishing) before the refusal: checked whole first."""

    async def main():
        async with _serving(engine) as front:
            running = await _running(front)
            mixed = DeltaQueue("mixed", 8)
            with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, "):
                await asyncio.wait_for(front.add(mixed, [[4] * 6, [10**7]], [_params(2)] * 8),
                                       30)
            for _ in range(3):  # steps go on; nothing of the refused add is among them
                await asyncio.wait_for(running.get(), 30)
            assert mixed.get_nowait() is None
            assert front.stats.num_running_reqs == 1 and not front._unapplied
            front.abort(running.engine_ids)

    asyncio.run(main())


def _slow_preparer(engine, seconds: float):
    """A preparer whose adds take `seconds` each (small lane); records which it prepared."""
    import types

    from llmfast.serve.preparer_commands import AddCommand

    preparer = prompt_preparer.PromptPreparer(engine.tokenizer, "no tokenizer", "tiny",
                                              engine.config.scheduler.max_model_len, lambda: None)
    prepared = []

    def slow(command, should_stop):
        time.sleep(seconds)
        prepared.append(command)
        return []

    preparer._lanes[0].rules.prepare_add = slow
    commands = [AddCommand(types.SimpleNamespace(engine_ids=(f"r{i}",)), ([1],),
                           (_params(1),), i, False) for i in range(6)]
    return preparer, commands, prepared


def test_close_answers_for_every_job_not_handed_back_at_once(engine):
    """Closing waits for neither lane's job in progress (its result is dropped) nor starts
    the queued ones: it returns every command not handed back (one taken before is not
    among them), in order, within its timeout."""
    preparer, commands, prepared = _slow_preparer(engine, 0.3)
    preparer._lanes[1].rules.prepare_add = preparer._lanes[0].rules.prepare_add
    preparer.large_job_chars = 0  # odd commands to the large lane: both lanes get jobs
    preparer.start()
    for i, command in enumerate(commands):
        preparer.large_job_chars = 0 if i % 2 else 10**9
        preparer.submit(command)
    assert _wait(lambda: preparer.has_ready())
    taken = preparer.take_add()
    assert taken.command in commands[:2] and taken.error is None
    assert _wait(lambda: len(prepared) == 2)  # each lane has begun its second job
    start = time.perf_counter()
    left = preparer.close(timeout=0.1)
    assert time.perf_counter() - start < 0.3  # not the jobs' remaining ~0.3 s each
    assert left == [c for c in commands if c is not taken.command]
    assert _wait(lambda: len(prepared) == 4)  # the two in progress end, dropped
    time.sleep(0.35)  # (nothing else starts)
    assert len(prepared) == 4 and not preparer._ready_adds and preparer.take_add() is None
    assert preparer.close() == []


def test_each_lane_copies_the_tokenizer_as_it_starts(engine, monkeypatch):
    """Both copies are made by the lanes' own threads before any job (a copy holds the
    GIL for a while: not in the middle of serving)."""
    made = []
    real_copy = prompt_preparer._own_copy

    def recording(tokenizer):
        made.append(threading.current_thread().name)
        return real_copy(tokenizer)

    monkeypatch.setattr(prompt_preparer, "_own_copy", recording)
    preparer = prompt_preparer.PromptPreparer(engine.tokenizer, "no tokenizer", "tiny",
                                              engine.config.scheduler.max_model_len, lambda: None)
    preparer.start()
    try:
        assert _wait(lambda: len(made) == 2)
        assert sorted(made) == ["llmfast-tokenize", "llmfast-tokenize-large"]
        own = [lane.rules.tokenizer for lane in preparer._lanes]
        assert own[0] is not own[1] and engine.tokenizer not in own
    finally:
        preparer.close()


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_job_lanes_by_size():
    from llmfast.serve.preparer_commands import AddCommand, QueryCommand
    from llmfast.serve.frontend_types import ChatPrompt, DetokenizeQuery, TokenizeQuery

    def add(*prompts):
        return AddCommand(None, prompts, (), None, False)

    assert prompt_preparer.job_chars(add("abc", [1, 2])) == 5
    chat = ChatPrompt(({"role": "user", "content": "hello"}, {"role": "system", "content": ""}))
    assert prompt_preparer.job_chars(add(chat)) == 5
    assert prompt_preparer.job_chars(QueryCommand(TokenizeQuery("x" * 9, None), None)) == 9
    assert prompt_preparer.job_chars(QueryCommand(DetokenizeQuery((1, 2, 3)), None)) == 3
