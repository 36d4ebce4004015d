"""Chat's sampling defaults (flags > the model's generation_config.json > the default
model's card > the local-chat defaults), shown at the start and in /stats, and the stop
of a reply caught in a loop (`--max-repeats`), with its tail check against a naive scan."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from llmfast.cli.chat.session import (
    LOCAL_CHAT_DEFAULTS,
    ChatCommandError,
    ChatSession,
    ChatSettings,
)
from llmfast.cli.main import app
from llmfast.cli.chat.repetition import MAX_PERIOD, MIN_SPAN, repeating_period
from llmfast.models.sources.default_model import DEFAULT_MODEL_CARD_SAMPLING
from tests.helpers.chat_model import make_chat_model

# ---------------------------------------------------------------------- loop check


def _naive_period(ids: list[int], repeats: int, max_period: int = MAX_PERIOD,
                  min_span: int = MIN_SPAN) -> int | None:
    """The definition, spelled out: the smallest p whose span (p * repeats tokens, at
    least min_span) ends the sequence as one block of p tokens over and over."""
    if repeats < 2:
        return None
    for p in range(1, max_period + 1):
        span = max(p * repeats, min_span)
        n = len(ids)
        if n >= span and all(ids[i] == ids[i - p] for i in range(n - span + p, n)):
            return p
    return None


def test_repeating_period_matches_a_naive_scan():
    rng = random.Random(0)
    cases = 0
    for _ in range(600):
        head = [rng.randrange(50) for _ in range(rng.randrange(0, 120))]
        period = rng.choice([1, 2, 3, 7, 16, 33, 64, 65])
        block = [rng.randrange(3 if rng.random() < 0.3 else 50) for _ in range(period)]
        times = rng.choice([0, 1, 2, 3, 4, 5, 9])
        cut = rng.randrange(period)  # loops rarely end on a block boundary
        ids = head + block * times + block[:cut]
        for repeats in (0, 2, 3, 4):
            assert repeating_period(ids, repeats) == _naive_period(ids, repeats), (ids, repeats)
            cases += 1
    assert cases == 2400


def test_repeating_period_examples():
    prose = list(range(100, 200))
    assert repeating_period(prose, 4) is None
    sentence = list(range(10, 30))  # 20 tokens
    assert repeating_period(prose + sentence * 4, 4) == 20
    assert repeating_period(prose + sentence * 3, 4) is None  # 3 times: not yet
    assert repeating_period(prose + [7] * MIN_SPAN, 4) == 1
    assert repeating_period(prose + [7] * (MIN_SPAN - 1), 4) is None  # `-----` is no loop
    assert repeating_period(prose + sentence * 4, 0) is None  # off


# ---------------------------------------------------------------------- settings


def test_resolve_layers_and_origins():
    settings, origin = ChatSettings.resolve({}, None)
    assert {k: getattr(settings, k) for k in LOCAL_CHAT_DEFAULTS} == LOCAL_CHAT_DEFAULTS
    assert set(origin.values()) == {"local-chat default"}
    assert LOCAL_CHAT_DEFAULTS["top_k"] == 40 and LOCAL_CHAT_DEFAULTS["min_p"] == 0.05

    # The default model: its card's values, the local-chat defaults for the rest.
    settings, origin = ChatSettings.resolve({}, DEFAULT_MODEL_CARD_SAMPLING)
    assert (settings.temperature, settings.top_p) == (0.2, 0.9)
    assert origin["temperature"] == origin["top_p"] == "model card"
    assert settings.top_k == 40 and origin["top_k"] == "local-chat default"

    # The model's generation_config.json beats the card; a flag beats both.
    settings, origin = ChatSettings.resolve({"temperature": 0.6, "max_tokens": 99},
                                            DEFAULT_MODEL_CARD_SAMPLING, temperature=None,
                                            top_k=5, max_tokens=300, max_repeats=6)
    assert settings.temperature == 0.6 and origin["temperature"] == "generation_config.json"
    assert settings.top_k == 5 and origin["top_k"] == "flag"
    assert settings.max_tokens == 300  # a generation's max_new_tokens is not a chat turn's
    assert settings.max_repeats == 6
    line = settings.describe(origin)
    assert "temperature 0.6 (generation_config.json)" in line
    assert "top_p 0.9 (model card)" in line and "min_p 0.05," in line
    assert "loops stop at 6 repeats" in line


def test_bad_max_repeats_is_refused():
    with pytest.raises(ValueError, match="max_repeats"):
        ChatSettings(max_repeats=1).params()
    assert ChatSettings(max_repeats=0).params().max_tokens == 512


# ---------------------------------------------------------------------- a looping model


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory) -> Path:
    """The tiny chat model with its lm_head zeroed: every logit is 0, so greedy decoding
    picks token 0 at every step, a loop of period 1 from the first token."""
    path = make_chat_model(tmp_path_factory.mktemp("looping-model"))
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"].zero_()
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


def test_session_stops_a_loop_and_keeps_one_copy(looping_model):
    from llmfast import LLM

    llm = LLM(str(looping_model), device="cpu", block_size=8)
    session = ChatSession(llm, ChatSettings(temperature=0.0, max_tokens=200, ignore_eos=True))
    result = session.reply("hello there", lambda d: None)
    assert result.finish_reason == "repeating" and result.repeating_period == 1
    assert result.num_output_tokens == MIN_SPAN  # stopped the step the loop was seen
    assert session.totals.repeating == 1 and len(session.history) == 2  # the turn is kept
    assert not llm.engine.has_unfinished()  # the request was aborted
    # Off: the same reply runs to max_tokens.
    session.handle_command("/max_repeats 0")
    assert session.origin["max_repeats"] == "/max_repeats"
    result = session.reply("hello there", lambda d: None)
    assert result.finish_reason == "length" and result.num_output_tokens == 200
    with pytest.raises(ChatCommandError):
        session.handle_command("/max_repeats 1")


def test_piped_chat_shows_settings_and_the_repeating_notice(looping_model):
    result = CliRunner().invoke(app, [
        "chat", "--model", str(looping_model), "--device", "cpu", "--temperature", "0",
        "--ignore-eos", "--max-tokens", "100"], input=b"hello there\n/stats\n")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith("sampling: temperature 0 (flag), top_k 40, top_p 0.95,")
    assert "loops stop at 4 repeats" in lines[0]
    stats = [line for line in lines if line.startswith("TTFT")]
    assert len(stats) == 1 and stats[0].endswith("stopped: repeating")
    assert f"· {MIN_SPAN} tokens ·" in stats[0]
    assert "1 stopped repeating" in result.stderr  # /stats
    assert sum(line.startswith("sampling:") for line in lines) == 2  # at start and /stats
