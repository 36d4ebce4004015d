"""Engine behaviour that needs a tokenizer: stop strings, streaming deltas, logprobs."""

from __future__ import annotations

import math

import pytest

from llmfast import LLM, SamplingParams
from tests.helpers.chat_model import make_chat_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_chat_model(tmp_path_factory.mktemp("text") / "model")
    return LLM(str(path), device="cpu", max_model_len=256, block_size=8)


def _greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_stop_string_cuts_text_exactly(llm):
    full = llm.generate("hello there", _greedy())[0].outputs[0].text
    assert len(full) > 12, full
    stop = full[6:9]
    cut = full[: full.index(stop)]
    out = llm.generate("hello there", _greedy(stop=[stop, "\x00never"]))[0].outputs[0]
    assert out.text == cut
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_string_kept_when_asked(llm):
    """vLLM's include_stop_str_in_output: the text runs to the end of the stop string,
    streamed or not; the rest of the step's text is cut as without it."""
    full = llm.generate("hello there", _greedy())[0].outputs[0].text
    stop = full[6:9]
    kept = full[: full.index(stop) + len(stop)]
    params = _greedy(stop=[stop], include_stop_str_in_output=True)
    out = llm.generate("hello there", params)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (kept, "stop", stop)
    deltas = [o.outputs[0].delta_text for o in llm.stream("hello there", params)]
    assert "".join(deltas) == kept
    with pytest.raises(ValueError, match="include_stop_str_in_output must be True or False"):
        SamplingParams(include_stop_str_in_output="yes")


def test_streamed_deltas_equal_final_text_and_hide_stop(llm):
    full = llm.generate("The capital", _greedy())[0].outputs[0].text
    stop = full[10:14]
    deltas = []
    last = None
    for out in llm.stream("The capital", _greedy(stop=[stop])):
        deltas.append(out.outputs[0].delta_text)
        last = out
    assert last.finished
    assert "".join(deltas) == last.outputs[0].text == full[: full.index(stop)]
    assert stop not in "".join(deltas)


def test_stream_close_aborts_and_frees_blocks(llm):
    stream = llm.stream("Tell me a story", _greedy(max_tokens=200))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    stats = llm.engine.stats()
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0


def test_stop_token_ids(llm):
    full = llm.generate("hello", _greedy())[0].outputs[0]
    stop_id = full.token_ids[4]
    out = llm.generate("hello", _greedy(stop_token_ids=[stop_id]))[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_logprobs(llm):
    out = llm.generate("hello", _greedy(max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        top = sorted(entry.values(), reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert math.isclose(entry[token], top[0], rel_tol=1e-6)
        assert all(v <= 0.0 for v in entry.values())
        assert 3 <= len(entry) <= 4


def test_text_prompts_and_chat_template(llm):
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    a = llm.generate({"prompt_token_ids": ids}, _greedy(max_tokens=8))[0]
    b = llm.generate(llm.tokenizer.decode(ids, skip_special_tokens=False), _greedy(max_tokens=8))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def _text_after_tokens(llm, prompt, params, n: int) -> str:
    """The request's text once its first n tokens are in (streamed, no stop strings, so
    nothing is held back)."""
    count, text = 0, ""
    for out in llm.stream(prompt, params):
        count += len(out.outputs[0].delta_token_ids)
        text = out.outputs[0].text
        if count >= n:
            break
    return text


def test_min_tokens_holds_back_stop_strings(llm):
    """Like vLLM: a stop string counts only if it ends in text of a token past min_tokens."""
    min_tokens = 8
    full = llm.generate("hello there", _greedy(24))[0].outputs[0]
    early = _text_after_tokens(llm, "hello there", _greedy(24), min_tokens)
    assert full.text.startswith(early) and len(early) >= 3, (early, full.text)
    stop = early[1:3]
    # Without min_tokens it stops inside the first tokens...
    cut = llm.generate("hello there", _greedy(24, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) <= min_tokens
    # ...with it, at the first match ending past their text, or not at all.
    out = llm.generate("hello there", _greedy(24, stop=[stop], min_tokens=min_tokens))[0].outputs[0]
    idx = full.text.find(stop, len(early) - len(stop) + 1)
    if idx == -1:
        assert (out.text, out.finish_reason) == (full.text, "length")
    else:
        assert (out.text, out.finish_reason, out.stop_reason) == (full.text[:idx], "stop", stop)
    assert len(out.token_ids) > min_tokens


def test_min_tokens_holds_back_stop_token_ids(llm):
    min_tokens = 6
    full = llm.generate("hello", _greedy(24))[0].outputs[0]
    stop_id = full.token_ids[1]
    out = llm.generate("hello", _greedy(24, stop_token_ids=[stop_id], min_tokens=min_tokens))[0]
    ids = out.outputs[0].token_ids
    assert stop_id not in ids[:min_tokens]  # banned by the sampler, not merely ignored
    if out.outputs[0].finish_reason == "stop":
        assert ids[-1] == stop_id and len(ids) > min_tokens and stop_id not in ids[:-1]
    else:
        assert len(ids) == 24 and stop_id not in ids


def test_offline_text_decoded_at_the_end_equals_the_streamed_text(llm):
    """A request whose text is read only when it ends (offline, no stop strings) is
    decoded once, at the end; its text is the streamed one, sampled tokens that split
    characters or are (skipped) special tokens included."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, ignore_eos=True)
              for s in range(12)]
    prompts = [f"story {i}: 你好 😀" for i in range(12)]
    offline = llm.generate(prompts, params)
    for prompt, p, done in zip(prompts, params, offline):
        *_, last = llm.stream(prompt, p)
        assert done.outputs[0].token_ids == last.outputs[0].token_ids
        assert done.outputs[0].text == last.outputs[0].text
    # Random sampling over this vocabulary samples special tokens (ids 0-2, skipped in the
    # text) and splits characters: the test covers both.
    assert any(t < 3 for o in offline for t in o.outputs[0].token_ids)
    tok = llm.tokenizer
    assert any("\ufffd" in tok.decode(o.outputs[0].token_ids[i:i + 1])
               for o in offline for i in range(60))
