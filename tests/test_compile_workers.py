"""Inductor's compile workers started ahead of a trace (llmfast/compile/workers.py): when
a trace is expected, and only for a device whose kernels they compile. The wiring into
CompiledModel (asked at construction and at the trace, never by a warm start) is tested
in test_precompiled.py beside the warm starts."""

from __future__ import annotations

import torch

from llmfast.compile import workers
from llmfast.compile.workers import start_compile_workers, trace_expected


def test_a_trace_is_expected_unless_a_saved_model_may_be_loaded(tmp_path):
    root = tmp_path / "precompiled"
    assert trace_expected(None)  # precompiling off
    assert trace_expected(root)  # nothing saved yet
    root.mkdir()
    assert trace_expected(root)
    (root / ".tmp-123").write_text("")  # a stray file is not a saved model
    assert trace_expected(root)
    (root / "fingerprint").mkdir()
    assert not trace_expected(root)


def test_workers_start_for_cuda_only(monkeypatch):
    import torch._inductor.async_compile as async_compile

    warmed = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: warmed.append(1))
    assert not start_compile_workers(torch.device("cpu"))
    assert warmed == []
    assert start_compile_workers(torch.device("cuda", 0))  # no CUDA needed to ask
    assert warmed == [1]


def test_a_pool_that_fails_to_start_is_logged_not_raised(monkeypatch, caplog):
    import torch._inductor.async_compile as async_compile

    def broken():
        raise RuntimeError("no processes here")

    monkeypatch.setattr(async_compile, "maybe_warm_pool", broken)
    assert not start_compile_workers(torch.device("cuda"))
    assert "no processes here" in caplog.text
    assert workers.logger.name == "llmfast.compile.workers"
