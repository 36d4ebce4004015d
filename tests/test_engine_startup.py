"""The engine's start-up order: the tokenizer loads in a thread beside the in-process
runner's start-up (its end-of-sequence ids reach the runner afterwards), a
--chat-template loads first, and a failure on either side stops the start."""

from __future__ import annotations

import threading

import pytest

from llmfast import LLM, SamplingParams
from llmfast.config import ConfigError
from llmfast.executor.uni import UniExecutor
from llmfast.models.sources.model_source import ModelSource
from tests.helpers.chat_model import make_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    # The config's end of sequence (7) is not the tokenizer's (<|im_end|>, 2).
    return make_chat_model(tmp_path_factory.mktemp("startup") / "model", eos_token_id=7)


def _record_tokenizer_thread(monkeypatch) -> dict:
    """Where and when the tokenizer loads: its thread, and whether the runner's start-up
    had begun by then (the executor's initialize entered)."""
    seen: dict = {"initialize_entered": threading.Event()}
    load, initialize = ModelSource.load_tokenizer, UniExecutor.initialize

    def load_tokenizer(self):
        seen["thread"] = threading.current_thread()
        # Beside the runner: its start-up is under way while the tokenizer loads.
        seen["beside_runner"] = seen["initialize_entered"].wait(timeout=60)
        return load(self)

    def initialize_executor(self, eos_token_ids=(), progress=None):
        seen["initialize_eos"] = eos_token_ids
        seen["initialize_entered"].set()
        return initialize(self, eos_token_ids, progress)

    monkeypatch.setattr(ModelSource, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(UniExecutor, "initialize", initialize_executor)
    return seen


def test_tokenizer_loads_beside_the_runner_and_its_eos_reaches_the_sampler(chat_model,
                                                                            monkeypatch):
    seen = _record_tokenizer_thread(monkeypatch)
    llm = LLM(str(chat_model), device="cpu", max_model_len=128, block_size=8)
    engine = llm.engine
    assert seen["thread"] is not threading.main_thread() and seen["beside_runner"]
    assert seen["initialize_eos"] == ()  # the ids were not known yet
    stages = engine.startup_times
    assert "tokenizer_wait" in stages and "tokenizer" not in stages
    # The tokenizer's end of sequence (<|im_end|>) is not the checkpoint config's.
    im_end = engine.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in engine.source.config.eos_token_ids
    assert im_end in engine.eos_token_ids
    assert engine.runner.eos_token_ids == engine.eos_token_ids

    # The sampler holds the tokenizer's eos back for min_tokens, the engine stops on it
    # after: a bias makes it the greedy pick at every step.
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4,
                            logit_bias={im_end: 100.0})
    out = llm.generate("hello", params)[0].outputs[0]
    assert im_end not in out.token_ids[:4]
    assert out.token_ids[4:] == [im_end] and out.finish_reason == "stop"


def test_a_chat_template_loads_first(chat_model, monkeypatch):
    """A --chat-template is checked before the runner's start-up, not after it."""
    seen = _record_tokenizer_thread(monkeypatch)
    seen["initialize_entered"].set()  # (the load must not wait for it here)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    llm = LLM(str(chat_model), device="cpu", max_model_len=128, block_size=8,
              chat_template=template)
    assert seen["thread"] is threading.main_thread()
    assert "tokenizer" in llm.engine.startup_times
    assert seen["initialize_eos"] == llm.engine.eos_token_ids != ()

    monkeypatch.setattr(UniExecutor, "initialize", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(ConfigError, match="chat"):
        LLM(str(chat_model), device="cpu", max_model_len=128, block_size=8,
            chat_template="{% for m in messages %}")


def test_a_failed_tokenizer_load_fails_the_start(chat_model, monkeypatch):
    def broken(self):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(ModelSource, "load_tokenizer", broken)
    shut_down = []
    monkeypatch.setattr(UniExecutor, "shutdown", lambda self: shut_down.append(self))
    with pytest.raises(RuntimeError, match="tokenizer exploded"):
        LLM(str(chat_model), device="cpu", max_model_len=128, block_size=8)
    assert shut_down


def test_a_failed_runner_start_wins_over_the_tokenizer(chat_model, monkeypatch):
    """The runner's error comes as soon as it fails, the tokenizer still loading; its
    thread is a daemon, so that the process may exit without waiting for it."""
    loaded, release = threading.Event(), threading.Event()
    load = ModelSource.load_tokenizer

    def load_tokenizer(self):
        try:
            release.wait(timeout=60)
            return load(self)
        finally:
            loaded.set()

    def failing_initialize(self, eos_token_ids=(), progress=None):
        raise ConfigError("no room for the KV cache")

    monkeypatch.setattr(ModelSource, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(UniExecutor, "initialize", failing_initialize)
    with pytest.raises(ConfigError, match="no room for the KV cache"):
        LLM(str(chat_model), device="cpu", max_model_len=128, block_size=8)
    loading = [t for t in threading.enumerate() if t.name == "llmfast-tokenizer"]
    assert len(loading) == 1 and loading[0].daemon and not loaded.is_set()
    release.set()
    assert loaded.wait(timeout=60)  # the thread ends on its own


def test_graph_capture_minds_only_its_own_thread(monkeypatch):
    """The tokenizer's thread runs while CUDA graphs are captured: captures check the
    capturing thread's CUDA calls only (thread_local), so a call from another thread
    cannot fail them (the default, global mode, would)."""
    import torch

    from llmfast.cuda_graphs.capturers import CudaGraphCapturer

    begun = []

    class RecordingGraph:
        def capture_begin(self, **kw):
            begun.append(kw)

        def capture_end(self):
            pass

        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordingGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    capturer = CudaGraphCapturer(torch.device("cuda"))
    _, out = capturer.capture(lambda x: x + 1, (1,))
    assert out == 2
    assert begun == [{"pool": "pool", "capture_error_mode": "thread_local"}]
