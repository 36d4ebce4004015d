"""Deltas that queue up for a stream go out merged: one chunk per choice and write
(stream.merged_in_order, api/generation.py's SSE loop). Oracle: the same deltas applied
one by one, as a client that keeps up would get them."""

from __future__ import annotations

import asyncio
import json
import random

from llmfast.serve.api.generation import _events
from llmfast.serve.api.responses import ResponseBuilder
from llmfast.serve.frontend_types import (
    ChoiceDelta,
    DeltaQueue,
    PreparedPrompt,
    StreamError,
    TokenLogprob,
    merge_deltas,
    merged_in_order,
)


def _delta(index, text, n_out, finish=None, logprobs=None, prompt_logprobs=None):
    return ChoiceDelta(index=index, text=text, num_new_tokens=1, num_output_tokens=n_out,
                       num_cached_tokens=3, logprobs=logprobs, finish_reason=finish,
                       stop_reason=None, prompt_logprobs=prompt_logprobs)


def _lp(token_id):
    return TokenLogprob(f"t{token_id}", token_id, -0.5 * token_id, ((f"t{token_id}", token_id,
                                                                    -0.5 * token_id),))


def _random_stream(rng, num_choices, tokens_each, with_logprobs):
    """Deltas of several choices interleaved as steps would produce them."""
    counts = [0] * num_choices
    items = []
    while any(c < tokens_each for c in counts):
        for i in range(num_choices):
            if counts[i] < tokens_each and rng.random() < 0.7:
                counts[i] += 1
                finish = "length" if counts[i] == tokens_each else None
                lps = (_lp(counts[i]),) if with_logprobs else None
                items.append(_delta(i, f"<{i}.{counts[i]}>", counts[i], finish, lps))
    return items


def test_merging_keeps_what_each_choice_did():
    rng = random.Random(0)
    for _ in range(50):
        items = _random_stream(rng, rng.randint(1, 4), rng.randint(1, 6), rng.random() < 0.5)
        merged = merged_in_order(items)
        assert len(merged) <= len(items)
        for index in {d.index for d in items}:
            mine = [d for d in items if d.index == index]
            got = [d for d in merged if d.index == index]
            assert "".join(d.text for d in got) == "".join(d.text for d in mine)
            assert sum(d.num_new_tokens for d in got) == len(mine)
            assert got[-1].num_output_tokens == mine[-1].num_output_tokens
            assert got[-1].finish_reason == mine[-1].finish_reason
            assert all(d.finish_reason is None for d in got[:-1])
            if mine[0].logprobs is not None:
                assert sum((d.logprobs for d in got), ()) == sum((d.logprobs for d in mine), ())
        # One delta per choice (nothing finishes early, no error in between).
        assert sorted(d.index for d in merged) == sorted({d.index for d in items})
        # Without merging logprobs, deltas that carry them stay as they are.
        if items[0].logprobs is not None:
            assert merged_in_order(items, with_logprobs=False) == items


def test_interleaved_choices_merge_each_into_its_first_place():
    items = [_delta(0, "a", 1), _delta(1, "x", 1), _delta(0, "b", 2),
             _delta(1, "y", 2, finish="stop"), _delta(0, "c", 3)]
    merged = merged_in_order(items)
    assert [(d.index, d.text, d.finish_reason) for d in merged] == [
        (0, "abc", None), (1, "xy", "stop")]


def test_an_error_ends_a_run_and_keeps_its_place():
    error = StreamError("the server is shutting down", 503)
    items = [_delta(0, "a", 1), _delta(0, "b", 2), error, _delta(0, "c", 3)]
    merged = merged_in_order(items)
    assert [getattr(m, "text", m) for m in merged] == ["ab", error, "c"]


def test_the_first_deltas_prompt_logprobs_survive():
    head = (TokenLogprob("p", 5, None, ()),)
    merged = merge_deltas(_delta(0, "a", 1, prompt_logprobs=head), _delta(0, "b", 2))
    assert merged.prompt_logprobs == head and merged.text == "ab"
    assert merged.num_new_tokens == 2 and merged.num_cached_tokens == 3


def _sse(kind, items, n=1, num_prompts=1, want_logprobs=False):
    """Run the SSE generator over a stream that already holds every item; returns the
    decoded chunks (the usage chunk last)."""
    prompts = [PreparedPrompt("hi", [1, 2, 3])] * num_prompts

    async def run():
        rs = DeltaQueue("cmpl-test", len(prompts) * n)
        for item in items:
            rs.put(item)
        builder = ResponseBuilder(kind, rs.request_id, "m", prompts, n,
                                  want_logprobs=want_logprobs)
        return builder, "".join([part async for part in _events(
            _NoFront(), _Metrics(), rs, builder, _Tracker(), True)])

    builder, text = asyncio.run(run())
    chunks = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return builder, chunks


class _NoFront:
    def abort(self, ids):  # pragma: no cover - the stream finishes
        raise AssertionError("a finished stream must not abort")


class _Tracker:
    def on_delta(self, delta):
        pass


class _Metrics:  # read only when a stream ends early (it does not here)
    pass


def test_a_lagging_completion_stream_gets_one_chunk_per_choice():
    rng = random.Random(1)
    items = _random_stream(rng, 2, 5, with_logprobs=False)
    _, chunks = _sse("completion", items, n=2)
    body, usage = chunks[:-1], chunks[-1]
    assert len(body) == 2 < len(items)
    for index in (0, 1):
        mine = [d for d in items if d.index == index]
        (got,) = [c["choices"][0] for c in body if c["choices"][0]["index"] == index]
        assert got["text"] == "".join(d.text for d in mine)
        assert got["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 10


def test_completion_logprobs_keep_each_tokens_text_offset():
    # Byte tokens of one character: each token's own text is U+FFFD, the streamed text
    # comes with the last; offsets must follow the streamed text, as delta by delta.
    def lp(i, token):
        return (TokenLogprob(token, i, -1.0, ((token, i, -1.0),)),)

    items = [_delta(0, "", 1, logprobs=lp(1, "\ufffd")),
             _delta(0, "", 2, logprobs=lp(2, "\ufffd")),
             _delta(0, "\u20ac", 3, logprobs=lp(3, "\ufffd")),
             _delta(0, "!", 4, finish="length", logprobs=lp(4, "!"))]
    _, chunks = _sse("completion", items, want_logprobs=True)
    body = chunks[:-1]
    assert len(body) == len(items)  # not merged
    offsets = [o for c in body for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 0, 0, 1]
    assert "".join(c["choices"][0]["text"] for c in body) == "\u20ac!"


def test_a_lagging_chat_stream_joins_content():
    items = [_delta(0, "Hel", 1), _delta(0, "lo", 2), _delta(0, "!", 3, finish="stop")]
    _, chunks = _sse("chat", items)
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]
                if c["choices"]]
    # The role chunk, then one chunk with all three deltas' text.
    assert contents == ["", "Hello!"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
