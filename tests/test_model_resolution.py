"""Start-up's two steps before loading: `resolve_model(args)` finds the model and reads
what the config takes from disk (its config.json, its generation_config.json, the host's
free memory); `args.create_engine_config(resolved)` reads nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from llmfast.config import ConfigError
from llmfast.engine.args import EngineArgs
from llmfast.engine.model_resolution import resolve_model
from tests.helpers.chat_model import make_chat_model


def test_the_config_is_built_from_what_was_resolved_with_the_model_gone(tmp_path):
    model = make_chat_model(tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.25,
                                                              "max_new_tokens": 7}))
    args = EngineArgs(model=str(model), device="cpu", max_num_seqs=4)
    resolved = resolve_model(args)
    assert dict(resolved.sampling_defaults) == {"temperature": 0.25, "max_tokens": 7}
    shutil.rmtree(model)  # nothing left to read: the config must come from `resolved`
    config = args.create_engine_config(resolved)
    assert dict(config.sampling_defaults) == {"temperature": 0.25, "max_tokens": 7}
    assert config.model == resolved.source.config and config.model_path == str(model)
    assert config.scheduler.max_num_seqs == 4


def test_the_cpu_fit_uses_the_memory_measured_when_resolved():
    args = EngineArgs(model="random:qwen3-0.6b", device="cpu")
    resolved = resolve_model(args)
    roomy = dataclasses.replace(resolved, host_memory_available=64 << 30)
    tight = dataclasses.replace(resolved, host_memory_available=6 << 30)
    long_ = args.create_engine_config(roomy).scheduler.max_model_len
    short = args.create_engine_config(tight).scheduler.max_model_len
    assert short < long_ <= 8192
    # The same inputs give the same config: nothing else is read.
    assert args.create_engine_config(tight) == args.create_engine_config(tight)


@pytest.mark.parametrize("kwargs, words", [
    ({"dtype": "float16"}, "float16 is not supported on CPU"),
    ({"chat_template": "{% if %}"}, "chat template"),
])
def test_bad_arguments_fail_before_the_model_is_looked_for(kwargs, words):
    args = EngineArgs(model="/nonexistent/model", device="cpu", **kwargs)
    with pytest.raises(ConfigError, match=words):
        resolve_model(args)
